"""Writing specs: worktree -> new -> validate -> apply -> run, and validate speaking for the controller.

`autolab validate` must say exactly what the controller would: each refusal kind is
validated first, then applied and reconciled by the real controller, and the two
messages are compared. Validation must also leave nothing behind.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.cli import main as cli
from controller.lab import tracking
from controller.local import LocalLab, init_lab
from controller.lab.report import progress

SURFACE = "bench/train.py"


def git(lab: LocalLab, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=lab.root, capture_output=True, text=True,
                          check=True).stdout


def traces(lab: LocalLab) -> tuple[str, str, set[str]]:
    """What validation must not change: branches, worktrees, statuses and the ledger."""
    ledger = lab.root / "research" / "results.tsv"
    return (git(lab, "branch", "--list", "autolab/*"), git(lab, "worktree", "list"),
            {*lab.names(), ledger.read_text() if ledger.exists() else ""})


def udiff(old: str, new: str, path: str = SURFACE) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        f"a/{path}", f"b/{path}"))


def doc(lab: LocalLab, name: str, diff: str, parent: str | None = None, **spec) -> dict:
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": name},
            "spec": {"hypothesis": f"Hypothesis of {name}.",
                     "parent": parent or lab.repo.master().hash[:12], "diff": diff, **spec}}


def validate(lab: LocalLab, d: dict, tmp: Path, capsys) -> tuple[int, dict]:
    path = tmp / f"{d['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    before = traces(lab)
    rc = cli.main(["validate", str(path), "-o", "json", "--lab", str(lab.root)])
    findings = json.loads(capsys.readouterr().out)
    assert traces(lab) == before, "validate left a branch, worktree, status or ledger row"
    assert len(findings) == 1
    return rc, findings[0]


def controller_verdict(lab: LocalLab, d: dict) -> tuple[str, str, str]:
    """Apply the spec and let the real controller check it: (phase, reason, message)."""
    name = d["metadata"]["name"]
    lab.apply_file(d, "test")
    st = lab.reconcile_one(name, schedule=False).status
    checked = next(c for c in st["conditions"] if c["type"] == "Checked")
    return st["phase"], checked["reason"], checked["message"]


def same_as_controller(lab, d, tmp, capsys, phase: str, reason: str) -> dict:
    rc, f = validate(lab, d, tmp, capsys)
    assert (f["phase"], f["reason"]) == (phase, reason), f["message"]
    assert rc == (0 if phase == "Queued" else 1)
    assert (f["phase"], f["reason"], f["message"]) == controller_verdict(lab, d)
    return f


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> LocalLab:
    return init_lab(tmp_path_factory.mktemp("checks") / "lab", profile="tiny",
                        data="synthetic")


@pytest.fixture(scope="module")
def source(lab) -> str:
    return lab.repo.master_source()


# --- every refusal kind, in the controller's words ------------------------------------------

@pytest.mark.parametrize("kind,diff,reason", [
    ("other-file", lambda s: udiff("a\n", "b\n", "bench/prepare.py"), "DiffTouchesOtherFile"),
    ("rename", lambda s: "diff --git a/bench/train.py b/bench/t2.py\nsimilarity index 99%\n"
                         "rename from bench/train.py\nrename to bench/t2.py\n", "DiffRenames"),
    ("new-file", lambda s: "diff --git a/bench/x.py b/bench/x.py\nnew file mode 100644\n"
                           "--- /dev/null\n+++ b/bench/x.py\n@@ -0,0 +1 @@\n+x = 1\n",
     "DiffCreatesOrDeletes"),
    ("deleted-file", lambda s: "--- a/bench/train.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n",
     "DiffCreatesOrDeletes"),
    ("binary", lambda s: "diff --git a/bench/train.py b/bench/train.py\nGIT binary patch\n"
                         "literal 3\nabc\n", "DiffBinary"),
    ("dotdot", lambda s: "--- a/../bench/train.py\n+++ b/../bench/train.py\n@@ -1 +1 @@\n-a\n"
                         "+b\n", "DiffUnsafePath"),
    ("no-apply", lambda s: udiff(s.replace("DEPTH = 8", "DEPTH = 9"),
                                 s.replace("DEPTH = 8", "DEPTH = 10")), "DiffDoesNotApply"),
    ("no-compile", lambda s: udiff(s, s.replace("DEPTH = 8 ", "DEPTH = = 8 ")), "CompileError"),
    ("not-a-diff", lambda s: "make the model deeper\n", "DiffMalformed"),
])
def test_validate_refuses_each_bad_diff_with_the_controllers_message(lab, source, tmp_path,
                                                                      capsys, kind, diff, reason):
    f = same_as_controller(lab, doc(lab, f"bad-{kind}", diff(source)), tmp_path, capsys,
                           "Invalid", reason)
    assert not f["ok"]


def test_validate_refuses_an_unknown_parent_like_the_controller(lab, source, tmp_path, capsys):
    d = doc(lab, "bad-parent", udiff(source, source.replace("SEED = 42", "SEED = 43")),
            parent="deadbeef")
    f = same_as_controller(lab, d, tmp_path, capsys, "Invalid", "UnknownParent")
    assert f"current master {lab.repo.master().hash[:12]}" in f["message"]


def test_validate_reports_schema_errors_exactly_as_apply_does(lab, source, tmp_path, capsys):
    good = doc(lab, "schema", udiff(source, source.replace("SEED = 42", "SEED = 44")))
    broken = [
        {**good, "spec": {k: v for k, v in good["spec"].items() if k != "hypothesis"}},
        {**good, "status": {"phase": "Succeeded"}},
        {**good, "metadata": {"name": "Bad_Name"}},
        {**good, "spec": {**good["spec"], "priority": "high"}},
    ]
    for i, d in enumerate(broken):
        path = tmp_path / f"broken-{i}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        assert cli.main(["validate", str(path), "-o", "json", "--lab", str(lab.root)]) == 1
        f = json.loads(capsys.readouterr().out)[0]
        assert (f["phase"], f["reason"]) == ("Invalid", "InvalidSpec")
        assert cli.main(["apply", "-f", str(path), "--lab", str(lab.root)]) == 1
        assert capsys.readouterr().err.strip() == f"error: {f['message']}"
        assert f["message"].startswith(str(path))


def test_validate_catches_exact_and_comment_only_duplicates(lab, source, tmp_path, capsys):
    change = source.replace("MLP_RATIO = 4 ", "MLP_RATIO = 3 ")
    first = same_as_controller(lab, doc(lab, "mlp-3", udiff(source, change)), tmp_path, capsys,
                               "Queued", "ChecksPassed")
    assert first["ok"] and first["candidateHash"]
    # The same program under another name: the controller has mlp-3 in flight.
    f = same_as_controller(lab, doc(lab, "mlp-3-again", udiff(source, change)), tmp_path, capsys,
                           "Duplicate", "DuplicateCandidate")
    assert f["duplicateOf"] == "mlp-3"
    # Only a comment differs: the AST is the same, so is the verdict.
    commented = change.replace("# MLP hidden width", "# narrower MLP; hidden width")
    assert commented != change
    f = same_as_controller(lab, doc(lab, "mlp-3-commented", udiff(source, commented)), tmp_path,
                           capsys, "Duplicate", "DuplicateCandidate")
    assert f["duplicateOf"] == "mlp-3"
    # A comment-only edit of the master repeats the master itself.
    f = same_as_controller(lab, doc(lab, "just-a-comment", udiff(
        source, source.replace("# transformer blocks", "# blocks"))), tmp_path, capsys,
        "Duplicate", "DuplicateCandidate")
    assert f["duplicateOf"].startswith("master")


def test_validate_catches_a_repeat_inside_one_batch(lab, source, tmp_path, capsys):
    change = udiff(source, source.replace("ROPE_BASE = 10_000.0", "ROPE_BASE = 20_000.0"))
    for name in ("rope-a", "rope-b"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc(lab, name, change)))
    assert cli.main(["validate", str(tmp_path), "-o", "json", "--lab", str(lab.root)]) == 1
    a, b = json.loads(capsys.readouterr().out)
    assert a["ok"] and (b["phase"], b["duplicateOf"]) == ("Duplicate", "rope-a")


def test_validate_refuses_to_reuse_a_name(lab, source, tmp_path, capsys):
    # Its own first experiment: pytest-xdist may run the other tests of this module elsewhere.
    same_as_controller(lab, doc(lab, "name-taken", udiff(
        source, source.replace("WARMDOWN_RATIO = ", "WARMDOWN_RATIO = 0.01 + "))), tmp_path,
        capsys, "Queued", "ChecksPassed")
    d = doc(lab, "name-taken", udiff(source, source.replace("SEED = 42", "SEED = 45")))
    rc, f = validate(lab, d, tmp_path, capsys)
    assert rc == 1 and f["reason"] == "NameTaken"
    assert "already exists (phase Queued)" in f["message"]


def test_validate_sees_a_stale_parent_rebase_or_conflict(tmp_path, capsys):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    src = lab.repo.master_source()
    seed = lab.repo.master()
    # A master that moved on: the controller checks and promotes a winner (its metric is
    # given here; the pre-run checks do not depend on how it was measured).
    lab.repo.set_master_metric(1.0)
    winner = doc(lab, "winner", udiff(src, src.replace("WARMDOWN_RATIO = 0.5",
                                                       "WARMDOWN_RATIO = 0.4")))
    assert controller_verdict(lab, winner)[0] == "Queued"
    st = lab.read_record("winner")["status"]
    assert lab.repo.promote("winner", st["commit"], 0.9, (st["candidateHash"], st["semanticHash"]),
                            seed.hash, "now").promoted
    clash = doc(lab, "clash", udiff(src, src.replace("WARMDOWN_RATIO = 0.5",
                                                     "WARMDOWN_RATIO = 0.3")), parent=seed.hash[:12])
    f = same_as_controller(lab, clash, tmp_path, capsys, "Conflict", "RebaseConflict")
    assert "WARMDOWN_RATIO = 0.4" in f["message"] and "WARMDOWN_RATIO = 0.3" in f["message"]
    late = doc(lab, "late", udiff(src, src.replace("SEED = 42", "SEED = 7")),
               parent=seed.hash[:12])
    f = same_as_controller(lab, late, tmp_path, capsys, "Queued", "ChecksPassed")
    assert f["rebasedFrom"] == seed.hash and f["parentHash"] == lab.repo.master().hash


# --- the round trip, in a tiny lab that really runs ---------------------------------------------

FROZEN = "def lr_multiplier(progress):\n"

# The tests on the lab that ran (`ran`) share one worker (`--dist loadgroup`), so its run is made once.
RAN = pytest.mark.xdist_group("authoring-ran")


# Session, not module: a worker that runs another module's test in between would tear a module
# fixture down and make it again; this one is made once per worker that uses it.
@pytest.fixture(scope="session")
def ran(tmp_path_factory) -> LocalLab:
    """worktree -> edit -> new -w -> validate -> apply -> run, all through the CLI.

    The experiment freezes the learning rate at 0, so it is measured and certainly worse
    than the baseline: a regression, which must reach research/do-not-repeat.md.
    """
    root = tmp_path_factory.mktemp("ran") / "lab"
    lab = init_lab(root, profile="tiny", data="synthetic", min_delta=0)  # one run decides
    r = str(root)
    assert cli.main(["worktree", "frozen", "--lab", r]) == 0
    train = root / ".autolab" / "scratch" / "frozen" / SURFACE
    text = train.read_text()
    assert FROZEN in text
    train.write_text(text.replace(FROZEN, FROZEN + "    return 0.0  # the LR never leaves 0\n"))
    assert cli.main(["new", "frozen", "--lab", r, "--campaign", "schedule", "-w",
                     "--hypothesis", "A learning rate of zero leaves the model untrained."]) == 0
    draft = root / "experiments" / "drafts" / "frozen.yaml"
    assert cli.main(["validate", str(draft), "--lab", r]) == 0
    assert cli.main(["apply", "-f", str(draft), "--lab", r]) == 0
    assert cli.main(["run", "--lab", r, "--interval", "0.3"]) == 0
    # The same idea again, dressed up with a different comment: refused, no GPU spent.
    again = yaml.safe_load(draft.read_text())
    again["metadata"]["name"] = "frozen-again"
    again["spec"]["diff"] = again["spec"]["diff"].replace("the LR never leaves 0", "frozen LR")
    (root / "again.yaml").write_text(yaml.safe_dump(again))
    assert cli.main(["apply", "-f", str(root / "again.yaml"), "--lab", r]) == 0
    assert cli.main(["run", "--lab", r, "--interval", "0.3"]) == 0
    assert cli.main(["worktree", "frozen", "--rm", "--lab", r]) == 0
    return LocalLab(root)


@RAN
def test_new_validate_apply_run_round_trip(ran):
    rows = {r["experiment_id"]: r for r in ran.ledger.rows()}
    assert set(rows) == {"baseline", "frozen", "frozen-again"}
    frozen = rows["frozen"]
    assert (frozen["status"], frozen["outcome"]) == ("succeeded", "Rejected")
    assert float(frozen["delta"]) > 0
    assert frozen["parent_hash"] == ran.repo.master().hash
    assert rows["frozen-again"]["status"] == "duplicate"
    assert rows["frozen-again"]["duplicate_of"] == "frozen"
    assert "autolab/exp/frozen" in git(ran, "branch", "--list", "autolab/exp/*")
    assert not (ran.root / ".autolab" / "scratch" / "frozen").exists()


@RAN
def test_finished_experiments_leave_notes_and_do_not_repeat_entries(ran):
    note = (ran.root / "research" / "experiments" / "frozen.md").read_text()
    assert "A learning rate of zero leaves the model untrained." in note
    assert "+    return 0.0  # the LR never leaves 0" in note
    assert "Rejected" in note and ran.repo.master().hash[:12] in note
    frozen = next(r for r in ran.ledger.rows() if r["experiment_id"] == "frozen")
    assert f"{float(frozen['delta']):+.6f}" in note
    dup = (ran.root / "research" / "experiments" / "frozen-again.md").read_text()
    assert "Duplicate" in dup and "frozen" in dup
    dnr = (ran.root / "research" / "do-not-repeat.md").read_text()
    section = dnr.split("## schedule\n", 1)[1]
    assert "- `frozen` (" in section and "regressed" in section
    assert "- `frozen-again` (" in section and "duplicate of frozen" in section


TRACKIO_READ = """
import json, sys, trackio
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
out = {}
for run in trackio.Api().runs(project):
    out[run.name] = {"config": run.config, "logs": SQLiteStorage.get_logs(project, run.name)}
print(json.dumps(out, default=str))
"""


def read_trackio(lab: LocalLab) -> dict:
    """The lab's runs as trackio itself reads them (in a child: TRACKIO_DIR is read at import)."""
    assert tracking.settle()  # the after-record hook syncs in the background
    proc = subprocess.run([sys.executable, "-c", TRACKIO_READ, tracking.project_name(lab.name)],
                          env=tracking.child_env(lab.root), capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@RAN
def test_trackio_holds_one_run_per_experiment_with_config_and_metrics(ran):
    runs = read_trackio(ran)
    rows = {r["experiment_id"]: r for r in ran.ledger.rows()}
    baseline = rows["baseline"]["run_id"]
    name = tracking.run_label(rows["frozen"])  # "frozen · promoted" or "frozen · rejected"
    assert set(runs) == {name, baseline}, "refusals spend no GPU and get no trackio run"
    frozen = runs[name]
    assert frozen["config"]["hypothesis"] == rows["frozen"]["hypothesis"]
    assert frozen["config"]["campaign"] == "schedule"
    assert frozen["config"]["candidate_hash"] == rows["frozen"]["candidate_hash"]
    assert frozen["config"]["backend"] == "local"
    logged = [m for log in frozen["logs"] for k, m in log.items() if k == "val_bpb"]
    # Measured once, drawn as a level line: the same value at the curve's two ends.
    assert logged and logged == [pytest.approx(float(rows["frozen"]["val_bpb"]))] * len(logged)
    for name, run_id in ((name, "exp-frozen-1"), (baseline, baseline)):
        result = json.loads((ran.root / ".autolab" / "runs" / run_id / "result.json").read_text())
        steps = [json.loads(line)["step"] for line in Path(result["curve"]).read_text()
                 .splitlines()] if result.get("curve") else []
        assert [log["step"] for log in runs[name]["logs"] if "loss" in log] == steps
    assert (ran.root / ".autolab" / "trackio" / "autolab-default.db").exists()


@RAN
def test_report_shows_the_leader_and_plots_one_point_per_finished_experiment(ran, capsys):
    assert cli.main(["report", "--lab", str(ran.root)]) == 0
    md = capsys.readouterr().out
    assert f"master `{ran.repo.master().hash[:12]}`" in md
    assert "| schedule |" in md and "`frozen`" in md
    png = ran.root / "research" / "live" / "progress.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    assert matplotlib.image.imread(str(png)).shape[0] > 100
    p = progress(ran.ledger.rows())
    finished = [r for r in ran.ledger.rows()
                if r["status"] != "baseline" and r["val_bpb"]]
    assert [q.name for q in p.points] == [r["experiment_id"] for r in finished] == ["frozen"]
    assert (ran.root / "research" / "live" / "report.md").read_text() == md


def test_new_diffs_the_scratch_worktree_against_the_master_it_came_from(lab, capsys):
    assert cli.main(["worktree", "deeper", "--lab", str(lab.root)]) == 0
    scratch = Path(capsys.readouterr().out.strip())
    assert scratch == lab.root / ".autolab" / "scratch" / "deeper"
    assert cli.main(["new", "deeper", "--hypothesis", "x", "--lab", str(scratch)]) == 1
    assert "does not differ from the master" in capsys.readouterr().err
    train = scratch / SURFACE
    train.write_text(train.read_text().replace("DEPTH = 8 ", "DEPTH = 9 "))
    (scratch / "notes.txt").write_text("scratch notes are not part of the experiment\n")
    # From inside the worktree (a checkout of the lab) the commands still find the lab.
    assert cli.main(["new", "deeper", "--campaign", "size", "--lab", str(scratch),
                     "--hypothesis", "One more block  helps."]) == 0
    out = capsys.readouterr()
    assert "notes.txt" in out.err
    d = yaml.safe_load(out.out)
    assert d["metadata"]["name"] == "deeper" and d["spec"]["campaign"] == "size"
    assert d["spec"]["hypothesis"] == "One more block helps."
    assert d["spec"]["parent"] == lab.repo.master().hash[:12]
    assert "-DEPTH = 8 " in d["spec"]["diff"] and "+DEPTH = 9 " in d["spec"]["diff"]
    assert "diff: |" in out.out, "the diff is a readable literal block"
    assert cli.main(["worktree", "--lab", str(lab.root)]) == 0
    assert "deeper" in capsys.readouterr().out
    assert cli.main(["worktree", "deeper", "--rm", "--lab", str(lab.root)]) == 0
    assert not scratch.exists()
    assert "scratch/deeper" not in git(lab, "worktree", "list")

"""The embedded default end to end: specs in a lab directory, the real harness, the real loop."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller.local import init_lab
from controller.cli.main import main
from controller.cli.demo import run_demo
from controller.lab.ledger import Ledger
from labkit import spec_from_edit

AUTOLAB = [sys.executable, "-m", "controller.cli.main"]

# The tests on the demo's lab share one worker (`--dist loadgroup`): each worker that takes one
# would run the whole demo for its own copy of the module fixture.
DEMO = pytest.mark.xdist_group("demo-lab")


# Session, not module: a worker that runs another module's test in between would tear a module
# fixture down and make it again; this one is made once per worker that uses it.
@pytest.fixture(scope="session")
def demo_lab(tmp_path_factory):
    base = tmp_path_factory.mktemp("demo")
    assert run_demo(directory=str(base)) == 0
    return base / "lab"


def records(lab: Path) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in (lab / ".autolab" / "status").glob("*.json")}


@DEMO
def test_demo_meets_every_outcome(demo_lab):
    st = {n: r["status"] for n, r in records(demo_lab).items()}
    seen = {n: (s["phase"], s.get("outcome")) for n, s in st.items()}
    assert seen["improve-lr"] == ("Succeeded", "Promoted")
    assert seen["regress-capped"] == ("Succeeded", "Rejected")
    assert seen["repeat-improve"] == ("Duplicate", None)
    assert seen["repeat-commented"] == ("Duplicate", None)
    assert seen["touch-prepare"] == ("Invalid", None)
    assert seen["stale-conflict"] == ("Conflict", None)
    assert seen["stale-warmdown"][0] == "Succeeded"
    assert st["stale-warmdown"]["rebasedFrom"] != st["stale-warmdown"]["parentHash"]
    assert st["repeat-improve"]["duplicateOf"] == "improve-lr"
    assert st["repeat-commented"]["duplicateOf"] == "improve-lr"
    assert "diff touches prepare.py; only bench/train.py may change" == st["touch-prepare"]["message"]
    assert "UNEMBEDDING_LR = 0.01" in st["stale-conflict"]["message"]


@DEMO
def test_duplicates_and_refusals_spend_no_run(demo_lab):
    runs = {p.name for p in (demo_lab / ".autolab" / "runs").iterdir()}
    for refused in ("repeat-improve", "repeat-commented", "touch-prepare", "stale-conflict"):
        assert f"exp-{refused}-1" not in runs
    assert {"exp-improve-lr-1", "exp-regress-capped-1", "exp-stale-warmdown-1"} <= runs


@DEMO
def test_ledger_has_one_row_per_experiment_and_the_baseline(demo_lab):
    rows = Ledger(demo_lab / "research" / "results.tsv").rows()
    ids = [r["experiment_id"] for r in rows]
    assert sorted(ids) == sorted(["baseline", *records(demo_lab)])
    promoted = [r["experiment_id"] for r in rows if r["promoted"] == "1"]
    master = json.loads((demo_lab / "research" / "live" / "master.json").read_text())
    assert master["experiment"] == promoted[-1]
    assert len(master["history"]) == 1 + len(promoted)


@DEMO
def test_branches_stay_for_runs_and_worktrees_go(demo_lab):
    branches = subprocess.run(["git", "branch", "--list", "autolab/*"], cwd=demo_lab,
                              capture_output=True, text=True).stdout.split()
    assert "autolab/exp/improve-lr" in branches and "autolab/master" in branches
    assert "autolab/exp/touch-prepare" not in branches
    assert "autolab/exp/repeat-improve" not in branches
    for leftovers in ("candidates", "worktrees"):  # a checked candidate's marker (issue 15)
        assert not list((demo_lab / ".autolab" / leftovers).glob("*"))
    msg = subprocess.run(["git", "log", "-1", "--format=%B", "autolab/exp/improve-lr"],
                         cwd=demo_lab, capture_output=True, text=True).stdout
    assert "Autolab-Experiment: improve-lr" in msg and "Autolab-Campaign: learning-rate" in msg
    master = subprocess.run(["git", "rev-parse", "autolab/master"], cwd=demo_lab,
                            capture_output=True, text=True).stdout.strip()
    assert master == json.loads((demo_lab / "research/live/master.json").read_text())["commit"]


@DEMO
def test_get_json_is_a_kubectl_list(demo_lab, capsys):
    assert main(["get", "--lab", str(demo_lab), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "List"
    item = next(i for i in doc["items"] if i["metadata"]["name"] == "improve-lr")
    assert item["spec"]["campaign"] == "learning-rate"
    assert item["status"]["phase"] == "Succeeded" and item["status"]["outcome"] == "Promoted"
    assert item["status"]["metrics"]["val_bpb"] > 0


@DEMO
def test_describe_tells_the_story(demo_lab, capsys):
    assert main(["describe", "--lab", str(demo_lab), "stale-warmdown"]) == 0
    out = capsys.readouterr().out
    assert "rebasedFrom:" in out and "Checked" in out and "Submitted" in out
    assert "+WARMDOWN_RATIO = 0.3" in out


@DEMO
def test_apply_refuses_bad_input_and_changes_nothing(demo_lab, tmp_path, capsys):
    before = (demo_lab / "research" / "results.tsv").read_bytes()
    listing = sorted(p.name for p in (demo_lab / "experiments").iterdir())
    cases = {
        "broken.yaml": ("metadata: {name: x\nspec: [", "broken.yaml: line"),
        "unknown.yaml": (yaml.safe_dump({"apiVersion": "autolab.dev/v1alpha1",
                                         "kind": "Experiment", "metadata": {"name": "u"},
                                         "spec": {"hypothesis": "h", "parent": "abcd",
                                                  "diff": "x", "budget": 5}}),
                         "spec.budget: unknown field; expected one of"),
        "kind.yaml": (yaml.safe_dump({"apiVersion": "autolab.dev/v1alpha1", "kind": "Job",
                                      "metadata": {"name": "k"}, "spec": {}}),
                      "kind: expected 'Experiment', got 'Job'"),
        "types.yaml": (yaml.safe_dump({"apiVersion": "autolab.dev/v1alpha1",
                                       "kind": "Experiment", "metadata": {"name": "t"},
                                       "spec": {"hypothesis": "h", "parent": "abcd",
                                                "diff": "x", "priority": "high"}}),
                       "spec.priority: expected integer, got str 'high'"),
    }
    for fname, (text, expect) in cases.items():
        f = tmp_path / fname
        f.write_text(text)
        assert main(["apply", "--lab", str(demo_lab), "-f", str(f)]) == 1
        err = capsys.readouterr().err
        assert str(f) in err and expect in err, err
    assert (demo_lab / "research" / "results.tsv").read_bytes() == before
    assert sorted(p.name for p in (demo_lab / "experiments").iterdir()) == listing


def _wait(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _phase(lab: Path, name: str):
    p = lab / ".autolab" / "status" / f"{name}.json"
    try:
        return json.loads(p.read_text())["status"].get("phase")
    except (OSError, ValueError, KeyError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_killed_controller_adopts_its_run_and_records_it_once(tmp_path):
    # A run outlives its launch by start-up, training, export and evaluation (~15 s on 2 cores):
    # time enough to kill the controller while it runs, with 3 s of training.
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=0)
    lab.repo.set_master_metric(9.9)  # the baseline is not what this test is about
    lab.apply_file(spec_from_edit(lab, "warmdown", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4",
                         "A slightly shorter warmdown."), "test")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    first = subprocess.Popen(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: _phase(lab.root, "warmdown") == "Running", 240, "the run to start")
        launch = json.loads((lab.root / ".autolab/runs/exp-warmdown-1/launch.json").read_text())
        # Every run may start from the compile cache of the lab's starting program, named by
        # the sha1 of the first commit's train.py (bench/harness_compile_cache.py: COMPILE_SEEDS).
        first_commit = subprocess.run(["git", "rev-list", "--max-parents=0", "autolab/master"], cwd=lab.root,
                                      capture_output=True, text=True).stdout.split()[-1]
        starting = subprocess.run(["git", "show", f"{first_commit}:bench/train.py"], cwd=lab.root,
                                  capture_output=True).stdout
        cmd = launch["cmd"]
        assert cmd[cmd.index("--compile-cache-from") + 1] == hashlib.sha1(starting).hexdigest()
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert _alive(launch["pid"]), "the run outlives a killed controller"
    finally:
        if first.poll() is None:
            first.kill()
    second = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    after = json.loads((lab.root / ".autolab/runs/exp-warmdown-1/launch.json").read_text())
    assert after["pid"] == launch["pid"], "the restarted controller adopted, not relaunched"
    log = (lab.root / ".autolab/runs/exp-warmdown-1/log.txt").read_text()
    assert log.count("[bench] running candidate") == 1
    assert _phase(lab.root, "warmdown") == "Succeeded"
    rows = Ledger(lab.root / "research" / "results.tsv").rows()
    assert [r["run_id"] for r in rows] == ["exp-warmdown-1"]  # once, and nothing else ran


def test_delete_cancels_a_running_run_and_records_it(tmp_path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=30, min_delta=0)
    lab.repo.set_master_metric(9.9)  # the baseline is not what this test is about
    lab.apply_file(spec_from_edit(lab, "slow", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.6",
                         "A longer warmdown."), "test")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    loop = subprocess.Popen(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: _phase(lab.root, "slow") == "Running", 120, "the run to start")
        pid = json.loads((lab.root / ".autolab/runs/exp-slow-1/launch.json").read_text())["pid"]
        assert main(["delete", "--lab", str(lab.root), "slow"]) == 0
        _wait(lambda: not _alive(pid) or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
              30, "the run to stop")
        code = loop.wait(60)
        assert code == 0, loop.stderr.read()
    finally:
        if loop.poll() is None:
            loop.kill()
    rows = Ledger(lab.root / "research" / "results.tsv").rows()
    assert [(r["run_id"], r["status"]) for r in rows] == [("exp-slow-1", "cancelled")]
    assert not (lab.root / "experiments" / "slow.yaml").exists()
    assert not (lab.root / ".autolab" / "status" / "slow.json").exists()


def test_a_broken_spec_file_is_named_and_the_others_still_run(tmp_path, capsys):
    # minDelta 0: no repeat runs of the master (the default, auto, would start one and leave it going)
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", min_delta=0) as lab:
        lab.repo.set_master_metric(9.9)
        (lab.root / "experiments" / "oops.yaml").write_text("kind: Experiment\nmetadata: {}\n")
        lab.apply_file(spec_from_edit(lab, "prep", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.5\n",
                                      "Only a blank line (a duplicate of the master)."), "test")
        summary = lab.step()
        assert any("oops.yaml: metadata.name: required field is missing" in e for e in summary.errors)
        assert _phase(lab.root, "prep") == "Duplicate"
        assert not lab.runs_in_flight()


def test_without_a_sandbox_run_refuses_unless_told_and_then_every_status_says_so(tmp_path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", min_delta=0)
    lab.repo.set_master_metric(9.9)
    lab.apply_file(spec_from_edit(lab, "plain", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.45",
                                  "A slightly shorter warmdown."), "test")
    bare = tmp_path / "bin"  # a PATH with git and Python but no bubblewrap
    bare.mkdir()
    for tool in ("git", "setpriv"):
        (bare / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    env = dict(os.environ, PATH=str(bare), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    refused = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root)], env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "bubblewrap" in refused.stderr and "--unsafe-no-sandbox" in refused.stderr
    assert _phase(lab.root, "plain") in (None, "Pending", "Queued")  # nothing ran
    assert not (lab.root / ".autolab" / "runs" / "exp-plain-1").exists()

    told = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2", "--unsafe-no-sandbox"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert told.returncode == 0, told.stderr
    assert "WITHOUT a sandbox" in told.stdout + told.stderr
    status = records(lab.root)["plain"]["status"]
    assert status["job"]["worker"].endswith(":UNSANDBOXED")
    row = [r for r in Ledger(lab.root / "research" / "results.tsv").rows() if r["run_id"] == "exp-plain-1"]
    assert row and row[0]["worker_id"].endswith(":UNSANDBOXED")
    result = json.loads((lab.root / ".autolab" / "runs" / "exp-plain-1" / "result.json").read_text())
    assert result["sandbox"] == "none"

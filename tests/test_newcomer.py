"""A newcomer's first hour (issue 14): every command the README shows works as written, and the
kubectl habits people bring along work too. Each test runs the real `autolab` executable (or
`./dev`) the way a person types it, and checks what that person sees: the exit code, the printed
text, the files."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.local import init_lab

REPO = Path(__file__).resolve().parents[1]
AUTOLAB = Path(sys.executable).with_name("autolab")
COMMAND = [str(AUTOLAB)] if AUTOLAB.exists() else [sys.executable, "-m", "controller.cli.main"]
TIMEOUT = 120


@pytest.fixture(scope="module")
def seed_lab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seed")
    init_lab(root / "mylab", profile="tiny", data="synthetic")
    return root / "mylab"


@pytest.fixture()
def lab(seed_lab, tmp_path) -> Path:
    """A fresh copy of a tiny lab for one test."""
    return Path(shutil.copytree(seed_lab, tmp_path / "mylab", symlinks=True))


@pytest.fixture()
def env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("HF_", "HUGGING_FACE", "GIT_", "AUTOLAB_"))}
    e.update(GIT_CEILING_DIRECTORIES=str(tmp_path), HF_HOME=str(tmp_path / "hf-home"),
             AUTOLAB_TRACKING="0")
    return e


def as_from_a_terminal() -> None:
    """preexec_fn: Ctrl-C as a terminal delivers it. A test runner's worker may ignore SIGINT,
    and a child inherits an ignored signal (Python then installs no KeyboardInterrupt)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def autolab(*args: str, env: dict, cwd: Path | None = None,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def master_hash(lab: Path) -> str:
    return yaml.safe_load((lab / "research" / "live" / "master.json").read_text())["hash"]


def readme_spec() -> dict:
    """The Experiment the README shows, as a newcomer copies it."""
    text = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
                 if "kind: Experiment" in b)
    return yaml.safe_load(block)


def write_spec(path: Path, name: str, parent: str, diff: str, hypothesis: str = "A change.") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment", "metadata": {"name": name},
        "spec": {"hypothesis": hypothesis, "parent": parent, "diff": diff}}, sort_keys=False))
    return path


WARMDOWN = "WARMDOWN_RATIO = 0.5  # share of the budget at the end spent decaying the LR"


def zero_context_diff(old: str, new: str, line: int = 62) -> str:
    return f"--- a/train.py\n+++ b/train.py\n@@ -{line} +{line} @@\n-{old}\n+{new}\n"


# -- 1. the README's spec: a hunk with no context lines -----------------------------------------

def test_the_readmes_example_spec_validates_and_applies(lab, env):
    doc = readme_spec()
    assert re.search(r"^@@ -\d+ \+\d+ @@$", doc["spec"]["diff"], re.M), "no zero-context hunk"
    doc["spec"]["parent"] = master_hash(lab)[:12]  # what `autolab master` prints
    f = lab / "warmdown-03.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warmdown-03: ok" in p.stdout
    p = autolab("apply", "-f", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 0 and "warmdown-03 created" in p.stdout, p.stderr


def test_zero_context_hunk_with_the_wrong_line_is_refused_without_blaming_the_master(lab, env):
    f = write_spec(lab / "bad.yaml", "bad-warmdown", master_hash(lab)[:12],
                   zero_context_diff("WARMDOWN_RATIO = 0.9", "WARMDOWN_RATIO = 0.3"))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "DiffDoesNotApply" in p.stdout and "(the current master)" in p.stdout
    assert "older than the current" not in p.stdout and "regenerate" not in p.stdout


def test_a_diff_against_an_older_master_that_does_not_apply_says_the_master_moved(lab, env):
    from controller.core.hashing import candidate_hash, semantic_hash
    from controller.local import LocalLab

    seed = master_hash(lab)
    local = LocalLab(lab)
    src = local.repo.master_source().replace("DEPTH = 8", "DEPTH = 9", 1)
    (lab / "bench" / "train.py").write_text(src)
    local.repo.git("commit", "-qam", "deeper")
    commit = local.repo.git("rev-parse", "HEAD").stdout.strip()
    local.repo.set_master_metric(2.0)
    assert local.repo.promote("deeper", commit, 1.0, (candidate_hash(src), semantic_hash(src)),
                              seed, "2024-01-01T00:00:00Z", margin=0.0).promoted
    f = write_spec(lab / "stale.yaml", "stale-bad", seed[:12],
                   zero_context_diff("WARMDOWN_RATIO = 0.9", "WARMDOWN_RATIO = 0.3"))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "older than the current one" in p.stdout and "regenerate" in p.stdout


def test_zero_context_hunk_may_not_touch_another_file(lab, env):
    diff = "--- a/prepare.py\n+++ b/prepare.py\n@@ -1 +1 @@\n-a\n+b\n"
    f = write_spec(lab / "other.yaml", "other-file", master_hash(lab)[:12], diff)
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1 and "DiffTouchesOtherFile" in p.stdout


# -- 2. a spec is immutable, a name is permanent ----------------------------------------------

def warmdown_spec(lab: Path, name: str, value: str = "0.3", where: Path | None = None) -> Path:
    return write_spec((where or lab) / f"{name}.yaml", name, master_hash(lab)[:12],
                      zero_context_diff(WARMDOWN, f"WARMDOWN_RATIO = {value}"))


def test_reapplying_an_unchanged_spec_says_unchanged(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    assert "warmdown-03 created" in autolab("apply", "-f", str(f), "--lab", str(lab),
                                            env=env).stdout
    p = autolab("apply", "-f", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 0 and "warmdown-03 unchanged" in p.stdout, p.stderr


def test_a_changed_spec_under_an_existing_name_is_refused_and_nothing_changes(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    applied = (lab / "experiments" / "warmdown-03.yaml").read_text()
    record = (lab / ".autolab" / "status" / "warmdown-03.json").read_text()
    warmdown_spec(lab, "warmdown-03", value="0.2")
    p = autolab("apply", "-f", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1 and "configured" not in p.stdout
    assert "a spec cannot change once applied" in p.stderr
    assert "create a new Experiment with a new name, e.g. warmdown-04" in p.stderr
    assert "Traceback" not in p.stderr
    assert (lab / "experiments" / "warmdown-03.yaml").read_text() == applied
    assert (lab / ".autolab" / "status" / "warmdown-03.json").read_text() == record


def test_a_deleted_name_is_never_reused_and_validate_agrees(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    p = autolab("delete", "warmdown-03", "--lab", str(lab), env=env)
    assert p.returncode == 0 and "deleted (Cancelled)" in p.stdout, p.stderr
    p = autolab("apply", "-f", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1 and "created" not in p.stdout
    assert "names are permanent" in p.stderr and "ledger run exp-warmdown-03-1" in p.stderr
    assert not (lab / "experiments" / "warmdown-03.yaml").exists()
    v = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert v.returncode == 1 and "NameTaken" in v.stdout and "names are permanent" in v.stdout


def test_applying_a_directory_does_not_bring_a_deleted_experiment_back(lab, env):
    drafts = lab / "experiments" / "drafts"
    drafts.mkdir(parents=True)
    warmdown_spec(lab, "warmdown-03", where=drafts)
    assert autolab("apply", "-f", str(drafts), "--lab", str(lab), env=env).returncode == 0
    assert autolab("delete", "warmdown-03", "--lab", str(lab), env=env).returncode == 0
    warmdown_spec(lab, "warmdown-02", value="0.2", where=drafts)
    p = autolab("apply", "-f", str(drafts), "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "warmdown-02 created" in p.stdout and "warmdown-03" not in p.stdout
    assert "'warmdown-03' was used before" in p.stderr
    got = autolab("get", "--lab", str(lab), env=env).stdout
    assert "warmdown-02" in got and "warmdown-03" not in got


# -- 3. ./dev runs autolab where the user stands ------------------------------------------------

def dev_ready() -> bool:
    import hashlib
    stamp = hashlib.sha1((REPO / "pyproject.toml").read_bytes()).hexdigest()[:12]
    return (REPO / ".venv" / f".installed-{stamp}").exists()


@pytest.mark.skipif(not dev_ready(), reason="the clone's .venv is not built (./dev builds it)")
def test_dev_autolab_runs_in_the_callers_directory(tmp_path, env):
    dev = str(REPO / "dev")
    p = subprocess.run([dev, "autolab", "init", "mylab", "--profile", "tiny", "--data",
                        "synthetic"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "mylab" / "lab.yaml").exists() and not (REPO / "mylab").exists()
    # The hint names a command that works for someone without `autolab` on PATH.
    assert f"{dev} autolab apply -f FILE" in p.stdout and "source " in p.stdout
    p = subprocess.run([dev, "autolab", "get"], cwd=tmp_path / "mylab", env=env,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0 and p.stdout.startswith("NAME"), p.stderr


# -- 8. the lab is found from any folder inside it, like git ------------------------------------

def test_commands_find_the_lab_from_a_folder_inside_it(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    inside = lab / "research" / "experiments"
    inside.mkdir(parents=True, exist_ok=True)
    p = autolab("apply", "-f", str(f), env=env, cwd=inside)
    assert p.returncode == 0 and "created" in p.stdout, p.stderr
    p = autolab("get", env=env, cwd=lab / "research")
    assert p.returncode == 0 and "warmdown-03" in p.stdout, p.stderr
    assert autolab("master", env=env, cwd=lab / "bench").returncode == 0


def test_outside_any_lab_says_so_once(tmp_path, env):
    p = autolab("get", env=env, cwd=tmp_path)
    assert p.returncode == 1 and "not a lab (no lab.yaml here or in any parent" in p.stderr


# -- 5. get shows what was applied at once; a typo is not found; logs says why there is none ----

def test_an_applied_spec_shows_as_pending_at_once(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    p = autolab("get", "--lab", str(lab), env=env)
    assert p.returncode == 0
    row = next(line for line in p.stdout.splitlines() if line.startswith("warmdown-03"))
    assert row.split()[1] == "Pending"
    # A file dropped into experiments/ by hand shows too, before the loop has read it.
    warmdown_spec(lab, "by-hand", value="0.2", where=lab / "experiments")
    p = autolab("get", "by-hand", "--lab", str(lab), env=env)
    assert p.returncode == 0 and "by-hand" in p.stdout and "Pending" in p.stdout


def test_a_typo_is_not_found_with_the_close_name_suggested(lab, env):
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    for verb in ("get", "describe", "logs"):
        p = autolab(verb, "warmdwn-03", "--lab", str(lab), env=env)
        assert p.returncode == 1
        assert p.stderr.startswith("error: experiment 'warmdwn-03' not found; did you mean "
                                   "warmdown-03?"), p.stderr
        assert "reconciled" not in p.stderr


def test_logs_of_an_experiment_that_never_ran_says_why_not_yet(lab, env):
    f = write_spec(lab / "bad.yaml", "bad-warmdown", master_hash(lab)[:12],
                   zero_context_diff("WARMDOWN_RATIO = 0.9", "WARMDOWN_RATIO = 0.3"))
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    p = autolab("logs", "bad-warmdown", "--lab", str(lab), env=env)
    assert p.returncode == 1 and "is Pending and has no run yet" in p.stderr
    from controller.local import LocalLab
    LocalLab(lab).reconcile_one("bad-warmdown", schedule=False)  # the loop's pre-run check
    p = autolab("logs", "bad-warmdown", "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "is Invalid and never ran, so it has no log" in p.stderr and "(yet)" not in p.stderr


# -- 6. kubectl habits ---------------------------------------------------------------------------

def labelled(lab: Path, name: str, value: str, labels: dict) -> Path:
    f = warmdown_spec(lab, name, value=value)
    doc = yaml.safe_load(f.read_text())
    doc["metadata"]["labels"] = labels
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return f


def test_label_selectors_pick_experiments_by_metadata_labels(lab, env):
    for name, value, labels in (("wd-a", "0.3", {"owner": "ada", "tier": "quick"}),
                                ("wd-b", "0.2", {"owner": "bob"}),
                                ("wd-c", "0.1", {"owner": "ada"})):
        f = labelled(lab, name, value, labels)
        assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0

    def names(*args):
        p = autolab("get", "-o", "name", *args, "--lab", str(lab), env=env)
        assert p.returncode == 0, p.stderr
        return [line.split("/")[-1] for line in p.stdout.split()]

    assert names("-l", "owner=ada") == ["wd-a", "wd-c"]
    assert names("-l", "owner!=ada") == ["wd-b"]
    assert names("-l", "owner=ada,tier") == ["wd-a"]
    assert names("-l", "!tier") == ["wd-b", "wd-c"]
    assert names("-l", "owner=carol") == []
    p = autolab("get", "-l", "owner=ada", "-o", "json", "--lab", str(lab), env=env)
    assert {i["metadata"]["labels"]["owner"] for i in __import__("json").loads(p.stdout)["items"]} \
        == {"ada"}
    p = autolab("get", "-l", "a b", "--lab", str(lab), env=env)
    assert p.returncode == 1 and "key=value" in p.stderr


def test_sort_by_a_field_or_a_column(lab, env):
    import json
    for name, value in (("wd-a", "0.3"), ("wd-b", "0.2"), ("wd-c", "0.1")):
        assert autolab("apply", "-f", str(warmdown_spec(lab, name, value)), "--lab", str(lab),
                       env=env).returncode == 0
    for name, val in (("wd-a", 1.5), ("wd-b", 1.2), ("wd-c", 1.9)):  # as a finished run has
        f = lab / ".autolab" / "status" / f"{name}.json"
        rec = json.loads(f.read_text())
        rec["status"] = {"phase": "Succeeded", "metrics": {"val_bpb": val}}
        f.write_text(json.dumps(rec))

    def order(by):
        p = autolab("get", "--sort-by", by, "--lab", str(lab), env=env)
        assert p.returncode == 0, p.stderr
        return [line.split()[0] for line in p.stdout.splitlines()[1:]]

    assert order(".status.metrics.val_bpb") == ["wd-b", "wd-a", "wd-c"]
    assert order("{.status.valBpb}") == ["wd-b", "wd-a", "wd-c"]
    assert order("VAL_BPB") == ["wd-b", "wd-a", "wd-c"]
    assert order(".metadata.name") == ["wd-a", "wd-b", "wd-c"]
    p = autolab("get", "--sort-by", ".status.nothing", "--lab", str(lab), env=env)
    assert p.returncode == 1 and "no experiment has that field" in p.stderr


def test_delete_by_file_and_all(lab, env):
    files = [warmdown_spec(lab, n, v) for n, v in (("wd-a", "0.3"), ("wd-b", "0.2"),
                                                     ("wd-c", "0.1"))]
    for f in files:
        assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    p = autolab("delete", "-f", str(files[0]), "--lab", str(lab), env=env)
    assert p.returncode == 0 and "wd-a deleted (Cancelled)" in p.stdout, p.stderr
    p = autolab("delete", "--all", "--lab", str(lab), env=env)
    assert p.returncode == 0, p.stderr
    assert "wd-b deleted" in p.stdout and "wd-c deleted" in p.stdout
    assert autolab("get", "-o", "name", "--lab", str(lab), env=env).stdout == ""
    p = autolab("delete", "--lab", str(lab), env=env)
    assert p.returncode == 1 and "--all" in p.stderr


def test_version_and_shell_completion(lab, env):
    from importlib.metadata import version
    p = autolab("--version", env=env)
    assert p.returncode == 0 and p.stdout.strip() == f"autolab {version('autolab-research')}"
    script = autolab("completion", "bash", env=env)
    assert script.returncode == 0 and "complete -o default -F _autolab_complete autolab" \
        in script.stdout
    assert autolab("apply", "-f", str(warmdown_spec(lab, "warmdown-03")), "--lab", str(lab),
                   env=env).returncode == 0
    (lab / "script.sh").write_text(script.stdout)
    bash_env = {**env, "PATH": f"{AUTOLAB.parent}:{env.get('PATH', '')}"}

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        probe = (f"source script.sh; COMP_WORDS=({' '.join(repr(w) for w in words)}); "
                 f"COMP_CWORD={len(words) - 1}; _autolab_complete; echo \"${{COMPREPLY[@]}}\"")
        p = subprocess.run(["bash", "-c", probe], cwd=lab, env=bash_env, capture_output=True,
                           text=True, timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr
        return p.stdout.split()

    assert complete("autolab de") == ["describe", "delete", "demo"]
    assert complete("autolab get -o ") == ["wide", "json", "yaml", "name"]
    assert "--sort-by" in complete("autolab get --so")
    assert complete("autolab describe warm") == ["warmdown-03"]
    assert complete("autolab agents re") == ["render"]
    assert autolab("completion", "zsh", env=env).stdout.startswith("# zsh completion")


def read_until(proc: subprocess.Popen, needle: str, timeout: float = 30.0) -> str:
    """Lines of `proc`'s stdout until one holds `needle` (a thread reads; we wait)."""
    import queue
    import threading
    q: queue.Queue = getattr(proc, "_lines", None) or queue.Queue()
    if not hasattr(proc, "_lines"):
        proc._lines = q

        def pump():
            for line in proc.stdout:
                q.put(line)
            q.put(None)
        threading.Thread(target=pump, daemon=True).start()
    seen = ""
    while True:
        line = q.get(timeout=timeout)
        assert line is not None, f"ended before {needle!r}: {seen}"
        seen += line
        if needle in line:
            return seen


def test_get_watch_prints_each_change_until_ctrl_c(lab, env):
    import json
    import signal
    assert autolab("apply", "-f", str(warmdown_spec(lab, "wd-a", "0.3")), "--lab", str(lab),
                   env=env).returncode == 0
    w = subprocess.Popen([*COMMAND, "get", "-w", "--interval", "0.2", "--lab", str(lab)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=as_from_a_terminal)
    try:
        assert read_until(w, "wd-a").startswith("NAME")
        assert autolab("apply", "-f", str(warmdown_spec(lab, "wd-b", "0.2")), "--lab", str(lab),
                       env=env).returncode == 0
        line = read_until(w, "wd-b")
        assert "Pending" in line and "NAME" not in line  # one new row, no second header
        f = lab / ".autolab" / "status" / "wd-a.json"
        rec = json.loads(f.read_text())
        rec["status"] = {"phase": "Queued"}
        f.write_text(json.dumps(rec))
        assert "Queued" in read_until(w, "wd-a")
        w.send_signal(signal.SIGINT)
        assert w.wait(timeout=30) == 130
        assert "Traceback" not in w.stderr.read()
    finally:
        w.kill()


# -- 7. Ctrl-C on `autolab run` says what goes on ----------------------------------------------

def test_ctrl_c_on_run_says_the_runs_go_on_and_how_to_follow_them(lab, env):
    import json
    import signal
    import time
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    run = subprocess.Popen([*COMMAND, "run", "--unsafe-no-sandbox", "--interval", "0.2"],
                           cwd=lab, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, preexec_fn=as_from_a_terminal)
    launch = None
    try:
        deadline = time.time() + 60
        while launch is None and time.time() < deadline:
            found = sorted((lab / ".autolab" / "runs").glob("*/launch.json"))
            launch = json.loads(found[0].read_text()) if found else None
            time.sleep(0.2)
        assert launch is not None, "no run started"
        time.sleep(0.5)
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=60)
        assert run.returncode == 130
        assert "Traceback" not in err
        name = found[0].parent.name
        assert f"1 run(s) go on in the background: {name}" in err, err
        assert "`autolab run` again records their results" in err
        assert "`autolab get -w`" in err and "log.txt" in err
        assert Path(f"/proc/{launch['pid']}").exists(), "the run was stopped, not left going"
    finally:
        run.kill()
        if launch is not None:
            try:
                os.killpg(launch["pid"], signal.SIGKILL)  # the run this test started
            except ProcessLookupError:
                pass


# -- 9. polish: wide shows the whole message, numbers read as numbers, a closed pipe is quiet ---

def test_wide_shows_the_whole_message_and_describe_spaces_its_fields(lab, env):
    import json
    assert autolab("apply", "-f", str(warmdown_spec(lab, "warmdown-03")), "--lab", str(lab),
                   env=env).returncode == 0
    f = lab / ".autolab" / "status" / "warmdown-03.json"
    rec = json.loads(f.read_text())
    message = ("candidate equals experiment improve-lr (ef28a0c4d9b1e2f3a4b5c6d7e8f90a1b2c3d4e5f), "
               "exactly: no run spent on a repeat of a measured candidate")
    rec["status"] = {"phase": "Duplicate", "message": message, "delta": -0.0123,
                     "candidateHash": "ef28a0c4d9b1e2f3a4b5c6d7e8f90a1b2c3d4e5f"}
    f.write_text(json.dumps(rec))
    p = autolab("get", "-o", "wide", "--lab", str(lab), env=env)
    assert message in p.stdout and "-0.012300" in p.stdout
    p = autolab("describe", "warmdown-03", "--lab", str(lab), env=env)
    assert "candidateHash:  ef28a0c4d9b1" in p.stdout
    assert "delta:          -0.012300" in p.stdout
    assert re.search(r"^Name: +warmdown-03$", p.stdout, re.M)


def test_the_ledger_prints_metrics_with_six_decimals_and_signed_deltas(lab, env):
    from controller.lab.ledger import Ledger
    ledger = Ledger(lab / "research" / "results.tsv")
    for run, val, delta in (("exp-a-1", "0.96341278901", "-0.0123"), ("exp-b-1", "1.2", "0.004"),
                            ("exp-c-1", "", "")):
        ledger.append({"run_id": run, "created_at": "2026-01-01T00:00:00Z", "status": "succeeded",
                       "experiment_id": run[4:5], "val_bpb": val, "delta": delta})
    p = autolab("ledger", "--lab", str(lab), env=env)
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines()[1:]}
    assert "0.963413" in rows["exp-a-1"] and "-0.012300" in rows["exp-a-1"]
    assert "1.200000" in rows["exp-b-1"] and "+0.004000" in rows["exp-b-1"]
    assert "0.96341278901" not in p.stdout
    p = autolab("master", "--lab", str(lab), env=env)
    assert "val_bpb:    not measured yet" in p.stdout


def test_get_json_into_a_reader_that_hangs_up_is_quiet(lab, env):
    for i in range(300):  # a long list: the reader leaves with most of it unwritten
        warmdown_spec(lab, f"wd-{i}", value=f"0.{i + 1}", where=lab / "experiments")
    p = subprocess.Popen([*COMMAND, "get", "-o", "json", "--lab", str(lab)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"{"
        p.stdout.close()
        err = p.stderr.read().decode()
        rc = p.wait(timeout=TIMEOUT)
    finally:
        p.kill()
    assert err == "" and rc in (0, 1), err


# -- 10. progress: piped output is not silent while a run goes --------------------------------

def test_piped_run_prints_transitions_and_progress_lines(tmp_path, env):
    # minDelta 0: one run decides (the master's repeat runs are not what this is about).
    init_lab(tmp_path / "mylab", profile="tiny", data="synthetic", budget=4, min_delta=0)
    lab = tmp_path / "mylab"
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    p = autolab("run", "--unsafe-no-sandbox", "--interval", "0.3", cwd=lab,
                env={**env, "AUTOLAB_PROGRESS_SECONDS": "1"}, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "the master has no val_bpb yet: measuring its baseline first" in out
    assert re.search(r"^baseline-\S+: Running$", out, re.M), out
    assert re.search(r"^(baseline-\S+|warmdown-03): Running, \d+s elapsed", out, re.M), out
    assert re.search(r"^the master's baseline: val_bpb=\d+\.\d{6}$", out, re.M), out
    assert re.search(r"^warmdown-03: Succeeded (Promoted|Rejected) val_bpb=", out, re.M), out


def test_the_progress_of_a_run_comes_from_its_step_lines(lab):
    import json
    import time
    from controller.cli.lab import _progress_cells
    from controller.local import LocalLab
    d = lab / ".autolab" / "runs" / "exp-x-1"
    d.mkdir(parents=True)
    (d / "launch.json").write_text(json.dumps({"pid": 1, "startedAt": time.time() - 75}))
    (d / "log.txt").write_text("[bench] running candidate\nstep 00001 | loss 6.9 | lr x1.00 | "
                               "time 0.5/300s\nstep 00120 | loss 4.1 | tok/s 1 | mfu 0.0% | "
                               "lr x1.00 | time 35.2/300s\n")
    assert _progress_cells(LocalLab(lab).run_progress("exp-x-1")) == ["1m15s", "120", "~4m25s"]


def test_logs_show_a_candidates_escape_sequences_and_never_send_them_to_the_terminal(lab, env):
    """A hostile train.py prints terminal controls (retitle, clipboard write via OSC 52, clear
    the screen and forge a verdict); `autolab logs` shows them escaped."""
    import json
    f = warmdown_spec(lab, "warmdown-03")
    assert autolab("apply", "-f", str(f), "--lab", str(lab), env=env).returncode == 0
    from controller.local import LocalLab
    local = LocalLab(lab)
    record = local.read_record("warmdown-03")
    record["status"] = {"phase": "Running",
                        "job": {"backend": "local", "name": "exp-warmdown-03-1", "slot": "cpu"}}
    local.write_record("warmdown-03", record)
    log = lab / ".autolab" / "runs" / "exp-warmdown-03-1" / "log.txt"
    log.parent.mkdir(parents=True)
    log.write_text("step 00001 | loss 9.0\n\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07"
                   "\x1b[2J\x1b[Hwarmdown-03: Succeeded Promoted val_bpb=0.1\n", encoding="utf-8")
    p = autolab("logs", "warmdown-03", "--lab", str(lab), env=env)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in p.stdout and "step 00001 | loss 9.0\n" in p.stdout

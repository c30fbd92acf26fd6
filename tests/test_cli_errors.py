"""`autolab` never shows a traceback for a known failure: one line on stderr, `error: what went
wrong; what to do (whose to fix)`, exit 1: "(yours to fix)" for a spec, a file or an argument
the user wrote, "(the machine's to fix)" for the environment. Each test runs the real executable against a really broken lab
(a damaged git repo, a hand-edited ledger, Hugging Face out of reach, a reader that hangs up,
a full disk). A bug (an unknown exception) keeps its traceback; Ctrl-C exits 130 quietly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.local import init_lab
from controller.cli.main import known_failure
from controller.lab.ledger import COLUMNS
from hf_server import FakeJobsServer

AUTOLAB = Path(sys.executable).with_name("autolab")
COMMAND = [str(AUTOLAB)] if AUTOLAB.exists() else [sys.executable, "-m", "controller.cli.main"]
TIMEOUT = 60


@pytest.fixture(scope="module")
def seed_lab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seed")
    init_lab(root / "lab", profile="tiny", data="synthetic")
    return root / "lab"


@pytest.fixture()
def lab(seed_lab, tmp_path) -> Path:
    """A fresh copy of a tiny lab (git repo and all), for one test to break."""
    return Path(shutil.copytree(seed_lab, tmp_path / "lab", symlinks=True))


@pytest.fixture()
def env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("HF_", "HUGGING_FACE", "GIT_", "AUTOLAB_"))}
    e.update(GIT_CEILING_DIRECTORIES=str(tmp_path),  # a broken lab repo never finds a parent's
             HF_HOME=str(tmp_path / "hf-home"), AUTOLAB_TRACKING="0")
    e.pop("PYTHONUNBUFFERED", None)  # stdout block-buffered into a pipe, as from a shell
    return e


def autolab(*args: str, env: dict, stdout=subprocess.PIPE, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([*COMMAND, *args], env=env, stdout=stdout, stderr=subprocess.PIPE,
                       text=True, timeout=TIMEOUT, **kw)
    p.stdout = p.stdout or ""
    return p


YOURS, MACHINES = "(yours to fix)", "(the machine's to fix)"


def one_error_line(p: subprocess.CompletedProcess, kind: str = MACHINES) -> str:
    """The process failed as a known failure should: exit 1, one `error:` line that ends with
    whose it is to fix (`kind`), no traceback."""
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: "), p.stderr
    assert "; " in lines[0], f"no advice after the failure: {lines[0]}"
    assert lines[0].endswith(f" {kind}"), lines[0]
    return lines[0]


# -- git ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["objects", "HEAD"])
def test_a_broken_lab_repo_is_one_line_naming_git(lab, env, damage):
    if damage == "objects":
        shutil.rmtree(lab / ".git" / "objects")
        (lab / ".git" / "objects").mkdir()
    else:
        (lab / ".git" / "HEAD").unlink()
    line = one_error_line(autolab("worktree", "scratch", "--lab", str(lab), env=env))
    assert "git" in line and "fsck" in line


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_read_only_git_as_in_an_agent_sandbox_says_so(lab, env):
    """Codex's workspace-write sandbox keeps .git read-only: say that, not "damaged"."""
    p = subprocess.run(
        ["bwrap", "--bind", "/", "/", "--ro-bind", str(lab / ".git"), str(lab / ".git"),
         "--dev", "/dev", "--proc", "/proc", *COMMAND, "worktree", "scratch", "--lab", str(lab)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT)
    line = one_error_line(p)
    assert "Read-only file system" in line and "read-only where this ran" in line, p.stderr
    assert "autolab agents render --for codex" in line and "damaged" not in line


# -- ledger ------------------------------------------------------------------------------------

def test_a_ledger_with_a_foreign_header_is_one_line(lab, env):
    ledger = lab / "research" / "results.tsv"
    ledger.write_text("this\tis not\tthe header\nrow\t1\t2\n")
    line = one_error_line(autolab("ledger", "--lab", str(lab), env=env))
    assert "results.tsv" in line and "header" in line


def big_ledger(lab: Path, rows: int = 20_000) -> None:
    lines = ["\t".join(COLUMNS)]
    for i in range(rows):
        r = dict.fromkeys(COLUMNS, "")
        r.update(run_id=f"run-{i}", created_at="2026-01-01T00:00:00Z", status="succeeded",
                 experiment_id=f"exp-{i}", campaign="lr", val_bpb="1.234567",
                 candidate_hash=f"{i:040x}", comment="a comment " * 6)
        lines.append("\t".join(r[c] for c in COLUMNS))
    (lab / "research" / "results.tsv").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("output", ["table", "tsv"])
def test_a_reader_that_hangs_up_gets_no_noise(lab, env, output):
    """`autolab ledger | head -1` on a big ledger: nothing on stderr, no 'Exception ignored'."""
    big_ledger(lab)
    p = subprocess.Popen([*COMMAND, "ledger", "-o", output, "--lab", str(lab)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.readline()
        p.stdout.close()  # the reader is gone; megabytes are still to be written
        err = p.stderr.read().decode()
        rc = p.wait(timeout=TIMEOUT)
    finally:
        p.kill()
    assert first.split()[0] in (b"RUN_ID", b"run_id")
    assert err == "", err
    # The table is printed row by row: the write that finds the pipe closed fails, and autolab
    # exits 1. The tsv is one write of the whole file, which CPython reports as done when the
    # reader hangs up in the middle (a short write), so it may end 0: quietly either way.
    assert rc == 1 if output == "table" else rc in (0, 1)


# -- files -------------------------------------------------------------------------------------

def test_a_missing_file_of_the_lab_is_one_line_naming_it(lab, env):
    (lab / "research" / "live" / "master.json").unlink()
    line = one_error_line(autolab("master", "--lab", str(lab), env=env))
    assert "master.json" in line and "No such file" in line


@pytest.mark.parametrize("state", ["master", "status"])
def test_a_state_file_cut_short_is_one_line_naming_it(lab, env, state):
    if state == "master":
        target, command = lab / "research" / "live" / "master.json", ["master"]
    else:
        target, command = lab / ".autolab" / "status" / "cut.json", ["get", "cut"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text('{"status": {"phase": "Queued"}}')
    target.write_text(target.read_text()[:9])  # a copy cut short
    line = one_error_line(autolab(*command, "--lab", str(lab), env=env))
    assert str(target) in line and "not valid JSON" in line


def test_a_full_disk_is_one_line_and_nothing_at_exit(lab, env):
    big_ledger(lab, rows=2000)
    with open("/dev/full", "w") as full:
        p = autolab("ledger", "--lab", str(lab), env=env, stdout=full)
    line = one_error_line(p)
    assert "No space left" in line and "free some disk space" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode says")
def test_permission_denied_is_one_line(lab, env):
    (lab / "research" / "live").chmod(0)
    try:
        line = one_error_line(autolab("master", "--lab", str(lab), env=env))
    finally:
        (lab / "research" / "live").chmod(0o755)
    assert "Permission denied" in line and "permissions" in line


# -- Hugging Face ------------------------------------------------------------------------------

def closed_port() -> str:
    import socket
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_hugging_face_out_of_reach_is_one_line(lab, env):
    env.update(HF_ENDPOINT=closed_port(), HF_TOKEN="hf_fakeTokenForAClosedPort0001")
    line = one_error_line(autolab("hf", "jobs", "--lab", str(lab), env=env))
    assert "cannot reach" in line and "HF_ENDPOINT" in line


@pytest.mark.parametrize("command", [("hf", "jobs"), ("hf", "prepare")])
def test_no_token_at_all_is_one_line_saying_how_to_log_in(lab, env, command):
    env.update(HF_ENDPOINT=closed_port())  # nothing is asked of it: the token is missing first
    line = one_error_line(autolab(*command, "--lab", str(lab), env=env))
    assert "no Hugging Face token" in line and "hf auth login" in line and "HF_TOKEN" in line


def test_a_rejected_token_is_one_line_without_the_token(lab, env, tmp_path):
    srv = FakeJobsServer("hf_theRightTokenIsNotThis000001", work_dir=tmp_path).start()
    try:
        env.update(HF_ENDPOINT=srv.url, HF_TOKEN="hf_aWrongTokenThatMustNotShow02")
        p = autolab("hf", "jobs", "--lab", str(lab), env=env)
    finally:
        srv.stop()
    line = one_error_line(p)
    assert "401" in line and "hf auth login" in line
    assert "hf_aWrongTokenThatMustNotShow02" not in p.stdout + p.stderr


# -- what did not change -----------------------------------------------------------------------

def test_spec_and_cli_errors_read_as_before(lab, env, tmp_path):
    p = autolab("get", "--lab", str(tmp_path / "nowhere"), env=env)
    assert one_error_line(p, YOURS) == (
        f"error: {tmp_path / 'nowhere'}: not a lab (no lab.yaml here or in any parent "
        "directory); create one with `autolab init DIR`, or cd into a lab (or pass --lab DIR) "
        f"{YOURS}")
    p = autolab("describe", "nosuch", "--lab", str(lab), env=env)
    assert p.returncode == 1 and p.stderr == f"error: experiment 'nosuch' not found {YOURS}\n"
    # A YAML error's own text has line breaks: they become spaces.
    p = autolab("apply", "-f", "-", "--lab", str(lab), env=env, input="a: [1, 2\nb: }\n")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("error: <stdin>: malformed")


def test_a_bug_keeps_its_traceback_and_ctrl_c_exits_130_quietly(lab, monkeypatch, capsys):
    from controller.cli import lab as lab_commands, main

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(lab_commands, "cmd_master", lambda a: {}["no such key"])
    with pytest.raises(KeyError):  # main() re-raises it: the interpreter prints the traceback
        main.main(["master", "--lab", str(lab)])
    monkeypatch.setattr(lab_commands, "cmd_master", interrupted)
    assert main.main(["master", "--lab", str(lab)]) == 130
    assert capsys.readouterr().err == ""


def test_the_cli_imports_no_cluster_or_hub_client(env):
    """The failures are recognised by class name: `autolab` still imports no heavy client."""
    code = ("import sys, controller.cli.main\n"
            "heavy = {'kubernetes', 'kopf', 'huggingface_hub', 'httpx', 'httpx2', 'requests', "
            "'urllib3', 'aiohttp'}\n"
            "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


# -- failures no quick CLI path reaches: the classifier, in process ------------------------------

def test_cluster_failures_read_as_one_line():
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import MaxRetryError, NewConnectionError

    from controller.kube.cluster import ClusterError

    forbidden = ApiException(status=403, reason="Forbidden")
    forbidden.body = '{"kind": "Status", "message": "configmaps is forbidden:\\nno RBAC"}'
    unreachable = MaxRetryError(None, "/api/v1/namespaces", NewConnectionError(
        None, "Failed to establish a new connection: [Errno 111] Connection refused"))
    for e, words in [(forbidden, ["403", "forbidden", "RBAC"]),
                     (unreachable, ["Connection refused", "kubeconfig"]),
                     (ClusterError("the master ConfigMap autolab/m kept changing"), ["kubectl"]),
                     (ClusterError("x is missing; the operator creates it"), ["operator"])]:
        line = known_failure(e)
        assert line and "\n" not in line and "; " in line, line
        assert all(w in line for w in words), line


def test_other_known_failures_read_as_one_line(tmp_path):
    from filelock import Timeout

    from controller.lab.harness import HarnessError
    from controller.local import BaselineFailed

    for e in [Timeout(str(tmp_path / "x.lock")),
              HarnessError("git returned other bytes for bench/train.py (abc)"),
              BaselineFailed("the master's baseline run b failed: OOM; see log, then remove d"),
              PermissionError(13, "Permission denied", str(tmp_path / "f")),
              OSError(28, "No space left on device")]:
        line = known_failure(e)
        assert line and "\n" not in line and "; " in line, (e, line)
    assert known_failure(ZeroDivisionError("a bug")) is None
    assert known_failure(OSError("no errno, no file: unknown")) is None


def test_a_new_lab_judges_in_pairs_unless_told_otherwise(tmp_path, env):
    """`autolab init` writes `promotion.minDelta: auto`: candidates are judged on paired runs,
    one pair at a time, and init says so, with the cap (3 on the tiny profile, a CPU smoke test;
    10 otherwise; `--max-pairs` to choose). A number is written as given; anything else is
    refused with what to write instead."""
    made = autolab("init", str(tmp_path / "a"), "--profile", "tiny", "--data", "synthetic", env=env)
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load((tmp_path / "a" / "lab.yaml").read_text())["spec"]["promotion"] == \
        {"minDelta": "auto", "maxPairs": 3}
    assert "judged on its paired differences after each run (at most 3 pairs)" in made.stdout
    made = autolab("init", str(tmp_path / "d"), "--data", "synthetic", env=env)
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load((tmp_path / "d" / "lab.yaml").read_text())["spec"]["promotion"] == {"minDelta": "auto"}
    assert "judged on its paired differences after each run (at most 10 pairs)" in made.stdout
    made = autolab("init", str(tmp_path / "e"), "--profile", "tiny", "--max-pairs", "6", env=env)
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load((tmp_path / "e" / "lab.yaml").read_text())["spec"]["promotion"]["maxPairs"] == 6
    for bad in ("2", "51", "four"):
        refused = autolab("init", str(tmp_path / "f"), "--max-pairs", bad, env=env)
        assert refused.returncode == 2 and "a whole number from 3 (the first look) to 50" in refused.stderr
        assert not (tmp_path / "f").exists()
    made = autolab("init", str(tmp_path / "b"), "--profile", "tiny", "--min-delta", "0", env=env)
    assert made.returncode == 0, made.stderr
    assert yaml.safe_load((tmp_path / "b" / "lab.yaml").read_text())["spec"]["promotion"] == {"minDelta": 0.0}
    for bad in ("-0.1", "nan", "inf", "some"):
        refused = autolab("init", str(tmp_path / "c"), "--min-delta", bad, env=env)
        assert refused.returncode == 2 and "neither auto nor a number >= 0" in refused.stderr, refused.stderr
        assert not (tmp_path / "c").exists()

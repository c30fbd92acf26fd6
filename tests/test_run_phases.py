"""bench/run.py in phases and in uid mode, for real, on the tiny CPU profile.

Phases: `--phase stage`, `--phase train` and `--phase evaluate` in separate
processes, as the three containers of a Kubernetes run Pod run them
(controller/backends/kubernetes.py): the training split alone is staged for
the candidate, the train phase leaves its record and the candidate's export
in a directory, the evaluate phase measures it and signs the result.

uid mode (`--sandbox uid`): the candidate as another uid without namespaces,
as in a Hugging Face job's container where the harness is root. These tests
use a uid of their own (AUTOLAB_SANDBOX_UID), not sandbox.SANDBOX_UID, so that
the kill(-1) of uid mode cannot reach the candidates of bubblewrap runs other
tests may have going at the same time.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from controller.backends.results import authentic, result_signature
from controller.lab.harness import harness_files

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TRAIN = BENCH / "train.py"
BUDGET = 2.5
KEY = b"0123456789abcdef" * 4
HARNESS_FILES = harness_files(BENCH)  # every file bench/HARNESS lists, and the manifest


def env_for(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH")}
    env.update(AUTOLAB_CACHE=str(cache), AUTOLAB_BENCH_PROFILE="tiny", CUDA_VISIBLE_DEVICES="",
               **extra)
    return env


def run_py(harness: Path, cache: Path, *args: str | Path, timeout: float = 300,
           **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", str(harness / "run.py"), *map(str, args)],
                          env=env_for(cache, **extra), capture_output=True, text=True,
                          timeout=timeout)


def harness_modules() -> types.SimpleNamespace:
    """The harness's modules run.py imported, by concern: `.figures` is bench/harness_figures.py."""
    return types.SimpleNamespace(**{name.removeprefix("harness_"): module for name, module in sys.modules.items()
                                    if name.startswith("harness_")})


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """run.py imported with the tiny profile (for its functions and constants)."""
    cache = tmp_path_factory.mktemp("phases-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOLAB_CACHE", str(cache))
    mp.setenv("AUTOLAB_BENCH_PROFILE", "tiny")
    for var in ("AUTOLAB_SOURCE", "AUTOLAB_DATA_DIR", "AUTOLAB_TIME_BUDGET", "AUTOLAB_SANDBOX_UID"):
        mp.delenv(var, raising=False)
    mp.syspath_prepend(str(BENCH))
    if "prepare" in sys.modules:
        importlib.reload(sys.modules["prepare"])
    spec = importlib.util.spec_from_file_location("autolab_run_phases", BENCH / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert sys.modules["prepare"].PROFILE == "tiny"
    yield types.SimpleNamespace(run=run, prepare=sys.modules["prepare"], sandbox=sys.modules["sandbox"],
                                harness=harness_modules(), cache=cache)
    mp.undo()


@pytest.fixture(scope="module")
def staged_once(bench, tmp_path_factory) -> Path:
    """The stage phase's output: the training split of the synthetic source."""
    out = tmp_path_factory.mktemp("train-data")
    done = run_py(BENCH, bench.cache, "--phase", "stage", "--source", "synthetic",
                  "--train-data", out, "--termination-log", out.parent / "stage.term")
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.fixture()
def staged(staged_once, tmp_path) -> Path:
    """A copy of it per test, as each Pod has its own train-data volume: a container-mode train
    phase unlinks train.bin once it has mapped it."""
    return Path(shutil.copytree(staged_once, tmp_path / "train-data"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def train_then_evaluate(bench, staged: Path, tmp: Path, candidate: Path, *, sandbox: str,
                        train_budget: float = BUDGET, eval_budget: float = BUDGET,
                        startup: float | None = None) -> tuple[subprocess.CompletedProcess,
                                                               subprocess.CompletedProcess, dict]:
    export = tmp / "export"
    allowance = ["--startup-allowance", str(startup)] if startup is not None else []
    train = run_py(BENCH, bench.cache, "--phase", "train", "--candidate", candidate,
                   "--train-data", staged, "--export-dir", export, "--budget", str(train_budget),
                   "--sandbox", sandbox, *allowance)
    assert train.returncode == 0, train.stdout + train.stderr  # the record is written, whatever
    assert "AUTOLAB_RESULT" not in train.stdout  # the train phase signs nothing, says nothing
    key = write(tmp / "key" / "key", KEY.decode() + "\n")
    evaluate = run_py(BENCH, bench.cache, "--phase", "evaluate", "--candidate", candidate,
                      "--export-dir", export, "--result", tmp / "result.json",
                      "--termination-log", tmp / "termination-log", "--source", "synthetic",
                      "--budget", str(eval_budget), "--sandbox", sandbox, "--key-file", key,
                      "--run", "exp-x-1", *allowance)
    result = json.loads((tmp / "result.json").read_text())
    assert json.loads((tmp / "termination-log").read_text()) == result
    assert evaluate.returncode == bench.run.EXIT_CODES[result["status"]], evaluate.stdout
    return train, evaluate, result


# --- phases --------------------------------------------------------------------------------------


def test_stage_copies_the_training_split_and_nothing_else(bench, staged):
    assert sorted(p.name for p in staged.iterdir()) == ["data.json", "train.bin"]
    record = json.loads((staged / "data.json").read_text())
    data = bench.prepare.prepare("synthetic")
    assert record["sha256"] == data.sha256("train.bin")
    assert hashlib.sha256((staged / "train.bin").read_bytes()).hexdigest() == record["sha256"]
    assert (record["profile"], record["source"]) == ("tiny", "synthetic")


@pytest.mark.parametrize("sandbox", ["container", "bwrap"])
def test_train_then_evaluate_in_two_processes_gives_a_succeeded_signed_result(bench, staged,
                                                                              tmp_path, sandbox):
    if sandbox == "bwrap" and bench.sandbox.available():
        pytest.skip(bench.sandbox.available())
    train, evaluate, result = train_then_evaluate(bench, staged, tmp_path, TRAIN, sandbox=sandbox)
    assert result["status"] == "succeeded", result["reason"]
    assert result["candidate_sha1"] == hashlib.sha1(TRAIN.read_bytes()).hexdigest()
    assert result["run"] == "exp-x-1" and result["sandbox"] == sandbox
    # The controller's check, as the Kubernetes backend makes it.
    assert result["signature"] == result_signature(KEY, result)
    assert authentic(result, KEY, "exp-x-1", result["candidate_sha1"]) is None
    assert authentic(result, b"another key", "exp-x-1", result["candidate_sha1"]) is not None
    metrics = result["metrics"]
    assert 0 < metrics["val_bpb"] < 10 and metrics["total_tokens_M"] > 0
    assert metrics["training_seconds"] <= BUDGET + bench.harness.common.budget_slack(BUDGET)
    assert "model exported" in train.stdout and "[evaluate]" in evaluate.stdout
    prof = bench.prepare.PROFILES["tiny"]
    assert result["limits"] == {
        "budget_seconds": BUDGET, "startup_allowance_seconds": prof.startup_allowance,
        "export_allowance_seconds": prof.export_allowance,
        "train_phase_seconds": round(prof.startup_allowance + BUDGET + bench.harness.common.budget_slack(BUDGET)
                                     + prof.export_allowance + bench.harness.common.TRAIN_PHASE_OVERHEAD, 1)}
    # Timed in the candidate's own container, the figures are informational; in bubblewrap not.
    assert ("training_seconds" in result["self_reported"]) == (sandbox == "container")
    assert Path(result["curve"]).read_text().strip()


def test_a_train_phase_past_its_budget_is_budget_exceeded(bench, staged, tmp_path):
    candidate = write(tmp_path / "candidate" / "train.py", (
        "import prepare\n"
        "batches = prepare.make_loader('train', 1, 16)\n"
        "while True:  # never done\n"
        "    next(batches)\n"
    ))
    train, _, result = train_then_evaluate(bench, staged, tmp_path, candidate, sandbox="container",
                                           train_budget=1, eval_budget=1)
    record = json.loads((tmp_path / "export" / "record.json").read_text())
    assert record["outcome"]["reason_code"] == "BudgetExceeded"
    assert (result["status"], result["reason_code"]) == ("failed", "BudgetExceeded")
    assert "budget" in result["reason"] and "metrics" not in result
    assert result["signature"] == result_signature(KEY, result)


def test_a_container_mode_candidate_cannot_open_the_staged_split(bench, staged, tmp_path):
    """In the train container the candidate has its harness's uid. A train.bin it could open
    would be training data outside the timed stream: read during the start-up allowance, before
    the first batch starts the clock (the Pod's own limit includes that allowance)."""
    candidate = write(tmp_path / "candidate" / "train.py", (
        "import os\n"
        "argv = open(f'/proc/{os.getppid()}/cmdline', 'rb').read().split(b'\\0')\n"
        "path = os.path.join(argv[argv.index(b'--train-data') + 1].decode(), 'train.bin')\n"
        "try:\n"
        "    os.close(os.open(path, os.O_RDONLY))\n"
        "    print('STAGED-SPLIT-OPENED', path, flush=True)\n"
        "except OSError as e:\n"
        "    print('STAGED-SPLIT-REFUSED', type(e).__name__, flush=True)\n"
        + TRAIN.read_text()))
    train, _, result = train_then_evaluate(bench, staged, tmp_path, candidate, sandbox="container")
    assert "STAGED-SPLIT-REFUSED FileNotFoundError" in train.stdout, train.stdout[-2000:]
    assert "STAGED-SPLIT-OPENED" not in train.stdout
    assert not (staged / "train.bin").exists()
    assert result["status"] == "succeeded", result["reason"]  # the stream still served it


def test_an_evaluator_holds_the_train_record_to_its_own_budget(bench, staged, tmp_path):
    """A record that says training took longer than the evaluator's budget (a train phase run
    with a longer one, or a record the candidate rewrote) is BudgetExceeded."""
    _, _, result = train_then_evaluate(bench, staged, tmp_path, TRAIN, sandbox="container",
                                       train_budget=BUDGET, eval_budget=0.5)
    assert (result["status"], result["reason_code"]) == ("failed", "BudgetExceeded")
    assert "past its budget of 0.5s" in result["reason"]


def test_an_export_reached_through_a_link_is_not_evaluated(bench, staged, tmp_path):
    _, _, result = train_then_evaluate(bench, staged, tmp_path, TRAIN, sandbox="container")
    assert result["status"] == "succeeded", result["reason"]
    scratch = tmp_path / "export" / "scratch"
    shutil.move(scratch / "export", tmp_path / "elsewhere")
    (scratch / "export").symlink_to(tmp_path / "elsewhere")
    done = run_py(BENCH, bench.cache, "--phase", "evaluate", "--candidate", TRAIN,
                  "--export-dir", tmp_path / "export", "--result", tmp_path / "again.json",
                  "--source", "synthetic", "--budget", str(BUDGET), "--sandbox", "container",
                  "--termination-log", tmp_path / "t2")
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["status"], again["reason_code"]) == ("failed", "NoExport"), again["reason"]
    assert done.returncode == 3


def test_phase_arguments_are_checked_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--phase", "train",
                           "--candidate", str(TRAIN)], capture_output=True, text=True, timeout=60,
                          env=env_for(tmp_path))
    assert done.returncode == 2 and "--train-data" in done.stderr and "--export-dir" in done.stderr


def test_isolated_is_bwrap_else_a_uid_of_its_own_else_a_refusal(bench, monkeypatch):
    candidate = bench.harness.candidate
    monkeypatch.setattr(bench.sandbox, "available", lambda: None)
    assert candidate.sandbox_mode("isolated") == "bwrap"
    monkeypatch.setattr(bench.sandbox, "available", lambda: "bubblewrap cannot create namespaces here")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert candidate.sandbox_mode("isolated") == "uid"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(bench.harness.common.Outcome) as refused:
        candidate.sandbox_mode("isolated")
    assert refused.value.code == "SandboxUnavailable" and refused.value.status == "error"
    assert "cannot create namespaces" in refused.value.reason and "root" in refused.value.reason


# --- uid mode ------------------------------------------------------------------------------------

def uid_mode_unfit(bench, uid: int) -> str | None:
    """Why uid mode cannot work in this place, else None: the harness is not root, or `uid`
    cannot import torch with this interpreter (a clone under a 0700 directory such as /root or
    `mktemp -d`: the interpreter starts, but finds none of the clone's .venv). Asked the way the
    harness asks, with the sandbox's own boot run as that uid."""
    why = bench.harness.uid.uid_mode_problem()
    if why:
        return why
    import tempfile
    where = Path(tempfile.mkdtemp(prefix="autolab-uid-fitness-"))
    try:
        os.chmod(where, 0o755)
        (where / "train.py").write_text("")
        r, w = bench.sandbox.fitness_pipe()
        try:
            subprocess.run(bench.harness.uid._as_uid(uid, bench.sandbox.boot_argv(sys.executable, w, False,
                                                                           ("numpy", "torch"))),
                           cwd=where, pass_fds=(w,), capture_output=True, timeout=120,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
        finally:
            os.close(w)
        report = bench.sandbox.read_fitness(r)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return None if report and report.get("fit") else bench.sandbox.unfit_reason(report, f"uid {uid}")


def refused_here(lab, result: dict) -> bool:
    """Where uid mode cannot work (lab.unfit says why), a uid-mode run must be refused up front:
    an error, not a verdict on the candidate, that says what is wrong and the fix. True when it
    was (the test has checked all it can here); False where uid mode works."""
    if lab.unfit is None:
        return False
    assert (result["status"], result["reason_code"]) == ("error", "SandboxUnavailable"), result
    assert lab.unfit_words in result["reason"], (lab.unfit, result["reason"])
    assert result.get("metrics") is None
    return True


@pytest.fixture(scope="module")
def uid_lab(bench, tmp_path_factory):
    """A harness and a data cache only root can read, and a uid no process has; `unfit`: why uid
    mode cannot work here (not root, or a Python installation the uid cannot read), else None."""
    root = tmp_path_factory.mktemp("uid-lab")
    assert any(stat.S_IMODE(p.stat().st_mode) & 0o001 == 0 for p in (root, *root.parents)), \
        f"{root} is reachable by other users"
    harness = root / "bench"
    harness.mkdir()
    for name in HARNESS_FILES:
        shutil.copyfile(BENCH / name, harness / name)
    cache = root / "cache"
    uid = next(u for u in range(62000 + os.getpid() % 500, 63000) if not bench.harness.uid.uid_processes(u))
    done = run_py(harness, cache, "--phase", "stage", "--source", "synthetic",
                  "--train-data", root / "unused")
    assert done.returncode == 0, done.stdout + done.stderr
    unfit = uid_mode_unfit(bench, uid)
    words = None if unfit is None else ("cannot import what the benchmark needs" if bench.harness.uid.uid_mode_problem() is None
                                        else bench.harness.uid.uid_mode_problem())
    return types.SimpleNamespace(harness=harness, cache=cache, uid=uid, root=root, unfit=unfit, unfit_words=words)


def run_as_uid(bench, lab, tmp_path: Path, candidate: Path, **kw) -> tuple[dict, str]:
    done = run_py(lab.harness, lab.cache, "--candidate", candidate, "--result", tmp_path / "r.json",
                  "--source", "synthetic", "--budget", str(kw.get("budget", BUDGET)),
                  "--sandbox", "uid", "--termination-log", tmp_path / "term",
                  # the evaluator waits beside the candidate, as on a GPU machine: its
                  # directory is one the uid's preflight checks it cannot read
                  AUTOLAB_SANDBOX_UID=str(lab.uid), AUTOLAB_EARLY_EVALUATOR="1")
    result = json.loads((tmp_path / "r.json").read_text())
    assert not bench.harness.uid.uid_processes(lab.uid)  # nothing of the candidate is left
    assert done.returncode == bench.run.EXIT_CODES[result["status"]]
    return result, done.stdout


def alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_uid_mode_runs_the_candidate_as_its_own_uid_and_measures_it(bench, uid_lab, tmp_path):
    result, out = run_as_uid(bench, uid_lab, tmp_path, TRAIN)
    if refused_here(uid_lab, result):
        return
    assert result["status"] == "succeeded", result["reason"]
    assert result["sandbox"] == "uid" and f"as uid {uid_lab.uid}" in out
    assert 0 < result["metrics"]["val_bpb"] < 10


def test_uid_mode_kills_a_setsid_child_and_a_daemon_left_behind(bench, uid_lab, tmp_path):
    candidate = write(tmp_path / "candidate" / "train.py", (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
        "                         stdout=subprocess.DEVNULL)\n"
        "print('CHILD', child.pid, flush=True)\n"
        "if os.fork() == 0:  # a daemon: double fork, new session, output closed\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        print('DAEMON', os.getpid(), flush=True)\n"
        "        os.close(1); os.close(2)\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
    ))
    result, out = run_as_uid(bench, uid_lab, tmp_path, candidate)
    if refused_here(uid_lab, result):
        assert "CHILD" not in out
        return
    pids = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
            if line.startswith(("CHILD ", "DAEMON "))}
    assert set(pids) == {"CHILD", "DAEMON"}, out
    assert not any(alive(p) for p in pids.values())
    assert f"2 process(es) of uid {uid_lab.uid} outlived the candidate and were killed" in out
    assert result["reason_code"] == "NoTraining"  # it never trained; nothing of it outlived it


def test_uid_mode_candidate_reads_nothing_of_root_and_has_no_privileges(bench, uid_lab, tmp_path):
    secret = Path("/tmp") / f"autolab-test-secret-{os.getpid()}"  # a directory every uid can search
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"the root's own")
    os.close(fd)
    data = bench.prepare.load_prepared(next((uid_lab.cache / "data").glob("tiny-synthetic-*")))
    try:
        targets = [str(secret), str(data.file("val.bin")), str(uid_lab.harness / "run.py"),
                   str(uid_lab.harness), str(uid_lab.cache)]
        candidate = write(tmp_path / "candidate" / "train.py", (
            "import json, os\n"
            f"targets = {targets!r}\n"
            "read = []\n"
            "for t in targets:\n"
            "    try:\n"
            "        os.listdir(t) if os.path.isdir(t) else open(t, 'rb').read()\n"
            "        read.append(t)\n"
            "    except OSError:\n"
            "        pass\n"
            "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()\n"
            "              if ':\\t' in l)\n"
            "print('PROBE', json.dumps({'read': read, 'uid': os.getuid(), 'euid': os.geteuid(),\n"
            "      'groups': os.getgroups(), 'caps': status['CapEff'].strip(),\n"
            "      'bounding': status['CapBnd'].strip(), 'nnp': status['NoNewPrivs'].strip(),\n"
            "      'cwd_owner': os.stat('.').st_uid}), flush=True)\n"
        ))
        result, out = run_as_uid(bench, uid_lab, tmp_path, candidate)
    finally:
        secret.unlink()
    if refused_here(uid_lab, result):
        return
    [line] = [line for line in out.splitlines() if line.startswith("PROBE ")]
    probe = json.loads(line[len("PROBE "):])
    assert probe["read"] == [], probe
    assert probe["uid"] == probe["euid"] == probe["cwd_owner"] == uid_lab.uid
    assert probe["groups"] in ([], [uid_lab.uid])
    assert int(probe["caps"], 16) == 0 and int(probe["bounding"], 16) == 0 and probe["nnp"] == "1"
    assert result["status"] == "failed"


def test_uid_mode_candidate_finds_the_waiting_evaluator_and_can_use_nothing_of_it(bench, uid_lab, tmp_path):
    """The evaluator waits beside the candidate (as on a GPU machine), and uid mode shares /proc:
    its command line names the data, the verdict file and its pid. The candidate tries them all:
    read the validation data it names, forge the verdict in its directory, open its stdin, signal
    it. Every attempt fails, and the run is measured as if nothing had been tried."""
    hunt = (
        "import json, os, signal\n"
        "tried = {}\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        argv = open(f'/proc/{pid}/cmdline', 'rb').read().decode().split('\\0')\n"
        "    except OSError:\n"
        "        continue\n"
        "    if not (any(a.endswith('evaluate.py') for a in argv) and '--export-dir' in argv):\n"
        "        continue\n"
        "    out, data = argv[argv.index('--out') + 1], argv[argv.index('--data-dir') + 1]\n"
        "    def attempt(what, fn):\n"
        "        try:\n"
        "            fn()\n"
        "            tried[what] = 'DONE'\n"
        "        except OSError as e:\n"
        "            tried[what] = type(e).__name__\n"
        "    attempt('read val.bin', lambda: open(os.path.join(data, 'val.bin'), 'rb').read())\n"
        "    attempt('forge verdict', lambda: open(out, 'w').write(json.dumps(\n"
        "        {'ok': True, 'val_bpb': 0.01, 'num_params': 1, 'eval_seconds': 0, 'device': 'cpu',\n"
        "         'reason_code': 'Succeeded', 'causality_max_nats': 0.0})))\n"
        "    attempt('write its stdin', lambda: open(f'/proc/{pid}/fd/0', 'w').write('/tmp\\n'))\n"
        "    attempt('signal it', lambda: os.kill(int(pid), signal.SIGSTOP))\n"
        "print('HUNT', json.dumps(tried), flush=True)\n"
    )
    candidate = write(tmp_path / "candidate" / "train.py", hunt + TRAIN.read_text())
    result, out = run_as_uid(bench, uid_lab, tmp_path, candidate)
    if refused_here(uid_lab, result):
        assert "HUNT" not in out
        return
    assert "the evaluator gets ready" in out
    [line] = [line for line in out.splitlines() if line.startswith("HUNT ")]
    tried = json.loads(line[len("HUNT "):])
    assert set(tried) == {"read val.bin", "forge verdict", "write its stdin", "signal it"}, tried
    assert "DONE" not in tried.values(), tried
    # the forged verdict says 0.01; an honest tiny run scores about 0.4-0.7 (0.49 on CI's machine,
    # where T=128 trains more steps in the budget), so 0.1 tells the two apart with room either side
    assert result["status"] == "succeeded" and result["metrics"]["val_bpb"] > 0.1, result


def test_uid_mode_refuses_when_the_candidate_could_read_the_harness(bench, uid_lab, tmp_path):
    import tempfile
    # A copy of the harness every user can read, wherever this clone is (a 0700 parent or not).
    readable = Path(tempfile.mkdtemp(prefix="autolab-readable-harness-"))
    try:
        os.chmod(readable, 0o755)
        for name in HARNESS_FILES:
            shutil.copyfile(BENCH / name, readable / name)
            os.chmod(readable / name, 0o644)
        ran = tmp_path / "ran"
        candidate = write(tmp_path / "candidate" / "train.py", f"open({str(ran)!r}, 'w')\n")
        done = run_py(readable, uid_lab.cache, "--candidate", candidate, "--result", tmp_path / "r.json",
                      "--source", "synthetic", "--sandbox", "uid", "--termination-log", tmp_path / "t",
                      AUTOLAB_SANDBOX_UID=str(uid_lab.uid))
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    result = json.loads((tmp_path / "r.json").read_text())
    assert done.returncode == 4 and result["reason_code"] == "SandboxUnavailable"
    assert not ran.exists()
    if bench.harness.uid.uid_mode_problem():  # not root: uid mode is refused before anything is probed
        assert refused_here(uid_lab, result)
        return
    assert f"uid {uid_lab.uid} could read {readable}" in result["reason"]


# --- the syscall filter: no network, no ptrace, whatever the sandbox -----------------------------

NETWORK_PROBE = '''\
import ctypes, errno, json, os, socket
PORT, NRS = {port}, {nrs!r}
libc = ctypes.CDLL(None, use_errno=True)

def syscall(nr, *args):
    if libc.syscall(nr, *args) == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

def tcp4():
    with socket.create_connection(("127.0.0.1", PORT), timeout=3) as s:
        s.sendall(b"HIT")

def udp4():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(b"HIT", ("127.0.0.1", PORT))

def tcp6():
    socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()

def netlink():
    socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()

def packet():
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()

def io_uring():  # io_uring can open and connect sockets without the socket call
    params = ctypes.create_string_buffer(120)
    syscall(NRS["io_uring_setup"], 8, params)

def keyring():  # a key in the uid's keyring outlives the run: a note for the next one
    syscall(NRS["add_key"], b"user", b"autolab-probe", b"1", 1, -4)  # KEY_SPEC_USER_KEYRING

def ptrace_parent():  # PTRACE_ATTACH the harness, then let it go at once
    syscall(NRS["ptrace"], 16, os.getppid(), 0, 0)
    syscall(NRS["ptrace"], 17, os.getppid(), 0, 0)

def unix():  # what the data stream needs stays allowed
    a, b = socket.socketpair()
    a.close(), b.close()

got = {{}}
for attempt in (tcp4, udp4, tcp6, netlink, packet, io_uring, keyring, ptrace_parent, unix):
    try:
        attempt()
        got[attempt.__name__] = "ok"
    except OSError as e:
        got[attempt.__name__] = errno.errorcode.get(e.errno, str(e.errno))
print("PROBE", json.dumps(got), flush=True)
'''


@pytest.mark.parametrize("sandbox", ["container", "uid", "bwrap"])
def test_a_candidate_reaches_no_network_and_traces_nothing_in_any_sandbox(bench, staged, tmp_path,
                                                                          request, sandbox):
    """The train container of a Kubernetes Pod has the Pod's network, and uid mode (a Hugging
    Face job) the job's: a candidate that could connect could download the public validation
    split and train on it. A listener on this machine's loopback stands for the Internet. Under
    the syscall filter every socket but a Unix one, io_uring and ptrace fail with EPERM, and the
    listener hears nothing. So does adding a key to the uid's kernel keyring, which outlives
    the run (and bubblewrap, run as root, gives no keyring of its own): the next run of that
    uid could read it, count its runs by it and know which of its confirm runs it is."""
    if sandbox == "bwrap" and bench.sandbox.available():
        pytest.skip(bench.sandbox.available())
    import platform
    import socket
    # the kernel's numbers (asm/unistd_64.h, asm-generic/unistd.h), not the harness's table
    nrs = {"x86_64": {"io_uring_setup": 425, "ptrace": 101, "add_key": 248},
           "aarch64": {"io_uring_setup": 425, "ptrace": 117, "add_key": 217}}[platform.machine()]
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp.setblocking(False)
    port = tcp.getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", port))
    udp.setblocking(False)
    code = NETWORK_PROBE.format(port=port, nrs=nrs)
    try:
        if sandbox == "uid":
            lab = request.getfixturevalue("uid_lab")
            candidate = write(tmp_path / "candidate" / "train.py", code)
            result, out = run_as_uid(bench, lab, tmp_path, candidate)
            if refused_here(lab, result):
                assert "PROBE " not in out
                return
        elif sandbox == "container":
            candidate = write(tmp_path / "candidate" / "train.py", code)
            out = run_py(BENCH, bench.cache, "--phase", "train", "--candidate", candidate,
                         "--train-data", staged, "--export-dir", tmp_path / "export",
                         "--budget", str(BUDGET), "--sandbox", "container").stdout
        else:
            candidate = write(tmp_path / "candidate" / "train.py", code)
            out = run_py(BENCH, bench.cache, "--candidate", candidate, "--result",
                         tmp_path / "r.json", "--source", "synthetic", "--budget", str(BUDGET),
                         "--sandbox", "bwrap", "--termination-log", tmp_path / "term").stdout
        heard = []
        for sock, take in ((tcp, lambda s: s.accept()), (udp, lambda s: s.recv(16))):
            try:
                heard.append(take(sock))
            except BlockingIOError:
                pass
    finally:
        tcp.close()
        udp.close()
    [line] = [line for line in out.splitlines() if "PROBE " in line]
    probe = json.loads(line.split("PROBE ", 1)[1])
    assert heard == []
    assert probe == {"tcp4": "EPERM", "udp4": "EPERM", "tcp6": "EPERM", "netlink": "EPERM",
                     "packet": "EPERM", "io_uring": "EPERM", "keyring": "EPERM",
                     "ptrace_parent": "EPERM", "unix": "ok"}, probe


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="drops CAP_SYS_PTRACE from root with setpriv: only root has it to drop")
def test_a_container_mode_candidate_cannot_reach_into_its_harness(bench, staged, tmp_path):
    """In a Kubernetes train container the candidate has its harness's uid, and the harness has
    the Pod's network: its memory, environment and file descriptors would be a way around the
    syscall filter. The harness makes itself non-dumpable first, so a process of its uid without
    CAP_SYS_PTRACE can neither open /proc/<harness>/mem nor follow /proc/<harness>/fd/N. (Here
    both are root without CAP_SYS_PTRACE, as a container's non-root user is. Its environment
    holds nothing secret: the run's key is only in the evaluate container.)"""
    candidate = write(tmp_path / "candidate" / "train.py", (
        "import errno, json, os\n"
        "harness, got = os.getppid(), {}\n"
        "for what in ('mem', 'fd'):\n"
        "    path = f'/proc/{harness}/{what}'\n"
        "    try:\n"
        "        os.readlink(path + '/1') if what == 'fd' else open(path, 'rb').close()\n"
        "        got[what] = 'ok'\n"
        "    except OSError as e:\n"
        "        got[what] = errno.errorcode.get(e.errno, str(e.errno))\n"
        "print('PROBE', json.dumps(got), flush=True)\n"))
    done = subprocess.run(
        ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-all", sys.executable, "-I",
         str(BENCH / "run.py"), "--phase", "train", "--candidate", str(candidate),
         "--train-data", str(staged), "--export-dir", str(tmp_path / "export"),
         "--budget", str(BUDGET), "--sandbox", "container"],
        env=env_for(bench.cache), capture_output=True, text=True, timeout=300)
    assert "PROBE " in done.stdout, done.stdout + done.stderr
    [line] = [line for line in done.stdout.splitlines() if "PROBE " in line]
    assert json.loads(line.split("PROBE ", 1)[1]) == {"mem": "EACCES", "fd": "EACCES"}


@pytest.mark.parametrize("plant", ["directory", "fifo"])
def test_a_container_mode_candidate_cannot_make_its_train_record_unwritable(bench, staged, tmp_path,
                                                                           plant):
    """The candidate's scratch is export_dir/scratch: the record's directory is writable to it
    (same uid). A directory at record.json made the harness's replace fail (exit 4: the Job
    retries it, then `lost`, 'not a measurement, it may run again'); a FIFO at the predictable
    temp name (.record.json.<pid>.tmp; pid 1 in a Pod) blocked the harness until the Job's
    deadline. Either let a candidate void any run it liked, e.g. an unlucky one."""
    hook = ("import os\n"
            "_parent = os.path.dirname(os.getcwd())\n"
            + ("os.mkdir(os.path.join(_parent, 'record.json'))\n" if plant == "directory" else
               "os.mkfifo(os.path.join(_parent, f'.record.json.{os.getppid()}.tmp'))\n"))
    candidate = write(tmp_path / "candidate" / "train.py", hook + TRAIN.read_text())
    train, _, result = train_then_evaluate(bench, staged, tmp_path, candidate, sandbox="container")
    assert json.loads((tmp_path / "export" / "record.json").read_text())["phase"] == "train"
    assert result["status"] == "succeeded", result["reason"]

# --- what a candidate writes must never become the harness's fault, nor the harness's memory
#
# A run whose result is `error` measured nothing: the candidate is not a Duplicate and may run
# again, and a confirm run that ends in `error` ends its experiment NotConfirmed (its series
# still counts as a try: test_noise.py). So a candidate that could turn a run into `error` at will, once it has
# trained and can judge its own luck (its training loss, a held-out slice of the training
# stream), could void every unlucky draw and keep the lucky ones. Three ways it could:
#
# * curve.jsonl with an integer too large for a float: math.isfinite raised OverflowError in
#   harness_files.py's _curve (a harness error before the evaluation);
# * stats.json nested thousands deep: json.loads raised RecursionError, which _json_object did not
#   catch (ValueError only), and stats.json with such an integer (OverflowError in _number);
# * on a machine without a GPU, an export whose weights claim a CUDA device: the evaluator blamed
#   itself ("exported on a GPU but the evaluator has none").
#
# And one line of output without a newline was read whole by the harness's readline(): the root
# harness grew by twice the line's size, without bound (1 GiB of output: 2.1 GB).

EXPORT = "\nif prepare.export_model(raw_model, stats) is not None:"


def _blame_run(bench, tmp: Path, candidate: Path, rss: bool = False) -> tuple[dict, int | None]:
    env = env_for(bench.cache)
    mode = "bwrap" if bench.sandbox.available() is None else "none"
    argv = [sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(candidate),
            "--result", str(tmp / "result.json"), "--source", "synthetic", "--budget", str(BUDGET),
            "--sandbox", mode, "--termination-log", str(tmp / "term")]
    if rss:  # the peak RSS of the harness, measured in a process of its own
        argv = [sys.executable, "-c", "import resource, subprocess, sys; "
                "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    peak = int(done.stdout.split()[-1]) * 1024 if rss else None
    return json.loads((tmp / "result.json").read_text()), peak


def _with_before_export(tmp: Path, code: str) -> Path:
    src = TRAIN.read_text()
    assert EXPORT in src
    path = tmp / "candidate" / "train.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(src.replace(EXPORT, code + EXPORT))
    return path


def test_hostile_numbers_and_nesting_in_candidate_files_raise_nothing(bench):
    files, figures = bench.harness.files, bench.harness.figures
    huge = 10 ** 400
    assert files._number(huge) is None and files._number(-huge) is None and files._number(3) == 3
    assert files._json_object(b"[" * 30000 + b"]" * 30000) == {}
    assert files._json_object(b'{"a": ' * 30000 + b"1" + b"}" * 30000) == {}
    line = json.dumps({"step": 10, "loss": 1.0, "tokens_per_sec": 5.0})
    raw = "\n".join([line, '{"step": 1%s, "loss": 1, "tokens_per_sec": 1}' % ("0" * 400),
                     "[" * 30000, '{"step": 1, "loss": 1, "tokens_per_sec": 1, "time": 1%s}' % ("0" * 400)])
    assert files._curve(raw.encode()) == [json.loads(line), {"step": 1, "loss": 1, "tokens_per_sec": 1}]
    stats = {"peak_vram_mb": huge, "num_steps": huge, "mfu_percent": [huge]}
    metrics, own = figures._metrics(stats, {"val_bpb": 1.0, "num_params": 10}, training=1.0, total=2.0,
                                    tokens=3, gpu=None, had_gpu=True)
    assert metrics["peak_vram_mb"] is None and metrics["num_steps"] is None and own == []
    assert figures._reported(stats) == {}


@pytest.mark.parametrize("attack", ["curve-bigint", "stats-nested", "stats-bigint", "cuda-device"])
def test_a_candidate_cannot_turn_its_run_into_a_harness_error(bench, tmp_path, attack):
    code = {
        "curve-bigint": '''
import os as _os
with open(_os.environ["AUTOLAB_CURVE_PATH"], "a") as _f:
    _f.write('{"step": 1%s, "loss": 1.0, "tokens_per_sec": 1.0}\\n' % ("0" * 400))
''',
        "stats-nested": '''
_orig_export = prepare.export_model
def _export(model_, stats_, *a, **k):
    out = _orig_export(model_, stats_, *a, **k)
    if out is not None:
        (out / "stats.json").write_text("[" * 30000 + "]" * 30000)
    return out
prepare.export_model = _export
''',
        "stats-bigint": '''
stats["peak_vram_mb"] = 10 ** 400
''',
        "cuda-device": '''
import json as _json, zipfile as _zipfile, os as _os
_orig_export = prepare.export_model
def _export(model_, stats_, *a, **k):
    out = _orig_export(model_, stats_, *a, **k)
    if out is None:
        return out
    src, tmp = out / "model.pt2", out / "m.tmp"
    with _zipfile.ZipFile(src) as zin, _zipfile.ZipFile(tmp, "w", _zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("model_weights_config.json"):
                doc = _json.loads(data)
                next(iter(doc["config"].values()))["tensor_meta"]["device"] = {"type": "cuda", "index": 0}
                data = _json.dumps(doc).encode()
            zout.writestr(info.filename, data)
    _os.replace(tmp, src)
    return out
prepare.export_model = _export
''',
    }[attack]
    result, _ = _blame_run(bench, tmp_path, _with_before_export(tmp_path, code))
    assert result["status"] != "error", result["reason"]
    if attack == "cuda-device":
        assert (result["status"], result["reason_code"]) == ("failed", "ExportRefused"), result
    else:  # informational files: the junk is dropped, the model is measured
        assert result["status"] == "succeeded", result["reason"]


def test_output_without_newlines_does_not_grow_the_harness(bench, tmp_path):
    mib = 256
    candidate = tmp_path / "candidate" / "train.py"
    candidate.parent.mkdir(parents=True)
    candidate.write_text(f"import os\nfor _ in range({mib}):\n    os.write(1, b'A' * 2**20)\n"
                         "os.write(1, b'\\nend\\n')\n")
    result, peak = _blame_run(bench, tmp_path, candidate, rss=True)
    assert result["reason_code"] == "NoTraining"
    assert peak < 150 * 2**20, f"the harness peaked at {peak / 2**20:.0f} MiB for {mib} MiB of one line"

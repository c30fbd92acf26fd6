"""Faults of the machine are never the candidate's: each is an error before or around the run.

A run that ends `failed` is a verdict on the candidate: the ledger keeps it, and the lab never
runs that program again (a Duplicate). So a fault of the machine must never end that way. Each
fault here is made for real, on the real harness (tiny CPU profile): the sandbox's uid cannot
read the Python installation (a clone under a 0700 directory), the interpreter lacks torch, the
GPU a run was given does not work, the disk is full, the data cache is unusable, the evaluator
dies (the kernel's OOM killer). Each run ends `error` with a reason that names the fix, and once
the fault is fixed the very same program is measured. Through the lab loop, the experiment's
ledger row says `error` and the same diff, applied again, runs and is measured.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller.local import init_lab
from labkit import spec_from_edit
from test_run_phases import BENCH, BUDGET, TRAIN, bench, env_for, refused_here, uid_lab  # noqa: F401

SITE_PACKAGES = Path(importlib.util.find_spec("numpy").origin).parents[1]  # this interpreter's, with torch


def harness_run(python: Path | str, harness: Path, cache: Path, tmp: Path, mode: str, *pre: str,
                **extra: str) -> tuple[dict, str]:
    """One run of TRAIN by `python -I harness/run.py`, its result and its output."""
    result = tmp / f"r-{time.monotonic_ns()}.json"
    done = subprocess.run([*pre, str(python), "-I", str(harness / "run.py"), "--candidate", str(TRAIN),
                           "--result", str(result), "--source", "synthetic", "--budget", str(BUDGET),
                           "--sandbox", mode, "--termination-log", str(tmp / "term")],
                          env=env_for(cache, **extra), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert result.exists(), out[-3000:]
    doc = json.loads(result.read_text())
    assert done.returncode == {"succeeded": 0, "failed": 3, "error": 4}[doc["status"]], out[-2000:]
    return doc, out


@pytest.fixture
def open_dir():
    """A directory every uid can enter (pytest's own are 0700), removed afterwards."""
    import tempfile
    where = Path(tempfile.mkdtemp(prefix="autolab-test-python-"))
    os.chmod(where, 0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def a_python(tmp: Path, fault: str) -> tuple[Path, object]:
    """A virtual environment in tmp whose interpreter runs the harness, with `fault`, and the fix:
    "unreadable": its directory is root's alone (mode 0700), as a clone under /root is to any
    other uid; "no-torch": it has every package of this interpreter but torch."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [site] = venv.glob("lib/python*/site-packages")
    pth = site / "autolab-test.pth"
    if fault == "no-torch":
        without = tmp / "without-torch"
        without.mkdir()
        for entry in SITE_PACKAGES.iterdir():
            if not entry.name.startswith(("torch", "functorch")) and not entry.name.endswith(".pth"):
                (without / entry.name).symlink_to(entry)
        pth.write_text(f"{without}\n")
    else:
        pth.write_text(f"{SITE_PACKAGES}\n")
        os.chmod(venv, 0o700)

    def fix() -> None:
        pth.write_text(f"{SITE_PACKAGES}\n")
        os.chmod(venv, 0o755)

    return venv / "bin" / "python", fix


@pytest.mark.parametrize("mode", ["none", "bwrap", "uid"])
def test_a_python_the_sandbox_cannot_use_is_an_error_and_the_same_program_runs_once_fixed(bench, tmp_path,
                                                                                          open_dir, request, mode):
    root = os.geteuid() == 0
    harness, cache, extra = BENCH, bench.cache, {}
    if mode == "uid":
        lab = request.getfixturevalue("uid_lab")
        harness, cache, extra = lab.harness, lab.cache, {"AUTOLAB_SANDBOX_UID": str(lab.uid)}
    if mode == "bwrap" and bench.sandbox.available():  # no sandbox here: the run is refused, clearly
        result, _ = harness_run(sys.executable, harness, cache, tmp_path, mode)
        assert (result["status"], result["reason_code"]) == ("error", "SandboxUnavailable")
        assert bench.sandbox.available() in result["reason"]
        return
    fault = "unreadable" if root and mode != "none" else "no-torch"
    python, fix = a_python(open_dir, fault)
    result, out = harness_run(python, harness, cache, tmp_path, mode, **extra)
    if mode == "uid" and refused_here(lab, result):  # not root: uid mode is refused before anything
        return
    assert (result["status"], result["reason_code"]) == ("error", "SandboxUnavailable"), result["reason"]
    assert "nothing of the candidate ran" in result["reason"], result["reason"]
    assert "No module named" in result["reason"] and result["candidate_sha1"]
    if fault == "unreadable":
        assert "every directory above it searchable" in result["reason"], result["reason"]
    assert "step " not in out  # train.py never ran
    fix()
    again, out = harness_run(python, harness, cache, tmp_path, mode, **extra)
    if mode == "uid" and lab.unfit:  # a place where uid mode never works (a 0700 parent): refused again
        assert refused_here(lab, again)
        return
    assert again["status"] == "succeeded", again["reason"] + out[-2000:]
    assert again["candidate_sha1"] == result["candidate_sha1"]


def test_a_gpu_the_sandbox_cannot_use_is_an_error_not_a_run_on_the_cpu(bench, tmp_path, monkeypatch):
    """A slot with NVIDIA devices whose CUDA does not work in the sandbox (a driver mismatch, a
    device node missing): the candidate would train on the CPU and be measured as a bad idea. This
    CPU machine stands for one: `wants_gpu` (the harness's look at /dev/nvidia*) is told there
    are devices, and torch here has no CUDA."""
    result_path = tmp_path / "r.json"
    monkeypatch.setattr(bench.sandbox, "wants_gpu", lambda: True)
    result = bench.run.run_candidate(TRAIN, result_path, source="synthetic", budget=BUDGET, sandbox_request="none",
                                     echo=False)
    assert (result["status"], result["reason_code"]) == ("error", "SandboxUnavailable"), result["reason"]
    assert "the run was given a GPU but CUDA does not work" in result["reason"]
    monkeypatch.setattr(bench.sandbox, "wants_gpu", lambda: False)  # the slot is a CPU one again
    again = bench.run.run_candidate(TRAIN, result_path, source="synthetic", budget=BUDGET, sandbox_request="none",
                                    echo=False)
    assert again["status"] == "succeeded", again["reason"]


def test_a_full_disk_is_an_error_before_the_candidate_starts(bench, tmp_path):
    """The scratch and the evaluator's directory on a filesystem with 8 MiB free (a tmpfs mounted
    in a mount namespace of the run's own): the candidate would crash writing its model."""
    small = tmp_path / "small"
    small.mkdir()
    # As another user, a user namespace lets mount(8) run as that namespace's root; the disk check
    # comes before anything the harness does as root there would fail.
    ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    mount = [*ns, "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs "$0" && exec "$@"', str(small)]
    result, out = harness_run(sys.executable, BENCH, bench.cache, tmp_path, "none", *mount, TMPDIR=str(small))
    assert (result["status"], result["reason_code"]) == ("error", "HarnessError"), result["reason"]
    assert "MiB are free on the filesystem of" in result["reason"] and "nothing of the candidate ran" in result["reason"]
    assert "step " not in out
    again, _ = harness_run(sys.executable, BENCH, bench.cache, tmp_path, "none")  # room again
    assert again["status"] == "succeeded", again["reason"]


def test_an_unusable_data_cache_is_an_error_that_names_the_cache(bench, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "data").write_text("not a directory\n")  # unusable by anyone, root included
    result, out = harness_run(sys.executable, BENCH, cache, tmp_path, "none")
    assert (result["status"], result["reason_code"]) == ("error", "DataUnavailable"), result["reason"]
    assert f"the data cache {cache} cannot be used" in result["reason"] and "AUTOLAB_CACHE" in result["reason"]
    (cache / "data").unlink()
    again, _ = harness_run(sys.executable, BENCH, cache, tmp_path, "none")
    assert again["status"] == "succeeded", again["reason"]


@contextlib.contextmanager
def evaluators_killed(cache: Path, how_many: int | None):
    """Kill (SIGKILL, as the OOM killer does) the evaluators of runs on `cache` as soon as they
    start: the first `how_many`, or every one (None). Yields the list of pids killed."""
    killed: list[int] = []
    stop = threading.Event()

    def hunt() -> None:
        while not stop.is_set() and (how_many is None or len(killed) < how_many):
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in killed:
                    continue
                try:
                    cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"evaluate.py" in cmd and str(cache).encode() in cmd:
                    with contextlib.suppress(OSError):
                        os.kill(int(entry), signal.SIGKILL)
                        killed.append(int(entry))
            time.sleep(0.01)

    thread = threading.Thread(target=hunt, daemon=True)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("kills", [1, None])
def test_an_evaluator_that_dies_before_it_is_ready_is_started_again_and_never_blamed_on_the_model(
        bench, tmp_path, kills):
    """An evaluator killed before it read anything of the export died of its machine. It is
    started once more (the candidate is gone by then); dying again is an error, and once the
    machine is fixed the same program is measured."""
    with evaluators_killed(bench.cache, kills) as killed:
        result, out = harness_run(sys.executable, BENCH, bench.cache, tmp_path, "none")
    assert "the evaluator ended before it was ready" in out and killed
    if kills == 1:
        assert result["status"] == "succeeded", result["reason"]
        return
    assert (result["status"], result["reason_code"]) == ("error", "HarnessError"), result["reason"]
    assert "died before it read the export, twice" in result["reason"] and len(killed) == 2
    again, _ = harness_run(sys.executable, BENCH, bench.cache, tmp_path, "none")
    assert again["status"] == "succeeded", again["reason"]


def test_through_the_loop_a_machine_fault_records_no_verdict_and_the_same_diff_runs_again(
        tmp_path, monkeypatch):
    """The lab's view: the run's error is the experiment's Failed phase with the harness's reason,
    its ledger row says `error` (not measured), and the same diff applied again under a new name
    is neither a Duplicate nor refused: it runs and is measured."""
    broken = tmp_path / "broken-cache"
    broken.mkdir()
    (broken / "data").write_text("not a directory\n")
    monkeypatch.setenv("AUTOLAB_GPUS", "")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    monkeypatch.setenv("AUTOLAB_UNSAFE_NO_SANDBOX", "1")
    monkeypatch.setenv("AUTOLAB_CACHE", str(broken))
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2, min_delta=0) as lab:
        lab.repo.set_master_metric(0.001)  # no baseline run: the experiment is under test

        def settle(name: str) -> dict:
            deadline = time.time() + 300
            while time.time() < deadline:
                summary = lab.step()
                st = next(st for n, st, _ in summary.rows if n == name)
                if st.get("phase") in ("Succeeded", "Failed", "Duplicate", "Invalid"):
                    return st
                time.sleep(0.2)
            raise AssertionError(f"{name} did not finish")

        lab.apply_file(spec_from_edit(lab, "warm-a", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"), "test")
        st = settle("warm-a")
        assert (st["phase"], st["reason"]) == ("Failed", "DataUnavailable"), st
        [row] = [r for r in lab.ledger.rows() if r["experiment_id"] == "warm-a"]
        assert row["status"] == "error", row
        monkeypatch.delenv("AUTOLAB_CACHE")  # the machine is fixed
        lab.apply_file(spec_from_edit(lab, "warm-a-again", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"), "test")
        st = settle("warm-a-again")
        assert st["phase"] == "Succeeded", st


def test_autolab_run_tells_a_python_the_sandbox_cannot_use_once_before_any_run(bench, tmp_path, open_dir):
    """`autolab run` makes the sandbox's check itself before it starts anything: a Python the
    sandbox's uid cannot read (as root; as another user, one without torch) stops it at once,
    with the fix, and no run is started."""
    with init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2) as lab:
        lab.apply_file(spec_from_edit(lab, "warm-b", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"), "test")
    python, _ = a_python(open_dir, "unreadable" if os.geteuid() == 0 else "no-torch")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), AUTOLAB_TRACKING="0")
    env.pop("AUTOLAB_UNSAFE_NO_SANDBOX", None)
    done = subprocess.run([str(python), "-m", "controller.cli.main", "run", "--lab", str(lab.root)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    if bench.sandbox.available():  # no sandbox at all here: that is what it says
        assert "cannot isolate candidates on this machine" in done.stderr, done.stderr
    else:
        assert "candidates cannot run in the sandbox here" in done.stderr, done.stderr
        assert "cannot import what the benchmark needs" in done.stderr and "No module named" in done.stderr
        assert done.stderr.count("cannot import what the benchmark needs") == 1  # said once
    assert not (lab.root / ".autolab" / "runs").exists() or not any((lab.root / ".autolab" / "runs").iterdir())

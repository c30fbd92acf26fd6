"""Suite-wide guard: a test leaves no process of its own behind.

The suite starts real processes: run harnesses, candidates in their sandboxes,
evaluators, `autolab run` loops, operators, the Kubernetes emulator, stand-ins.
A test that ends with one of them still alive leaves it to train, hold memory
(on a GPU machine a CUDA context) or kill the next test's processes of its uid
(uid mode's sweep). So after each test this guard looks for processes that were
not there before it and are the test's: descendants of this pytest process, or
processes working in or named after this worker's temporary directory, or
started while this test ran (their environment holds its PYTEST_CURRENT_TEST):
a run or a check worker whose controller was killed is no longer anyone's child. Those still alive
after a grace period (a stopped run takes a few seconds to end) are killed and
the test fails, naming them.

Not the test's: the process-wide pool of checking processes (controller/lab/check_pool.py's
shared_check_pool, started by the first check and serving every later test, with
the git processes its workers keep), multiprocessing's resource tracker, and a
lab repo's long-lived git plumbing (`git cat-file --batch` and its kin, see
`controller.lab.git.Plumbing`): it belongs to a LabRepo object, ends with it (`close()`, or garbage
collection once pytest lets go of the test's fixtures) and runs nothing of the
test's.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

GRACE_SECONDS = 15.0  # for processes the test stopped to finish ending (a harness writes its result)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), fields[0]


def _living() -> dict[int, int]:
    """pid -> parent pid of every process that is not a zombie."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] not in ("Z", "X"):
                out[int(entry)] = st[0]
    return out


def _started_by(pid: int, nodeid: str) -> bool:
    try:
        return f"PYTEST_CURRENT_TEST={nodeid} (".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _names_place(pid: int, place: str) -> bool:
    try:
        if os.readlink(f"/proc/{pid}/cwd").startswith(place):
            return True
        return place.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _descendants(living: dict[int, int], roots: set[int]) -> set[int]:
    out = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, parent in living.items():
            if parent in out and pid not in out:
                out.add(pid)
                grew = True
    return out


PLUMBING = (b"cat-file\0--batch", b"hash-object\0-w\0--no-filters\0--stdin-paths", b"mktree\0-z\0--batch",
            b"hash-object\0-w\0-t\0commit\0--stdin-paths", b"update-ref\0--stdin")


def _plumbing(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return cmd.startswith(b"git\0") and cmd.rstrip(b"\0").endswith(PLUMBING)


def _ours(place: str, nodeid: str, before: set[int]) -> dict[int, str]:
    """New living processes of this test: pid -> command line."""
    living = _living()
    me = os.getpid()
    shared = {p.pid for p in multiprocessing.active_children()}  # the check pool's workers
    tracker = getattr(getattr(multiprocessing, "resource_tracker", None), "_resource_tracker", None)
    if getattr(tracker, "_pid", None):
        shared.add(tracker._pid)
    mine, theirs = _descendants(living, {me}), _descendants(living, shared)
    found = {}
    for pid in living:
        if pid == me or pid in before or pid in theirs or _plumbing(pid):
            continue
        if pid in mine or _names_place(pid, place) or _started_by(pid, nodeid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            found[pid] = cmd.strip()[:200]
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(request, tmp_path_factory):
    place = str(tmp_path_factory.getbasetemp())
    before = set(_living())
    yield
    gc.collect()
    deadline = time.monotonic() + GRACE_SECONDS
    left = _ours(place, request.node.nodeid, before)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _ours(place, request.node.nodeid, before)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))
    pytest.fail(f"{request.node.nodeid} left {len(left)} process(es) of its own alive "
                f"{GRACE_SECONDS:g}s after it ended (now killed):\n{lines}", pytrace=False)

"""The candidate in its sandbox: start it, watch it, stop it, and make sure nothing of it is left.

`_run_sandboxed` starts the argv the sandbox built, reads its output (capped per line and in
all), watches the deadlines (the start-up allowance before the first batch, the budget and its
slack, the export allowance after training) and kills what overruns them. When the sandbox's
first process exits the kernel kills every process left in its PID namespace; `_survivors`
checks that none is left before the harness goes on (`ProcessesLeft`).

Sandboxes (`--sandbox`):

- `bwrap` (the default): bubblewrap (sandbox.py: its own PID and network namespaces, another uid,
  read-only system, one writable scratch directory); refuses to run without it.
- `uid`: the candidate as a uid of its own, for a container where namespaces cannot be
  made (a Hugging Face job); see harness_uid.
- `isolated`: bwrap where it works, else uid mode when running as root, else
  a refusal (an error result saying why). The Hugging Face entry point uses it.
- `container`: the candidate runs as a plain child and the caller's container
  is the boundary (the train container of a Kubernetes Pod).
- `none`: a plain child, no boundary (`--unsafe-no-sandbox`); the result says so.
- `auto`: bwrap where it works, else none.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import sandbox  # the trusted one, next to this file
from harness_common import Outcome, RunLog, budget_slack, kill_until_gone
from harness_stream import DataServer
from harness_uid import uid_mode_problem


KILL_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
SURVIVOR_GRACE_SECONDS = 10.0  # for processes left in a killed PID namespace to be gone (a loaded machine)

LINE_LIMIT_BYTES = 4000  # of one output line; the rest of a longer one is read in pieces and dropped

EXPORT_SETTLE = 1.0  # seconds from model.pt2 appearing to stopping the candidate, when stats.json is late


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=KILL_GRACE_SECONDS)
            return
        except subprocess.TimeoutExpired:
            continue


class Watch:
    """What happened to the candidate, as the harness saw it."""

    def __init__(self) -> None:
        self.rc: int | None = None
        self.killed: str | None = None  # why the harness killed it
        self.stopped_at_export = False  # stopped by the harness once its first export after `done` appeared
        self.stopped_when_ready = False  # a warm-up, stopped by the harness at its first request for data
        self.started = self.ended = 0.0
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.namespace: str | None = None
        self.left: list[int] = []  # its processes still alive after it ended (and after killing them)
        self.fitness: dict | None = None  # the sandbox's own report, before the candidate ran (sandbox.FITNESS_BOOT)
        self.who = "the sandbox"  # whom the candidate ran as, for a person


def _lines(stream, limit: int = LINE_LIMIT_BYTES):
    """The lines of a pipe, each cut to `limit` bytes, in bounded memory: a line is read in pieces
    of at most limit bytes (readline(limit)), and the pieces past its first are dropped. A plain
    readline() holds a whole line in the harness's memory however long it is, so output without a
    newline would grow the (root) harness without bound."""
    cut = False
    for raw in iter(lambda: stream.readline(limit), b""):
        if not cut:
            yield raw
        cut = not raw.endswith(b"\n")


def _run_sandboxed(argv: list[str], *, cwd: Path, env: dict[str, str], pass_fds: tuple[int, ...],
                   server: DataServer, budget: float, startup: float, export: float,
                   log: RunLog, limits: sandbox.Limits, info_fd: int | None, info_r: int | None,
                   confine: sandbox.Confinement | None = None, reap: Any = None,
                   export_dir: Path | None = None, fitness: sandbox.Fitness | None = None,
                   stop_when_ready: bool = False, prefix: str = "") -> Watch:
    """Start argv, stream its output, enforce the deadlines; returns when it has exited.

    confine, if given, loads the syscall filter in the child before it execs argv (a child that
    cannot load it exits before argv runs: the candidate never runs unfiltered).

    reap(), if given, runs once the first process has exited and before the rest of its output
    is awaited: a process it left may hold the output pipe open (uid mode kills them there).

    The first export after `done` is the one measured: once model.pt2 appears in export_dir (and
    stats.json, or EXPORT_SETTLE seconds later) the candidate is stopped, so it cannot train on
    read-ahead batches and export again, nor rewrite the file it exported.

    fitness, if given, is the sandbox's own report (sandbox.FITNESS_BOOT): the start-up allowance
    counts from its arrival, when the candidate's code starts; the boot itself has
    sandbox.FITNESS_LIMIT_SECONDS to report.

    stop_when_ready (a warm-up of the compile cache): it is stopped at its first request for data.
    prefix: put before each line of its output in the log (a warm-up's is not the candidate's).
    """
    w = Watch()
    fds = pass_fds + ((info_fd,) if info_fd is not None else ())
    w.started = time.monotonic()

    def child() -> None:
        sandbox.set_limits(limits)
        if confine is not None:
            confine.apply()

    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds,
                                preexec_fn=child)
    except subprocess.SubprocessError as e:  # the filter was refused: nothing of the candidate ran
        raise Outcome("error", "SandboxUnavailable",
                      f"could not start the candidate under its syscall filter ({e})") from e

    def pump() -> None:
        for raw in _lines(proc.stdout):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            w.tail.append(text)
            log.candidate(text, prefix)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if info_r is not None:  # bubblewrap names its first process: its PID namespace is the sandbox's
        os.close(info_fd)
        raw = b""
        while not raw.rstrip().endswith(b"}"):
            part = os.read(info_r, 4096)
            if not part:
                break
            raw += part
        try:
            w.namespace = sandbox.namespace_of(int(json.loads(raw)["child-pid"]))
        except (ValueError, KeyError, TypeError):
            w.namespace = None
    train_limit = budget + budget_slack(budget)
    exported_at = None
    while proc.poll() is None:
        now = time.monotonic()
        booting = fitness is not None and fitness.at is None
        if booting and now - w.started > sandbox.FITNESS_LIMIT_SECONDS:
            _kill(proc)  # no report: the sandbox's fault (see _judge), never a verdict on the candidate
            break
        if stop_when_ready and server.asked is not None:
            w.stopped_when_ready = True
        elif server.asked is None and not booting and now - (fitness.at if fitness else w.started) > startup:
            w.killed = (f"it asked for no training data within the start-up allowance of {startup:g}s "
                        "(compile and warm up take place before the first batch)")
        elif server.first is not None and server.done is None and now - server.first > train_limit:
            w.killed = f"it trained past its budget of {budget:g}s (+{budget_slack(budget):.1f}s slack)"
        elif server.done is not None and now - server.done > export:
            w.killed = f"it ran {export:g}s past the end of training (the export allowance)"
        elif server.done is not None and export_dir is not None:
            if exported_at is None and os.path.lexists(export_dir / "model.pt2"):
                exported_at = now
            if exported_at is not None and (os.path.lexists(export_dir / "stats.json")
                                            or now - exported_at > EXPORT_SETTLE):
                w.stopped_at_export = True
        if w.killed or w.stopped_at_export or w.stopped_when_ready or (
                server.gate is not None and server.gate.abandoned()):
            _kill(proc)
            break
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()
    w.ended = time.monotonic()
    w.rc = 0 if w.stopped_at_export else proc.returncode
    if reap is not None:
        reap()
    reader.join(timeout=5.0)
    if not reader.is_alive():  # else a survivor holds the pipe; closing it would block on the reader
        proc.stdout.close()
    return w


def _harness_env() -> dict[str, str]:
    """The environment for processes the harness starts: nothing of ours, no secrets."""
    keep = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
            "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    return {k: os.environ[k] for k in keep if k in os.environ}


def _memory_limit() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 2**30
    return int(max(4 * 2**30, 0.75 * total))


def _survivors(namespace: str | None) -> list[int]:
    """Processes left in the candidate's PID namespace, killed. None can be left once its init
    exits (the kernel kills them), but one that is killed while it holds gigabytes (a torch
    process) takes a while to give its memory back on a loaded machine: it gets until
    SURVIVOR_GRACE_SECONDS. A zombie has exited (no memory, no files, no code left to run):
    it is not a survivor."""
    return kill_until_gone(lambda: _living(sandbox.survivors(namespace)), SURVIVOR_GRACE_SECONDS)


def _living(pids: list[int]) -> list[int]:
    """pids that are not zombies (state Z in /proc/<pid>/stat; a pid that is gone is dropped)."""
    living = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] != "Z":
            living.append(pid)
    return living


def _last_words(tail: list[str]) -> str:
    lines = [t.strip() for t in tail if t.strip()]
    return lines[-1][:500] if lines else "(no output)"


def sandbox_mode(requested: str) -> str:
    """The sandbox a candidate runs in: "bwrap", "uid", "container" or "none" (see the module
    docstring for what each request picks). Raises Outcome (SandboxUnavailable) for a request
    this machine cannot honour."""
    if requested in ("none", "container"):
        return requested
    if requested == "uid":
        why = uid_mode_problem()
        if why:
            raise Outcome("error", "SandboxUnavailable", f"cannot run the candidate under its own uid: {why}")
        return "uid"
    why = sandbox.available()
    if why is None:
        return "bwrap"
    if requested == "auto":
        return "none"
    if requested == "isolated":
        uid_why = uid_mode_problem()
        if uid_why is None:
            return "uid"
        raise Outcome("error", "SandboxUnavailable",
                      f"refusing to measure: the candidate cannot be isolated here. Bubblewrap: {why}. "
                      f"A uid of its own: {uid_why}")
    raise Outcome("error", "SandboxUnavailable", f"cannot sandbox the candidate: {why}")

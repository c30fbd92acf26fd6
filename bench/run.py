"""Kept as one file: a lab pins the harness as HARNESS_FILES and runs `python -I run.py`; a new
harness file would make every lab pinned before it refuse to run, so its seams are the `# ---`
sections below.

The run harness: the one entry point every backend runs for an experiment.

    python -I bench/run.py --candidate PATH/train.py --result PATH/result.json
                           [--source SRC] [--budget SECONDS] [--startup-allowance SECONDS]
                           [--log PATH] [--termination-log PATH] [--curve PATH]
                           [--num-shards N] [--endpoint URL] [--keep-run-dir]
                           [--sandbox auto|bwrap|uid|isolated|container|none]
                           [--key-fd FD | --key-file PATH] [--run NAME]
                           [--phase all|stage|train|evaluate] [--train-data DIR] [--export-dir DIR]
                           [--compile-cache-from SHA1 [--starting-program PATH]]
                           [--gate FILE [--gate-owner-fd FD]]
                           [--handover FILE] [--handback FILE]

The candidate `train.py` is hostile code that wants a lower number. This file
is trusted, and so is everything it starts except the candidate. In order:

1. Prepares the data (in this process; idempotent, every file's sha256
   checked against the cache's manifest).
2. Runs the candidate in the sandbox (sandbox.py: bubblewrap, its own PID and
   network namespaces, another uid, read-only system, one writable scratch
   directory, resource limits). It sees no data files: the training split is
   streamed to it over a socket by a thread of this process, which is how the
   harness times the run from outside. The clock starts at the candidate's
   first data request (compile and warm up before it) and stops when it says
   training is done (`prepare.export_model` does) or exits. More than
   budget + BUDGET_SLACK of training is `BudgetExceeded`, never clamped. Hard
   deadlines kill it: the start-up allowance before the first batch, the
   export allowance after training. Before any of it, the harness checks
   there is room on disk (MIN_FREE_BYTES), and the sandbox that it can import
   what the benchmark needs (sandbox.FITNESS_BOOT; the allowance counts from
   its report): a machine that fails either is an error, never the
   candidate's crash.
3. When the sandbox's first process exits the kernel kills every process left
   in its PID namespace; the harness checks that none is left before it goes
   on (`ProcessesLeft`).
4. Moves the exported model out of the scratch directory (regular files only)
   and measures val_bpb in a separate evaluator process (`python -I
   evaluate.py`, this directory's own copy) that runs no candidate code and
   refuses archives that would. The metric comes only from there. An
   evaluator that dies before it is ready (before it read anything of the
   export) died of its machine: it is started once more, then it is an error.
5. Writes one result JSON, atomically, always: signed (HMAC-SHA256) when the
   controller passed a key on --key-fd (or --key-file), and the same JSON,
   compact and at most 4 KiB (the reason is cut to fit before signing), to the
   termination log (Kubernetes reads it from the Pod). The informational
   figures are the harness's own: training_seconds, total_seconds,
   total_tokens_M (tokens it served), num_params_M and depth (the exported
   model), mfu_percent (its tokens, clock and the evaluator's FLOPs count,
   over the GPU's peak by name; empty on a CPU) and peak_vram_mb (the
   driver's figure for the candidate's processes, sampled while it runs).
   One the harness cannot measure is the candidate's (its stats.json) and
   is listed in result["self_reported"]: num_steps always, the others only
   where the machine hides them (see "the harness's own figures" below).
   What the candidate said is kept apart in result["reported"], and how the
   harness's figures came about in result["measured"].

The compile cache (`--compile-cache-from SHA1`, phase all). Compiling is most
of a candidate's start-up, and most candidates compile the same graphs as the
lab's starting program. Every run compiles into a cache of its own in its
scratch; a cache shared between candidates would be a place for one to leave
code or trained weights for the next. So only one program's cache is kept:
the lab's starting train.py, whose sha1 the controller passes (its owner's
code, not an agent's). The first run of exactly those bytes that trains by the
rules keeps its cache under `<data cache>/compile-seeds/<profile>/<sha1>/`
(out of every candidate's reach); every later run starts with a copy of it in
its own scratch, which it may change as it likes and which goes with it. A run
of any other bytes never writes there, so what a candidate finds in its cache
is what the starting program compiled, whoever ran before it.

Warming the cache on a fresh machine (`--starting-program PATH`, with
`--compile-cache-from`). A lab resumed on a new host has measured its master
elsewhere, so no run of the starting program happens there again and every
candidate would compile from cold (40-55 s of start-up on an H100 instead of
9-11 s). Given the starting program's bytes, a harness that finds no kept
cache for them first runs them itself: in the sandbox, like any candidate, up
to their first request for training data (the compiling is done by then) and
no further. That warm-up is no measurement: it trains on nothing (its first
request is never answered), writes no result and is not a run of any
experiment. If it reached its first batch by the rules (a fit sandbox, no
process left, the harness files unchanged), its compile cache is kept as a
run of those bytes would keep it; the candidate then starts with a copy, so
even the first run on a fresh machine starts warm. The trust rules stay as
they are: the harness runs only bytes whose sha1 is the one the controller
named (it checks PATH's bytes), and it alone copies the warm-up's cache, once
every process of it is gone. A warm-up that fails keeps nothing and costs the
candidate nothing but its time (it compiles from cold, as before). Two runs
that start together on a fresh machine may both warm up; the first to finish
keeps its cache. A warm-up that compiled nothing (bench/train.py compiles on
CUDA only) keeps an empty entry, so that a CPU machine warms up once, not
before every run.

Why in the harness rather than as a run of its own: a separate warm-up would
be one more process the controller must start, adopt after a restart and wait
for, on every backend, with a result some ledger could take for a measurement;
here it is one step of the trusted program that already decides who may write
the kept cache.

Starting up during the previous run's evaluation (`--handover FILE`, `--gate
FILE`, phase all). `--handover` is written once the candidate is gone and the
evaluator holds all the GPU memory its evaluation will use (evaluate.py
--tell-peak: two batches scored; at once without a GPU). From then on the
controller may start the GPU's next run beside it with `--gate`: that run
imports, compiles and warms up, and its first request for data is answered
only once the gate file is gone (the controller removes it when it submits
that run, after this one's verdict). The wait is timed as `gpu_wait_seconds`,
not as start-up. A run waiting at its gate is never left behind: with
`--gate-owner-fd FD` (the read end of a pipe whose write end only the
controller holds) it gives up as soon as the controller is gone (the pipe
reads end of file: a kill -9, a crash, a library user that never closed its
lab) while its gate is still closed, and in any case after GATE_LIMIT_SECONDS
at the gate; either is an error (`HarnessError`: nothing was measured, the
candidate may run again), never the candidate's crash. An evaluation that
runs out of time after the handover may
have been slowed by the newcomer, so it is not yet the candidate's failure:
with `--handback FILE` the harness withdraws the handover (removes that file),
writes FILE, and waits for the controller to stop the newcomer and remove
FILE; then it measures the export once more, in a fresh evaluator, alone on
the GPU, with the whole time limit. Running out of time again is the
candidate's failure (`EvaluationFailed`, status failed, so the lab never runs
it again). Without `--handback`, or if nobody removes FILE within
HANDBACK_WAIT_SECONDS, nothing was measured: an error, and the candidate may
be run again.

The evaluation's time limit is the profile's `eval_timeout`, or `--eval-limit
SECONDS` where the controller asks for less: it bounds a candidate by the
master's own evaluation time (a few times it), so a model that is legal but
slow to score cannot hold a GPU for the profile's whole limit.

Sandboxes (`--sandbox`):

- `bwrap` (the default): bubblewrap as above; refuses to run without it.
- `uid`: for a container where the harness is root but namespaces cannot be
  made (a Hugging Face job). The candidate runs as the dedicated uid
  `sandbox.SANDBOX_UID` through `setpriv` (no capabilities, no-new-privs,
  no supplementary groups), in a scratch directory it owns under /tmp, with
  the same resource limits and the same data stream. Before it starts, a probe
  process running as that uid must fail to read the harness, the data cache
  and the validation split (root-owned, 0700/0600) and must be able to write
  its scratch directory; otherwise the run is refused (`SandboxUnavailable`).
  It imports its own copy of prepare.py. When it exits, every process of that
  uid is killed: kill(-1, SIGKILL) sent by a process running as that uid, then
  a /proc scan (`ProcessesLeft` if any survives). No process of the uid may
  exist before the run starts.
- `isolated`: bwrap where it works, else uid mode when running as root, else
  a refusal (an error result saying why). The Hugging Face entry point uses it.
- `container`: the candidate runs as a plain child and the caller's container
  is the boundary (the train container of a Kubernetes Pod).
- `none`: a plain child, no boundary (`--unsafe-no-sandbox`); the result says so.
- `auto`: bwrap where it works, else none.

Phases (`--phase`), so that a Kubernetes Pod can train in one container and
evaluate in another, with no candidate process surviving into evaluation:

- `all` (the default): everything above, in this process.
- `stage`: prepare the data (the cache must be writable) and copy only what
  the train phase needs, train.bin and its record (data.json), into
  `--train-data` (never val.bin).
- `train`: run the candidate on the staged training data (streamed over the
  socket, timed as above) with `--export-dir DIR/scratch` as its scratch
  directory, judge what happened, and write the record `DIR/record.json`
  (the outcome and the timing). No key, no result. Exits 0 once the record is
  written, whatever the candidate did.
- `evaluate`: read the record and the export from `--export-dir` (regular
  files only), measure val_bpb with `python -I evaluate.py` on the prepared
  data (which may be read-only), and write the signed result and the
  termination message. The result carries `limits.train_phase_seconds`, the
  longest the train phase may take (start-up allowance + budget + slack +
  export allowance + TRAIN_PHASE_OVERHEAD), so that a controller that sees how
  long the train container ran (its clock is not in the candidate's reach)
  can hold it to the budget. When the train phase ran without a sandbox of
  its own (`container`, `none`) its record is in the candidate's reach: its
  failures are believed (they only hurt the candidate), its figures are
  listed as self-reported.

Exit codes: EXIT_SUCCEEDED (0); EXIT_CANDIDATE_FAILED (3: the candidate
crashed, ran out of time, diverged, exported nothing or an unusable model;
retrying will not help); EXIT_HARNESS_ERROR (4: data, cache, sandbox or
machine problem; retryable). argparse usage errors exit 2 before anything runs.
The stage phase exits 0 or 4, the train phase 0 once its record is written.

No torch here: the harness process stays small and starts fast.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import hmac
import json
import math
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import prepare  # noqa: E402  (the trusted one, next to this file)
import sandbox  # noqa: E402

EXIT_SUCCEEDED = 0
EXIT_CANDIDATE_FAILED = 3
EXIT_HARNESS_ERROR = 4
EXIT_CODES = {"succeeded": EXIT_SUCCEEDED, "failed": EXIT_CANDIDATE_FAILED, "error": EXIT_HARNESS_ERROR}

RESULT_VERSION = 2
METRIC_KEYS = (
    "val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
    "total_tokens_M", "num_steps", "num_params_M", "depth",
)
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_LIMIT = 4096  # bytes Kubernetes keeps of a termination message
HARNESS_FILES = ("prepare.py", "run.py", "evaluate.py", "sandbox.py")
KILL_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
SURVIVOR_GRACE_SECONDS = 10.0  # for processes left in a killed PID namespace to be gone (a loaded machine)
RESULT_MARKER = "AUTOLAB_RESULT"  # the harness's last stdout line: marker + compact result JSON
LOG_LIMIT_BYTES = 16 * 2**20  # candidate output kept in the log; the rest is counted, not written
LINE_LIMIT_BYTES = 4000  # of one output line; the rest of a longer one is read in pieces and dropped
CURVE_LIMIT_BYTES = 2**20  # the step curve read back from the scratch directory
EXPORT_LIMIT_BYTES = 8 * 2**30  # model.pt2
STATS_LIMIT_BYTES = 2**16  # stats.json
RECORD_LIMIT_BYTES = 2**16  # the train phase's record, the staged data's record
KEY_LIMIT_BYTES = 256

PHASES = ("all", "stage", "train", "evaluate")
# --gate: a run started while the run before it on the same GPU is evaluated waits at its first
# batch until the controller removes the gate file (that run's verdict is in). How often the gate
# is looked at, and how long a candidate may wait there before the run is given up.
GATE_POLL_SECONDS = 0.05
GATE_LIMIT_SECONDS = 1800.0
# --handback: how long an evaluation that ran out of time beside the next run's start-up waits for
# the controller to stop that run (it removes the handback file) before giving up: the local
# controller looks at its running runs about once a second.
HANDBACK_WAIT_SECONDS = 60.0
EXPORT_SETTLE = 1.0  # seconds from model.pt2 appearing to stopping the candidate, when stats.json is late
# Largest file a candidate may write (RLIMIT_FSIZE): its exported model and compile caches fit with room
# (the default profile's model.pt2 is ~0.2 GiB, the tiny one's ~2 MiB).
MAX_FILE_BYTES = {"tiny": 256 * 2**20, "default": 4 * 2**30}
# Free space a run needs where its scratch and its evaluator's directory are, checked before the
# candidate starts: its export, compile cache and their copies. Less is the machine's fault (an
# error), not a candidate that crashed writing its model.
MIN_FREE_BYTES = {"tiny": 64 * 2**20, "default": 2 * 2**30}
# The compile cache of the lab's starting program (its owner's train.py, not an agent's): kept
# under <data cache>/COMPILE_SEEDS/<profile>/<sha1>/{compile,triton} by the first run of exactly
# those bytes (or by the harness's warm-up of them, --starting-program), and copied into every run's
# scratch before its candidate starts. Only a run of those bytes ever writes there, so no candidate
# can leave anything in it for another run; each candidate gets a copy of its own. An empty entry: a
# warm-up that compiled nothing (a CPU machine), so no later run warms up again. Bounded: a cache
# larger than this is neither kept nor copied.
COMPILE_SEEDS = "compile-seeds"
CACHE_DIRS = ("compile", "triton")  # $TORCHINDUCTOR_CACHE_DIR and $TRITON_CACHE_DIR in the scratch
SEED_CACHE_LIMIT_BYTES = {"tiny": 64 * 2**20, "default": 2 * 2**30}
SEED_CACHE_MAX_FILES = 20_000
# --starting-program: the largest train.py the warm-up reads (as for a candidate).
PROGRAM_LIMIT_BYTES = 2**22
SANDBOX_MODES = ("auto", "bwrap", "uid", "isolated", "container", "none")
UNSANDBOXED = ("container", "none")  # the candidate runs as the harness's own user
STAGED_RECORD = "data.json"  # in --train-data, next to train.bin
TRAIN_RECORD = "record.json"  # in --export-dir, next to the candidate's scratch/
# Seconds of a train phase beyond the candidate's allowances: the harness's own start and
# finish, and the one-second resolution of the timestamps a Pod's status gives.
TRAIN_PHASE_OVERHEAD = 30.0
# The evaluator starts before the candidate where it has cores of its own: on a GPU machine its
# torch import and CUDA set-up then overlap the candidate's start-up (4-8 s off every run on an
# H200). A CPU run would make it compete with the candidate for the same cores (and the tests'
# runs for two of them): there it starts once training is over. "1"/"0" in the harness's
# environment says which, whatever the machine.
EARLY_EVALUATOR_ENV = "AUTOLAB_EARLY_EVALUATOR"
UID_ENV = "AUTOLAB_SANDBOX_UID"  # uid mode's uid, if not sandbox.SANDBOX_UID (tests pick their own)
UID_SCRATCH_ROOT = "/tmp"  # uid mode's scratch directories: a place every uid can traverse


def budget_slack(budget: float) -> float:
    """Training time past the budget that is still on time: the last step may overrun it."""
    return 1.0 + 0.01 * budget


def train_phase_limit(budget: float, startup: float, export: float) -> float:
    """The longest a train phase may run, start to end: what a Pod's status is held to."""
    return startup + budget + budget_slack(budget) + export + TRAIN_PHASE_OVERHEAD


class RunLog:
    """Lines to stdout and, if given, appended to a log file; candidate output is capped."""

    def __init__(self, path: str | os.PathLike | None, echo: bool = True) -> None:
        self.echo = echo
        self.file = None
        self.lock = threading.Lock()
        self.candidate_bytes = 0
        self.dropped = 0
        if path:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "a", encoding="utf-8", errors="replace")
            except OSError as e:
                self.harness(f"cannot write the log {path} ({e}); logging to stdout only")

    def line(self, text: str) -> None:
        with self.lock:
            if self.echo:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
            if self.file:
                self.file.write(text + "\n")
                self.file.flush()

    def candidate(self, text: str, prefix: str = "") -> None:
        """A line the candidate (or the evaluator) printed, within LOG_LIMIT_BYTES in all."""
        self.candidate_bytes += len(text) + 1
        if self.candidate_bytes > LOG_LIMIT_BYTES:
            self.dropped += 1
            return
        # Nothing the candidate prints can look like the harness's own lines.
        if text.startswith((RESULT_MARKER, "[bench]")):
            text = "(candidate) " + text
        self.line(prefix + text)

    def harness(self, text: str) -> None:
        self.line(f"[bench] {text}")

    def close(self) -> None:
        if self.file:
            self.file.close()


class Outcome(Exception):
    """Ends a run early with a status, a reason code and a reason for a person."""

    def __init__(self, status: str, code: str, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason, self.exit_code = status, code, reason, exit_code


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the training stream: data in, time measured ---------------------------------------------


class Gate:
    """--gate FILE: the first batch waits while FILE exists; --gate-owner-fd FD: the controller that
    made the gate, alive while the pipe FD reads nothing (it never writes; end of file = gone)."""

    def __init__(self, path: Path, owner_fd: int | None = None) -> None:
        self.path = path
        self.given_up: str | None = None  # why the run stopped waiting (an error, not the candidate's)
        self.owner_gone = threading.Event()
        if owner_fd is not None:
            def watch() -> None:
                with contextlib.suppress(OSError):
                    while os.read(owner_fd, 1):
                        pass
                self.owner_gone.set()
            threading.Thread(target=watch, daemon=True, name="gate-owner").start()

    def closed(self) -> bool:
        return os.path.lexists(self.path)

    def abandoned(self) -> str | None:
        """Why this run gives up waiting, if it does: its controller is gone while the gate is closed."""
        if self.given_up is None and self.owner_gone.is_set() and self.closed():
            self.given_up = ("the controller that started this run ahead of its turn is gone, and nobody will "
                             "open its gate; nothing was measured (the next `autolab run` starts it again)")
        return self.given_up


class DataServer:
    """Streams the training split to the candidate over a socket and notes the time.

    The candidate asks for n tokens at a time (prepare.make_loader); it gets the
    next n of a sequential pass over train.bin from a seeded offset, wrapping at
    the end. The first request starts the harness's clock; a "done" request (or
    the end of the connection) stops it, and nothing more is served. With a gate
    (a run started up beside the one before it, see --gate), the first request
    is answered only once the gate file is gone: the clock starts then.
    """

    def __init__(self, tokens, conn: socket.socket, seed: int, gate: Gate | None = None,
                 hold: bool = False) -> None:
        self.tokens, self.conn = tokens, conn
        self.pos = seed % max(1, len(tokens))
        self.gate = gate  # while this file exists the first batch waits (the GPU is not ours yet)
        self.hold = hold  # a warm-up: its first request is noted and never answered (no data served)
        self.asked: float | None = None  # the first request came (the candidate is ready)
        self.first: float | None = None
        self.first_wall: float | None = None  # the same moment on the wall clock (other runs' timelines)
        self.done: float | None = None
        self.served = 0
        self.thread = threading.Thread(target=self._serve, daemon=True, name="data-server")

    def _recv(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            part = self.conn.recv(n - len(buf))
            if not part:
                return None
            buf += part
        return buf

    def _next(self, n: int) -> bytes:
        parts = []
        while n:
            if self.pos >= len(self.tokens):
                self.pos = 0
            take = min(n, len(self.tokens) - self.pos)
            parts.append(self.tokens[self.pos:self.pos + take].tobytes())
            self.pos += take
            n -= take
        return b"".join(parts)

    def _serve(self) -> None:
        size = struct.calcsize(prepare.STREAM_REQUEST)
        try:
            while True:
                req = self._recv(size)
                if req is None:
                    break
                op, n = struct.unpack(prepare.STREAM_REQUEST, req)
                if op == prepare.STREAM_DONE or op != prepare.STREAM_READ:
                    break
                if self.first is None:
                    self.asked = time.monotonic()
                    if self.hold:  # no answer, and no end of stream it could mistake for one
                        self.conn.recv(1)  # until it is stopped and its end closed
                        break
                    while self.gate is not None and self.gate.closed():
                        if time.monotonic() - self.asked > GATE_LIMIT_SECONDS:
                            self.gate.given_up = (f"the GPU was not handed over within {GATE_LIMIT_SECONDS:g}s "
                                                  "of waiting at the gate; nothing was measured")
                        if self.gate.abandoned():
                            raise OSError(self.gate.given_up)
                        time.sleep(GATE_POLL_SECONDS)
                    self.first = time.monotonic()
                    self.first_wall = time.time()
                n = min(n, prepare.STREAM_MAX_TOKENS)
                self.conn.sendall(self._next(n))
                self.served += n
        except OSError:
            pass
        finally:
            if self.done is None:
                self.done = time.monotonic()
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def start(self) -> "DataServer":
        self.thread.start()
        return self


# --- the candidate in its sandbox --------------------------------------------------------------


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


# --- files the candidate could have touched: regular files only, never through a link ---------


def _open_regular(path: str | os.PathLike, limit: int, base: Path | None = None,
                  follow: bool = False) -> int | None:
    """A read-only fd of path if it is a regular file of at most limit bytes, else None.

    With base, path is relative to it and no component may be a symbolic link (the candidate
    may have replaced a directory of its scratch with one); without, the last component may
    not be one unless `follow` (paths the controller gave: a Kubernetes ConfigMap or Secret
    volume's files are links). FIFOs and devices are refused without blocking on them.
    """
    leaf_flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow and base is None else os.O_NOFOLLOW)
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = None
    try:
        if base is None:
            fd = os.open(path, leaf_flags)
        else:
            parts = Path(path).parts
            if not parts or Path(path).is_absolute() or ".." in parts:
                return None
            dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            for part in parts[:-1]:
                nxt = os.open(part, dir_flags, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = nxt
            fd = os.open(parts[-1], leaf_flags, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        return None
    return fd


def _regular_file(path: str | os.PathLike, limit: int, base: Path | None = None,
                  follow: bool = False) -> bytes | None:
    """The bytes of path if it is a regular file (no symlink) of at most limit bytes."""
    fd = _open_regular(path, limit, base, follow)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)[:limit]


def _copy_regular(src: str | os.PathLike, dst: Path, limit: int, base: Path | None = None) -> bool:
    """Copy src (a regular file, not a link, at most limit bytes) to dst; False if it is not one."""
    fd = _open_regular(src, limit, base)
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f, open(dst, "wb") as out:
        copied = 0
        while copied <= limit:
            chunk = f.read(2**22)
            if not chunk:
                break
            out.write(chunk)
            copied += len(chunk)
    return copied <= limit


def _curve(raw: bytes | None) -> list[dict]:
    """The candidate's step curve, kept only as well-formed numbers (it is informational)."""
    lines = []
    for text in (raw or b"").decode("utf-8", errors="replace").splitlines():
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            continue
        if isinstance(d, dict) and all(_number(d.get(k)) is not None for k in ("step", "loss", "tokens_per_sec")):
            lines.append({k: d[k] for k in ("step", "loss", "tokens_per_sec", "time")
                          if k in d and _number(d[k]) is not None})
    return lines


def _json_object(raw: bytes | None) -> dict:
    """A JSON object the candidate may have written, else {}: never raises (json.loads raises
    RecursionError, not ValueError, for arrays nested thousands deep)."""
    try:
        obj = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _number(value: Any) -> float | None:
    """value if it is a finite number (an int too large for a float is not: math.isfinite
    raises OverflowError on one, and the candidate writes the numbers this reads)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:
        return None


# --- the harness's own figures: MFU and GPU memory --------------------------------------------
#
# What the candidate says of itself (its stats.json) is kept as it said it (result["reported"]),
# never as a measurement. The harness measures what it can from outside the candidate's reach:
#
# - MFU = tokens served x FLOPs per token / training seconds / the GPU's bf16 peak. The tokens
#   are the ones the data server streamed (the loader's read-ahead of a few batches included:
#   +0.3 % over the default 300 s), the seconds its own clock, the FLOPs per token the evaluator's count
#   on the exported graph (evaluate.model_figures: train.py's formula), the peak the table below
#   looked up by the name CUDA gives the evaluator's GPU. On a CPU, or a GPU not in the table,
#   there is no peak and no MFU: empty, never the candidate's figure.
# - Peak GPU memory: the driver's per-process figure (NVML, else `nvidia-smi`) for the
#   candidate's processes, summed per reading, the largest of the readings taken every
#   GPU_SAMPLE_SECONDS while it runs. It is what the process holds (CUDA context and the caching
#   allocator's reserve included), more than torch.cuda.max_memory_allocated(), which train.py
#   reports. The candidate's processes are this process's descendants outside the evaluator's
#   (and, in uid mode, every process of the sandbox's uid).
# - Depth and parameter count: from the exported model (the evaluator).
#
# Where the harness cannot measure a figure it keeps the candidate's and lists it in
# result["self_reported"]: the number of optimiser steps always, GPU memory where the driver
# could not be read or shows no process of the candidate's (a container that hides host PIDs),
# depth where the graph calls no scaled_dot_product_attention.

# Dense bf16 tensor-core peak FLOP/s (NVIDIA datasheets, without sparsity), matched against the
# GPU's name, longest key first. The harness's own copy: the one in train.py is the candidate's.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989.5e12,  # SXM
    "H200": 989.5e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "L4": 121e12,
}
ALWAYS_SELF_REPORTED = ("num_steps",)  # the harness sees no optimiser step
GPU_SAMPLE_SECONDS = 0.5  # between two readings of the driver's per-process GPU memory
NVIDIA_SMI_TIMEOUT = 10.0


def peak_flops(device_name: str | None) -> float | None:
    """The bf16 peak of a GPU by its name (None: a CPU, or a GPU the table does not know)."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def harness_mfu(tokens: int, training: float, flops_per_token: Any, device_name: Any) -> float | None:
    """MFU in percent from the harness's own figures; None where one is missing."""
    peak = peak_flops(device_name if isinstance(device_name, str) else None)
    fpt = _number(flops_per_token)
    if not (peak and fpt and training > 0):
        return None
    return round(100 * tokens * fpt / training / peak, 2)


def _nvml_reader():
    """A function giving {pid: bytes of GPU memory} over every GPU, through NVML; None without it."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # not installed, no driver, no device
        return None

    def read() -> dict[int, int]:
        used: dict[int, int] = {}
        for handle in handles:
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if isinstance(proc.usedGpuMemory, int):  # None: not available to this caller
                    used[proc.pid] = used.get(proc.pid, 0) + proc.usedGpuMemory
        return used

    return read


def _nvidia_smi_reader():
    """The same through `nvidia-smi --query-compute-apps` (MiB); None if there is none."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None

    def read() -> dict[int, int]:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise OSError(f"nvidia-smi exited with {out.returncode}")
        used: dict[int, int] = {}
        for line in out.stdout.splitlines():
            pid, _, mib = (part.strip() for part in line.partition(","))
            try:
                used[int(pid)] = used.get(int(pid), 0) + int(float(mib) * 2**20)
            except ValueError:  # "[N/A]": not available to this caller
                continue
        return used

    return read


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])  # the name may hold ") "
    except (OSError, ValueError, IndexError):
        return None


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class GpuMemory:
    """The most GPU memory the candidate's processes held at one reading, read from the driver.

    Started before the candidate and stopped once it is gone; each reading lists the GPU's
    processes and sums those of the candidate's: this process's descendants, but none under an
    excluded process (the evaluator, which may get ready on the GPU meanwhile), and in uid mode
    any process of the sandbox's uid (one that left the tree). `stop()` gives
    {"peak_mb", "how", "samples"}: peak_mb None where the driver could not be read or never
    listed a process of the candidate's.
    """

    def __init__(self, exclude: tuple[int, ...] = (), uid: int | None = None,
                 interval: float = GPU_SAMPLE_SECONDS) -> None:
        self.root = os.getpid()
        self.exclude = set(exclude)
        self.uid = uid
        self.interval = interval
        self.how: str | None = None
        self.samples = 0
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-memory")

    def start(self) -> "GpuMemory":
        self._thread.start()
        return self

    def _run(self) -> None:
        for how, make in (("nvml", _nvml_reader), ("nvidia-smi", _nvidia_smi_reader)):
            read = make()
            if read is not None:
                self.how = how
                break
        else:
            return
        while True:
            try:
                used = read()
            except Exception:  # a reading that failed is a reading not taken
                used = None
            if used is not None:
                self.samples += 1
                mine = [b for pid, b in used.items() if self._candidates(pid)]
                if mine:
                    self.peak = max(self.peak or 0, sum(mine))
            if self._stop.wait(self.interval):
                return

    def _candidates(self, pid: int) -> bool:
        if self.uid is not None and _owner(pid) == self.uid:
            return True
        for _ in range(64):  # up the tree to this process
            if pid in self.exclude or pid == self.root:
                return False
            parent = _parent(pid)
            if parent is None:
                return False
            if parent == self.root:
                return True
            pid = parent
        return False

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=NVIDIA_SMI_TIMEOUT + 5)
        peak = round(self.peak / 2**20, 1) if self.peak is not None else None
        return {"peak_mb": peak, "how": self.how, "samples": self.samples}


def _metrics(stats: dict[str, Any], evaluation: dict[str, Any], *, training: float, total: float,
             tokens: int, gpu: dict[str, Any] | None, had_gpu: bool) -> tuple[dict, list[str]]:
    """The result's metrics, and those of them that are the candidate's word (see above)."""
    reported = {k: _number(stats.get(k)) for k in METRIC_KEYS}
    metrics: dict[str, Any] = dict.fromkeys(METRIC_KEYS)
    metrics.update(val_bpb=evaluation["val_bpb"], training_seconds=round(training, 2),
                   total_seconds=round(total, 1), total_tokens_M=round(tokens / 1e6, 3),
                   num_params_M=round(evaluation["num_params"] / 1e6, 3),
                   mfu_percent=harness_mfu(tokens, training, evaluation.get("flops_per_token"),
                                           evaluation.get("device_name")),
                   peak_vram_mb=(gpu or {}).get("peak_mb"),
                   depth=evaluation.get("depth") if isinstance(evaluation.get("depth"), int) else None)
    own = []
    for key in ("peak_vram_mb", "num_steps", "depth"):
        if metrics[key] is None and reported[key] is not None and (key != "peak_vram_mb" or had_gpu):
            metrics[key] = reported[key]  # no GPU, no GPU memory: not the candidate's figure either
            own.append(key)
    if metrics["peak_vram_mb"] is not None:
        metrics["peak_vram_mb"] = round(metrics["peak_vram_mb"], 1)
    for key in ("num_steps", "depth"):
        if metrics[key] is not None:
            metrics[key] = int(metrics[key])
    return metrics, own


def _reported(stats: dict[str, Any]) -> dict[str, Any]:
    """What the candidate's stats.json says of the summary figures, as it said it (finite numbers)."""
    return {k: stats[k] for k in METRIC_KEYS if k != "val_bpb" and _number(stats.get(k)) is not None}


def figures_line(result: dict[str, Any]) -> str:
    """One log line: how the harness's MFU and GPU memory came about, next to the candidate's word."""
    metrics, measured = result.get("metrics") or {}, result.get("measured") or {}
    reported = result.get("reported") or {}
    fpt, peak = measured.get("flops_per_token"), measured.get("peak_flops")
    if metrics.get("mfu_percent") is not None:
        mfu = (f"MFU {metrics['mfu_percent']:.2f}% ({fpt / 1e6:.1f} MFLOP/token x "
               f"{metrics['total_tokens_M']:.1f}M tokens served / {metrics['training_seconds']:.1f}s / "
               f"{peak / 1e12:g} TFLOP/s, {measured.get('device_name')})")
    else:
        mfu = f"MFU not measured (no bf16 peak known for {measured.get('device_name') or 'a CPU'})"
    own = set(result.get("self_reported") or ())
    vram = metrics.get("peak_vram_mb")
    memory = ("peak GPU memory not measured" if vram is None else
              f"peak GPU memory {vram:.1f} MiB " + ("(the candidate's figure: the driver showed none of its "
                                                     "processes)" if "peak_vram_mb" in own else
                                                     f"({measured.get('gpu_memory')}, "
                                                     f"{measured.get('gpu_memory_samples')} readings)"))
    said = ", ".join(f"{k} {reported[k]}" for k in ("mfu_percent", "peak_vram_mb") if k in reported)
    return f"measured: {mfu}; {memory}" + (f"; the candidate says {said}" if said else "")


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


# --- uid mode: another uid, no namespaces ------------------------------------------------------


def sandbox_uid() -> int:
    """The uid (and gid) uid mode runs the candidate as."""
    value = os.environ.get(UID_ENV)
    uid = int(value) if value and value.isdigit() else sandbox.SANDBOX_UID
    return uid if uid > 0 else sandbox.SANDBOX_UID


def uid_mode_problem() -> str | None:
    """None if uid mode can work here, else why not."""
    if os.geteuid() != 0:
        return "the harness does not run as root, so it cannot run the candidate under another uid"
    if not (shutil.which("setpriv") or os.path.exists("/usr/bin/setpriv")):
        return "setpriv (util-linux) is not installed"
    return None


def _as_uid(uid: int, argv: list[str]) -> list[str]:
    """argv run as uid/gid `uid`: no supplementary groups, no capabilities, no-new-privs."""
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", *argv]


def uid_processes(uid: int) -> list[int]:
    """Pids of the living processes (zombies aside) with uid among their real, effective, saved
    or filesystem uids."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith(("Z", "X")):
            continue
        if str(uid) in fields.get("Uid", "").split():
            found.append(int(entry))
    return found


_PROBE = """
import json, os, sys
hidden, scratch = json.loads(sys.argv[1]), sys.argv[2]
out = {"readable": [], "scratch": False}
for p in hidden:
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_NONBLOCK))
        out["readable"].append(p)
    except OSError:
        pass
try:
    t = os.path.join(scratch, ".autolab-probe")
    os.close(os.open(t, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(t)
    out["scratch"] = True
except OSError:
    pass
print(json.dumps(out))
"""


def _uid_preflight(uid: int, scratch: Path, hidden: list[Path]) -> None:
    """Refuse (SandboxUnavailable) unless uid can run Python, write its scratch directory and
    read none of `hidden`; and unless no process of uid is alive already."""
    already = uid_processes(uid)
    if already:
        raise Outcome("error", "SandboxUnavailable",
                      f"{len(already)} process(es) of uid {uid} are running already (another run, or "
                      "something left over); uid mode kills every process of its uid, so it will not start")
    paths = []
    for p in hidden:
        for q in (str(p), os.path.realpath(p)):
            if q not in paths and os.path.exists(q):
                paths.append(q)
    try:
        done = subprocess.run(_as_uid(uid, [sys.executable, "-I", "-S", "-c", _PROBE, json.dumps(paths),
                                            str(scratch)]),
                              cwd=scratch, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise Outcome("error", "SandboxUnavailable", f"cannot start a process as uid {uid}: {e}") from e
    try:
        probe = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise Outcome("error", "SandboxUnavailable",
                      f"uid {uid} cannot run the Python interpreter {sys.executable} "
                      f"({why[-1] if why else f'exit code {done.returncode}'}); the Python installation "
                      "must be readable by every user") from None
    if probe.get("readable"):
        raise Outcome("error", "SandboxUnavailable",
                      f"uid {uid} could read {', '.join(probe['readable'])}: the harness, the data cache and the "
                      "validation split must not be readable by the candidate (root-owned, mode 0700/0600)")
    if not probe.get("scratch"):
        raise Outcome("error", "SandboxUnavailable", f"uid {uid} cannot write its scratch directory {scratch}")


def _uid_workspace(run_dir: Path, scratch: Path, uid: int) -> Path:
    """Make run_dir traversable (not listable), scratch the uid's own; return the directory of
    the candidate's own copy of prepare.py (the module train.py imports)."""
    os.chmod(run_dir, 0o711)
    lib = run_dir / "lib"
    lib.mkdir(exist_ok=True)
    shutil.copyfile(BENCH_DIR / "prepare.py", lib / "prepare.py")
    os.chmod(lib / "prepare.py", 0o644)
    os.chmod(lib, 0o755)
    for sub in ("export", "tmp"):
        (scratch / sub).mkdir(exist_ok=True)
    for p in (scratch, scratch / "export", scratch / "tmp", *scratch.glob("*.py")):
        os.chown(p, uid, uid)
    os.chmod(scratch, 0o700)
    return lib


def sweep_uid(uid: int) -> tuple[int, list[int]]:
    """Kill every process of uid: kill(-1, SIGKILL) from a process running as uid (the kernel
    signals them all at once, forks included), then SIGKILL to whatever a /proc scan still
    finds. Returns (how many there were, the pids still alive after all that)."""
    before = uid_processes(uid)
    pid = os.fork()
    if pid == 0:  # as uid: kill(-1) reaches exactly the processes of this uid, not this one
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 2.0
    left = uid_processes(uid)
    while left and time.monotonic() < deadline:
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
        left = uid_processes(uid)
    return len(before), left


# --- the compile cache of the lab's starting program --------------------------------------------


class _TooBig(Exception):
    pass


def _copy_tree(src: Path, dst: Path, limit: int, max_files: int) -> tuple[int, int]:
    """Copy the directories and regular files under src into dst, never through a link (links,
    FIFOs and devices are left out); (files, bytes). _TooBig past max_files files or limit bytes."""
    files = size = 0

    def walk(src_fd: int, to: Path, depth: int) -> None:
        nonlocal files, size
        to.mkdir(mode=0o700, exist_ok=True)
        with os.scandir(src_fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it]
        for name, is_dir, is_file in entries:
            if is_dir and depth < 32:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
                try:
                    walk(fd, to / name, depth + 1)
                finally:
                    os.close(fd)
            elif is_file:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    files, size = files + 1, size + st.st_size
                    if files > max_files or size > limit:
                        raise _TooBig(f"more than {max_files} files or {limit} bytes")
                    with open(to / name, "wb") as out:
                        shutil.copyfileobj(f, out, 2**22)
                    os.chmod(to / name, stat.S_IMODE(st.st_mode) & 0o755 | 0o600)

    top = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        walk(top, dst, 0)
    finally:
        os.close(top)
    return files, size


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for root, dirs, names in os.walk(path):
        for n in dirs + names:
            os.chown(os.path.join(root, n), uid, uid, follow_symlinks=False)


def seed_cache_entry(sha1: str) -> Path:
    """Where the compile cache of the program with this sha1 is kept (see COMPILE_SEEDS)."""
    return prepare.cache_root() / COMPILE_SEEDS / prepare.PROFILE / sha1


def _seed_compile_cache(sha1: str | None, scratch: Path, log: RunLog, result: dict[str, Any]) -> None:
    """Copy the kept compile cache of the lab's starting program (if any) into the scratch."""
    if not sha1:
        return
    entry = seed_cache_entry(sha1)
    info: dict[str, Any] = result.setdefault("compile_cache", {})  # a warm-up may have said how it went
    info.update(program=sha1[:12], seeded=False, kept=False)
    if not entry.is_dir():
        log.harness(f"no compile cache of the starting program {sha1[:12]} yet: the candidate compiles from cold")
        return
    began = time.monotonic()
    files = size = 0
    try:
        for name in CACHE_DIRS:
            if (entry / name).is_dir():
                n, b = _copy_tree(entry / name, scratch / name, SEED_CACHE_LIMIT_BYTES.get(prepare.PROFILE, 2**30),
                                  SEED_CACHE_MAX_FILES)
                files, size = files + n, size + b
    except (OSError, _TooBig) as e:  # a cold compile, not a failed run
        for name in CACHE_DIRS:
            shutil.rmtree(scratch / name, ignore_errors=True)
        log.harness(f"the compile cache of {sha1[:12]} could not be copied ({e}): the candidate compiles from cold")
        return
    if not files:  # kept by a warm-up that compiled nothing (see _warm_compile_cache)
        log.harness(f"the starting program {sha1[:12]} compiled nothing here: there is no cache to start from")
        return
    info.update(seeded=True, files=files, bytes=size, seconds=round(time.monotonic() - began, 2))
    log.harness(f"the candidate starts with a copy of the compile cache of the starting program {sha1[:12]} "
                f"({files} files, {size / 2**20:.1f} MiB, {info['seconds']:.2f}s)")


def _keep_compile_cache(sha1: str | None, scratch: Path, log: RunLog, result: dict[str, Any]) -> None:
    """After a run of exactly the starting program's bytes: keep its compile cache for later runs
    (once; the first run to finish wins)."""
    if not sha1 or result.get("candidate_sha1") != sha1:
        return
    entry = seed_cache_entry(sha1)
    if entry.exists() or not any((scratch / n).is_dir() for n in CACHE_DIRS):
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha1[:12]}-", dir=entry.parent))
    try:
        files = size = 0
        for name in CACHE_DIRS:
            if (scratch / name).is_dir():
                n, b = _copy_tree(scratch / name, tmp / name, SEED_CACHE_LIMIT_BYTES.get(prepare.PROFILE, 2**30),
                                  SEED_CACHE_MAX_FILES)
                files, size = files + n, size + b
        os.rename(tmp, entry)
    except (OSError, _TooBig) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.exists():
            log.harness(f"the compile cache of the starting program was not kept ({e})")
        return
    result.setdefault("compile_cache", {})["kept"] = True
    log.harness(f"kept the compile cache of the starting program {sha1[:12]} for later runs "
                f"({files} files, {size / 2**20:.1f} MiB)")


def _warm_up_problem(w: Watch, server: DataServer, *, mode: str, harness_hashes: dict[str, str]) -> str | None:
    """Why a warm-up's compile cache is not to be kept (None: it is): the checks _judge makes of a
    run, but for reaching the first batch instead of training."""
    if not (w.fitness or {}).get("fit"):
        return sandbox.unfit_reason(w.fitness, w.who, _last_words(list(w.tail)))
    if mode == "bwrap" and not w.namespace:
        return "the sandbox did not report its PID namespace"
    if w.left:
        return f"{len(w.left)} of its processes outlived it"
    changed = [n for n, h in harness_hashes.items() if _sha256(BENCH_DIR / n) != h]
    if changed:
        return f"the harness file(s) {', '.join(changed)} changed while it ran"
    if server.asked is None:
        return w.killed or f"it exited (code {w.rc}) before its first batch: {_last_words(list(w.tail))}"
    return None


def _warm_compile_cache(sha1: str | None, starting: Path | None, *, tokens, source: str, mode: str,
                        budget: float, startup: float, harness_hashes: dict[str, str], log: RunLog,
                        result: dict[str, Any], hidden: list[Path]) -> None:
    """Where no compile cache of the starting program is kept yet: run the starting program (the
    bytes at `starting`, whose sha1 must be `sha1`) in the sandbox up to its first batch, and keep
    what it compiled (see "Warming the cache on a fresh machine" in the module docstring).
    result["compile_cache"]["warm_up"] says how it went; nothing here fails the run."""
    if not sha1 or starting is None or result.get("candidate_sha1") == sha1 or seed_cache_entry(sha1).is_dir():
        return  # nothing to warm, or the run itself is of the starting program (it keeps its own)
    info: dict[str, Any] = {"kept": False}
    result["compile_cache"] = {"warm_up": info}
    program = _regular_file(starting, PROGRAM_LIMIT_BYTES, follow=True)
    if program is None or hashlib.sha1(program).hexdigest() != sha1:
        info["reason"] = f"{starting} is not the starting program {sha1[:12]}"
        log.harness(f"no warm-up of the compile cache: {info['reason']}; the candidate compiles from cold")
        return
    began = time.monotonic()
    run_dir = _run_dir(mode)
    ran: dict[str, Any] = {"candidate_sha1": sha1, "seed": 0}  # the warm-up's own record, not the run's
    try:
        w, server = _train(program, run_dir=run_dir, scratch=run_dir / "scratch", tokens=tokens, source=source,
                           mode=mode, budget=budget, startup=startup, export=0.0, log=log, result=ran,
                           hidden=hidden, warm_up=True)
        problem = _warm_up_problem(w, server, mode=mode, harness_hashes=harness_hashes)
        if problem is None and any((run_dir / "scratch" / n).is_dir() for n in CACHE_DIRS):
            _keep_compile_cache(sha1, run_dir / "scratch", log, ran)
            info["kept"] = bool(ran.get("compile_cache", {}).get("kept"))
            if not info["kept"] and seed_cache_entry(sha1).is_dir():
                info["reason"] = "another run's warm-up kept its cache first"
        elif problem is None:  # nothing to copy, ever: an empty entry says so, and no run warms up again
            with contextlib.suppress(FileExistsError):
                seed_cache_entry(sha1).mkdir(parents=True)
                info["kept"] = True
                log.harness(f"the starting program {sha1[:12]} compiled nothing here (bench/train.py compiles "
                            "on CUDA only): later runs need no warm-up")
        if problem is not None:
            info["reason"] = problem
            log.harness(f"the warm-up kept no compile cache ({problem}); the candidate compiles from cold")
    except (Outcome, OSError) as e:  # the sandbox could not start it: the candidate's own start will say so
        info["reason"] = e.reason if isinstance(e, Outcome) else f"{type(e).__name__}: {e}"
        log.harness(f"the warm-up could not run ({info['reason']}); the candidate compiles from cold")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    info["seconds"] = round(time.monotonic() - began, 2)


# --- the parts of a run --------------------------------------------------------------------------


def _read_candidate(candidate: Path, result: dict[str, Any]) -> bytes:
    code = _regular_file(candidate, 2**22, follow=True)
    if code is None:
        raise Outcome("error", "HarnessError", f"cannot read the candidate {candidate} (a regular file of at most 4 MiB)")
    result["candidate_sha1"] = hashlib.sha1(code).hexdigest()
    return code


def _allowances(budget: float | None, startup_allowance: float | None) -> tuple[float, float, float]:
    """(budget, start-up allowance, export allowance) in seconds: the profile's unless given."""
    prof = prepare.PROFILES[prepare.PROFILE]
    budget = float(budget if budget is not None else prepare.TIME_BUDGET)
    startup = float(startup_allowance if startup_allowance is not None else prof.startup_allowance)
    if not (budget > 0 and startup >= 0):
        raise Outcome("error", "HarnessError", f"budget must be > 0 and start-up allowance >= 0, not {budget} and {startup}")
    return budget, startup, prof.export_allowance


def _harness_hashes() -> dict[str, str]:
    return {name: _sha256(BENCH_DIR / name) for name in HARNESS_FILES}


def _prepared(source: str, num_shards: int | None, endpoint: str | None, log: RunLog):
    try:
        return prepare.prepare(source, num_shards=num_shards, endpoint=endpoint, verify="full",
                               log=lambda m: log.harness(m))
    except prepare.PrepareError as e:
        raise Outcome("error", "DataUnavailable", f"preparing the data ({source}) failed: {e}") from e
    except OSError as e:  # the cache itself: unreadable, not a directory, on a full disk
        raise Outcome("error", "DataUnavailable",
                      f"the data cache {prepare.cache_root()} cannot be used ({type(e).__name__}: {e}); nothing of "
                      "the candidate ran. It must be a directory the harness can read and write: fix it, or set "
                      "AUTOLAB_CACHE to one") from e


DATA_SEED_STRIDE = 1_000_003  # tokens between the start offsets of two harness seeds (a prime)


def _train(code: bytes, *, run_dir: Path, scratch: Path, tokens, source: str, mode: str, budget: float,
           startup: float, export: float, log: RunLog, result: dict[str, Any], hidden: list[Path],
           compile_from: str | None = None, gate: Gate | None = None,
           warm_up: bool = False) -> tuple[Watch, DataServer]:
    """Run the candidate in `mode` with scratch as its directory; returns once no process of it
    is left (Watch.left: those that could not be killed). compile_from: the sha1 of the lab's
    starting program, whose kept compile cache the scratch starts with (a copy). warm_up: the
    program is the starting program, run only to compile (see _warm_compile_cache): it is served
    no data and stopped at its first request."""
    scratch.mkdir()
    (scratch / "train.py").write_bytes(code)  # the bytes that were hashed are the bytes that run
    _seed_compile_cache(compile_from, scratch, log, result)
    pythonpath = str(BENCH_DIR)
    uid = None
    if mode == "uid":
        uid = sandbox_uid()
        pythonpath = str(_uid_workspace(run_dir, scratch, uid))
        _uid_preflight(uid, scratch, [BENCH_DIR, *(BENCH_DIR / n for n in HARNESS_FILES), *hidden])
    else:
        sandbox.prepare_scratch(scratch)
    if os.geteuid() == 0:  # the copied cache is the candidate's own, like the rest of its scratch
        for name in CACHE_DIRS:
            if (scratch / name).is_dir():
                _chown_tree(scratch / name, uid if uid is not None else sandbox.SANDBOX_UID)
    sandboxed = mode == "bwrap"
    where = Path(sandbox.SCRATCH) if sandboxed else scratch
    gpu = sandbox.wants_gpu()
    env = _harness_env()
    env.update({
        "HOME": str(where), "TMPDIR": str(where / "tmp"), "USER": "autolab", "LOGNAME": "autolab",
        "PYTHONPATH": sandbox.HARNESS if sandboxed else pythonpath,
        "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "AUTOLAB_BENCH_PROFILE": prepare.PROFILE, "AUTOLAB_SOURCE": source,
        "AUTOLAB_EXPORT_DIR": str(where / "export"), "AUTOLAB_CURVE_PATH": str(where / "curve.jsonl"),
        "AUTOLAB_TIME_BUDGET": repr(budget), "AUTOLAB_SEED": str(int(result.get("seed") or 0)),
    })
    # The compile cache is the run's own (a shared one is a place to leave something for the next
    # run); it may start as a copy of the starting program's (see COMPILE_SEEDS).
    env["TORCHINDUCTOR_CACHE_DIR"] = str(where / "compile")
    env["TRITON_CACHE_DIR"] = str(where / "triton")
    if prepare.PROFILE == "tiny":
        # Toy tensors gain nothing from threads, and spinning OpenMP threads on a busy CPU
        # make each step tens of times slower: one thread keeps tiny runs steady.
        env.setdefault("OMP_NUM_THREADS", "1")
    # The syscall filter (no network, no ptrace; see sandbox.py) in every mode that isolates:
    # bwrap loads it from a pipe once its namespaces are made, the others between fork and exec.
    filter_r, confine = None, None
    try:
        if sandboxed:
            filter_r = sandbox.filter_fd()
        elif mode in ("uid", "container"):
            confine = sandbox.Confinement()
        if mode == "container":  # the candidate has this process's uid: keep it out of here
            sandbox.not_dumpable()
    except (RuntimeError, OSError) as e:
        raise Outcome("error", "SandboxUnavailable", str(e)) from e
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env[prepare.DATA_FD_ENV] = str(theirs.fileno())
    # Every measured run (seed 0) sees the same stream: differences are the program's, not the data
    # order's. Repeat runs of one program (seeds 1, 2, ...) start elsewhere in it.
    seed = int(result.get("seed") or 0) * DATA_SEED_STRIDE
    server = DataServer(tokens, ours, seed, gate, hold=warm_up).start()
    if gate is not None and gate.closed():
        log.harness("the run before this one on the GPU is being evaluated: the candidate starts up beside it, "
                    "and its first batch waits until the controller hands the GPU over")
    limits = sandbox.Limits(address_space=None if gpu else _memory_limit(),
                            fsize=MAX_FILE_BYTES.get(prepare.PROFILE, sandbox.Limits.fsize))
    # The sandbox first checks that it can import what the benchmark needs (and use the GPU), and
    # says so on this pipe before train.py runs: an unfit sandbox is never the candidate's fault.
    fit_r, fit_w = sandbox.fitness_pipe()
    fitness = sandbox.Fitness(fit_r)
    python = sandbox.boot_argv(sys.executable, fit_w, gpu)
    info_r = info_w = None
    if sandboxed:
        info_r, info_w = os.pipe()
        argv = sandbox.command(python, scratch=scratch, harness=BENCH_DIR, gpu=gpu, seccomp_fd=filter_r)
        argv[1:1] = ["--info-fd", str(info_w)]
    elif mode == "uid":
        argv = _as_uid(uid, python)
    else:
        argv = python
    how = {"bwrap": "sandboxed", "uid": f"as uid {uid}", "container": "in its container"}.get(mode, "NOT sandboxed")
    if warm_up:
        log.harness(f"warming up the compile cache: the starting program {result['candidate_sha1'][:12]} runs "
                    f"up to its first batch ({prepare.PROFILE} profile, {how}); this is not a measurement")
    else:
        log.harness(f"running candidate {result['candidate_sha1'][:12]} ({prepare.PROFILE} profile, budget "
                    f"{budget:g}s, {how})")
    swept: list[tuple[int, list[int]]] = []
    try:
        w = _run_sandboxed(argv, cwd=scratch, env=env,
                           pass_fds=(theirs.fileno(), fit_w) + ((filter_r,) if filter_r is not None else ()),
                           server=server, budget=budget, startup=startup, export=export, log=log,
                           limits=limits, confine=confine, info_fd=info_w, info_r=info_r,
                           reap=(lambda: swept.append(sweep_uid(uid))) if mode == "uid" else None,
                           export_dir=scratch / "export", fitness=fitness, stop_when_ready=warm_up,
                           prefix="[warm-up] " if warm_up else "")
    finally:
        theirs.close()
        os.close(fit_w)
        if filter_r is not None:
            os.close(filter_r)
    if info_r is not None:
        os.close(info_r)
    ours.close()
    w.fitness = fitness.result()
    w.who = {"uid": f"uid {uid}", "bwrap": f"the sandbox's uid {sandbox.SANDBOX_UID}" if os.geteuid() == 0
             else "the sandbox"}.get(mode, "the harness's user")
    server.thread.join(timeout=5.0)
    result["exit_code"] = w.rc
    if w.stopped_at_export:
        log.harness("model exported; the candidate was stopped there (the first export after training is measured)")
    if log.dropped:
        log.harness(f"{log.dropped} more lines of output were not kept (log limit {LOG_LIMIT_BYTES} bytes)")
    if mode == "uid":
        outlived, w.left = swept[0] if swept else sweep_uid(uid)
        if outlived:
            log.harness(f"{outlived} process(es) of uid {uid} outlived the candidate and were killed")
    else:
        w.left = _survivors(w.namespace)
    return w, server


def _judge(w: Watch, server: DataServer, *, mode: str, harness_hashes: dict[str, str], budget: float,
           result: dict[str, Any]) -> float:
    """The training seconds of a run that went by the rules; raises Outcome for one that did not."""
    if server.gate is not None and server.gate.given_up:  # it stopped waiting: nobody's verdict
        raise Outcome("error", "HarnessError", server.gate.given_up, w.rc)
    if not (w.fitness or {}).get("fit"):  # the candidate never ran: the machine's fault, retriable
        raise Outcome("error", "SandboxUnavailable", sandbox.unfit_reason(w.fitness, w.who, _last_words(list(w.tail))),
                      w.rc)
    if mode == "bwrap" and not w.namespace:
        raise Outcome("error", "SandboxUnavailable", "the sandbox did not report its PID namespace; "
                                                     "cannot check that no candidate process is left", w.rc)
    if w.left:
        raise Outcome("failed", "ProcessesLeft", f"{len(w.left)} process(es) of the candidate outlived it and "
                                                 "could not be killed; the run is void", w.rc)
    changed = [n for n, h in harness_hashes.items() if _sha256(BENCH_DIR / n) != h]
    if changed:
        raise Outcome("error", "HarnessTampered", f"the harness file(s) {', '.join(changed)} in {BENCH_DIR} "
                                                  "changed while the candidate ran; the run is void", w.rc)
    first, done = server.first, min(server.done or w.ended, w.ended)
    training = (done - first) if first is not None else 0.0
    ready = server.asked if server.asked is not None else (first or w.ended)
    result["timing"] = {"startup_seconds": round(ready - w.started, 2),
                        "gpu_wait_seconds": round(first - server.asked, 2)
                        if first is not None and server.asked is not None and server.gate is not None else None,
                        "training_seconds": round(training, 2),
                        "export_seconds": round(w.ended - done, 2) if first is not None else None,
                        "tokens_served": server.served,
                        # when the GPU trained, on the wall clock: a lab's timeline across runs
                        "trained_from": round(server.first_wall, 3) if server.first_wall else None,
                        "trained_until": round(server.first_wall + training, 3) if server.first_wall else None}
    if w.killed:
        raise Outcome("failed", "BudgetExceeded", f"the candidate was killed: {w.killed}")
    if first is not None and training > budget + budget_slack(budget):
        raise Outcome("failed", "BudgetExceeded",
                      f"the candidate trained for {training:.1f}s, measured by the harness from its first "
                      f"batch, past its budget of {budget:g}s (+{budget_slack(budget):.1f}s slack)", w.rc)
    if w.rc != 0:
        raise Outcome("failed", "CandidateCrashed",
                      f"the candidate exited with code {w.rc}: {_last_words(list(w.tail))}", w.rc)
    if first is None:
        raise Outcome("failed", "NoTraining", "the candidate never asked for training data "
                                              "(train.py must train on prepare.make_loader batches)", w.rc)
    return training


def _keep_curve(raw: bytes | None, curve_path: Path, result: dict[str, Any]) -> None:
    curve = _curve(raw)
    if curve:
        curve_path.parent.mkdir(parents=True, exist_ok=True)
        curve_path.write_text("".join(json.dumps(c) + "\n" for c in curve))
        result["curve"] = os.path.abspath(curve_path)  # the directory's name now (a run started ahead was renamed)


def _take_export(base: Path, scratch_rel: str, eval_dir: Path, exit_code: int | None) -> tuple[Path, dict]:
    """The exported model, copied out of the candidate's directory into eval_dir/export, and its
    stats; NoExport if there is no regular model.pt2 to copy."""
    export_dir = eval_dir / "export"
    export_dir.mkdir()
    if not _copy_regular(f"{scratch_rel}export/model.pt2", export_dir / "model.pt2", EXPORT_LIMIT_BYTES, base):
        raise Outcome("failed", "NoExport", "the candidate finished without exporting its model "
                                            "(train.py must call prepare.export_model(model, stats) at the end)",
                      exit_code)
    stats = _json_object(_regular_file(f"{scratch_rel}export/stats.json", STATS_LIMIT_BYTES, base))
    return export_dir, stats


class Evaluator:
    """`python -I evaluate.py --export-dir -` in its own process group.

    It reads and checks the validation data, imports torch and opens the GPU, then waits on its
    stdin for the export directory. Started before the candidate (a GPU machine), those seconds
    overlap the candidate's start-up instead of following its training. It runs as the
    harness's user in a directory the candidate never sees; `measure` hands it the export and
    waits for its verdict, `stop` ends it either way.
    """

    def __init__(self, eval_dir: Path, data, log: RunLog, candidate_had_gpu: bool | None = None) -> None:
        # candidate_had_gpu False (phase all on a machine without a GPU for the candidate): an
        # archive naming a CUDA device is the candidate's forgery, not this machine's fault.
        eval_env = _harness_env()
        if prepare.PROFILE == "tiny":
            eval_env.setdefault("OMP_NUM_THREADS", "1")
        (eval_dir / "tmp").mkdir(exist_ok=True)
        eval_env.update({"PYTHONUNBUFFERED": "1", "AUTOLAB_BENCH_PROFILE": prepare.PROFILE,
                         "AUTOLAB_CACHE": str(prepare.cache_root()), "HOME": str(eval_dir),
                         "TMPDIR": str(eval_dir / "tmp")})
        self.out = eval_dir / "evaluation.json"
        self.dir = eval_dir
        self.log = log
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(BENCH_DIR / "evaluate.py"), "--export-dir", "-",
             "--data-dir", str(data.path), "--val-sha256", data.sha256("val.bin"),
             "--token-bytes-sha256", data.sha256("token_bytes.npy"), "--out", str(self.out),
             "--tell-peak", str(eval_dir / "peak"), "--tell-ready", str(eval_dir / "ready"),
             *(["--candidate-had-no-gpu"] if candidate_had_gpu is False else [])],
            cwd=eval_dir, env=eval_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._pump, daemon=True, name="evaluator-output")
        self.reader.start()

    def _pump(self) -> None:
        for raw in _lines(self.proc.stdout):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(text)
            self.log.candidate(text, "[evaluate] ")

    def measure(self, export_dir: Path, timeout: float,
                handover: Path | None = None) -> tuple[int | None, bool, list[str]]:
        """Hand over the export; (exit code, timed out, last lines). With `handover`, that file is
        written once the evaluator holds all the GPU memory its evaluation uses (--tell-peak), or
        has ended: the GPU may take the next run's start-up beside it from then on, and whatever
        that run allocates cannot starve this evaluation."""
        began = time.monotonic()
        with contextlib.suppress(OSError):  # it ended early: its output says why
            self.proc.stdin.write(f"{export_dir}\n".encode())
            self.proc.stdin.close()
        if handover is not None:
            while not (self.dir / "peak").exists() and self.proc.poll() is None \
                    and time.monotonic() - began < timeout:
                time.sleep(0.02)
            with contextlib.suppress(OSError):  # not when out of time: it ran alone until then
                if time.monotonic() - began < timeout:
                    handover.write_text("the candidate is gone and the evaluator holds the memory it needs\n")
        timed_out = False
        try:
            self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:
            timed_out = True
        self.stop()
        return (None if timed_out else self.proc.returncode), timed_out, list(self.tail)

    def ready(self) -> bool:
        """Whether it got ready (data, torch, device) before it ended: before that it had read
        nothing of the export, so its death was its environment's, not the model's."""
        return (self.dir / "ready").exists()

    def stop(self) -> None:
        _kill(self.proc)
        self.reader.join(timeout=5.0)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


def _early_evaluator() -> bool:
    forced = os.environ.get(EARLY_EVALUATOR_ENV, "")
    return forced == "1" if forced in ("0", "1") else sandbox.wants_gpu()


def eval_limit(asked: float | None) -> float:
    """Seconds the evaluation may take: the profile's eval_timeout, or less where asked (--eval-limit)."""
    allowed = prepare.PROFILES[prepare.PROFILE].eval_timeout
    return allowed if asked is None else min(allowed, asked)


def _measure(eval_dir: Path, export_dir: Path, data, *, log: RunLog, exit_code: int | None,
             evaluator: Evaluator | None = None, handover: Path | None = None,
             handback: Path | None = None, limit: float | None = None,
             candidate_had_gpu: bool | None = None) -> dict:
    """val_bpb of the export, from the evaluator (started now if not before); Outcome if there is none.
    An evaluation that runs out of time (`eval_limit(limit)`) beside the next run's start-up is
    measured again alone (see --handback)."""
    seconds = eval_limit(limit)
    evaluator = evaluator or Evaluator(eval_dir, data, log, candidate_had_gpu)
    log.harness(f"measuring val_bpb of the exported model in a separate evaluator process (at most {seconds:g}s)")
    eval_rc, eval_timed_out, eval_tail = evaluator.measure(export_dir, seconds, handover)
    too_slow = f"evaluating the exported model took longer than {seconds:g}s"
    if eval_timed_out and handover is not None and os.path.lexists(handover):
        # The next run may have started up beside it and slowed it: not yet this candidate's fault.
        if handback is None or not _hand_back(handover, handback, log):
            raise Outcome("error", "EvaluationFailed", f"{too_slow} while the GPU was shared with the next "
                                                       "run's start-up; nothing was measured", exit_code)
        log.harness("the GPU is this run's alone again: measuring the exported model once more")
        alone = eval_dir / "alone"
        alone.mkdir()
        evaluator = Evaluator(alone, data, log, candidate_had_gpu)
        eval_rc, eval_timed_out, eval_tail = evaluator.measure(export_dir, seconds)
        too_slow += " twice: beside the next run's start-up, then again with the GPU to itself"
    if eval_timed_out:
        raise Outcome("failed", "EvaluationFailed", too_slow, exit_code)
    if not evaluator.out.exists() and not evaluator.ready():
        # It died before it read anything of the export: the machine's doing (an OOM kill, a broken
        # interpreter), never the model's. The candidate is gone now; one more try, then an error.
        log.harness(f"the evaluator ended before it was ready (exit code {eval_rc}: {_last_words(eval_tail)}); "
                    "starting it once more")
        again = eval_dir / "again"
        again.mkdir()
        evaluator = Evaluator(again, data, log, candidate_had_gpu)
        eval_rc, eval_timed_out, eval_tail = evaluator.measure(export_dir, seconds)
        if eval_timed_out:
            raise Outcome("failed", "EvaluationFailed", too_slow, exit_code)
        if not evaluator.out.exists() and not evaluator.ready():
            raise Outcome("error", "HarnessError",
                          f"the evaluator died before it read the export, twice (exit code {eval_rc}: "
                          f"{_last_words(eval_tail)}); nothing was measured, and the model is not to blame. "
                          f"Check that `{sys.executable} -c 'import torch'` works and that the machine has "
                          "memory to spare (`dmesg` names a process the kernel killed)", exit_code)
    try:
        evaluation = json.loads(evaluator.out.read_text())
    except (OSError, ValueError):
        raise Outcome("failed", "EvaluationFailed", f"the evaluator could not run the exported model (exit "
                                                    f"code {eval_rc}): {_last_words(eval_tail)}", exit_code) from None
    if not evaluation.get("ok"):
        status = "error" if evaluation.get("blame") == "harness" else "failed"
        raise Outcome(status, evaluation.get("reason_code") or "EvaluationFailed",
                      f"evaluation failed: {evaluation.get('reason')}", exit_code)
    return evaluation


def _hand_back(handover: Path, handback: Path, log: RunLog) -> bool:
    """Withdraw the handover and ask for the GPU back (write `handback`); True once the controller
    has stopped the run it started up beside this one (it removes `handback`), False if it has not
    within HANDBACK_WAIT_SECONDS or the file cannot be written."""
    log.harness(f"the evaluation ran out of time beside the next run's start-up: asking for the GPU back "
                f"({handback})")
    try:
        handover.unlink(missing_ok=True)  # first: a controller that sees it starts nothing more
        handback.write_text("the evaluation ran out of time beside the next run: stop it, then remove this file\n")
    except OSError as e:
        log.harness(f"could not ask for the GPU back: {e}")
        return False
    deadline = time.monotonic() + HANDBACK_WAIT_SECONDS
    while os.path.lexists(handback):
        if time.monotonic() > deadline:
            log.harness(f"nobody gave the GPU back within {HANDBACK_WAIT_SECONDS:g}s")
            return False
        time.sleep(0.05)
    return True


def _succeeded(result: dict[str, Any], stats: dict, evaluation: dict, *, training: float, total: float,
               tokens: int, gpu: dict[str, Any] | None = None, had_gpu: bool = False,
               untrusted_timing: bool = False) -> None:
    result["metrics"], own = _metrics(stats, evaluation, training=training, total=total, tokens=tokens,
                                      gpu=gpu, had_gpu=had_gpu)
    # Where the evaluator's own time went: after the export, and before it (getting ready).
    for theirs, ours in (("stage_seconds", "evaluate_stages"), ("ready_seconds", "evaluator_ready")):
        seconds = evaluation.get(theirs)
        if isinstance(seconds, dict):
            result.setdefault("timing", {})[ours] = {str(k): v for k, v in seconds.items()
                                                     if _number(v) is not None}
    reported = [k for k in (*ALWAYS_SELF_REPORTED, *own) if result["metrics"].get(k) is not None]
    if untrusted_timing:  # timed (and sampled) in the candidate's own container: its word
        reported += [k for k in ("training_seconds", "total_tokens_M", "mfu_percent", "peak_vram_mb")
                     if result["metrics"].get(k) is not None and k not in reported]
    result["self_reported"] = [k for k in METRIC_KEYS if k in reported]
    result["reported"] = _reported(stats)
    result["measured"] = {"flops_per_token": evaluation.get("flops_per_token"),
                          "peak_flops": peak_flops(evaluation.get("device_name")),
                          "device_name": evaluation.get("device_name"),
                          "gpu_memory": (gpu or {}).get("how"), "gpu_memory_samples": (gpu or {}).get("samples")}
    result.update(status="succeeded", reason_code="Succeeded",
                  reason=f"val_bpb {evaluation['val_bpb']:.6f}, measured by the harness on the exported "
                         f"model ({evaluation['device']})")


def _gpu_memory(mode: str, evaluator: Evaluator | None = None) -> GpuMemory:
    """The sampler of the candidate's GPU memory, started (see GpuMemory)."""
    return GpuMemory(exclude=(evaluator.proc.pid,) if evaluator is not None else (),
                     uid=sandbox_uid() if mode == "uid" else None).start()


def _room_to_run(*dirs: Path) -> None:
    """Refuse (HarnessError) to start a candidate where a full disk would make it crash."""
    need = MIN_FREE_BYTES.get(prepare.PROFILE, MIN_FREE_BYTES["default"])
    for d in dirs:
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise Outcome("error", "HarnessError",
                          f"only {free / 2**20:.0f} MiB are free on the filesystem of {d}, and a run of the "
                          f"{prepare.PROFILE} profile needs {need / 2**20:.0f} MiB (the candidate's export, "
                          "compile cache and their copies); nothing of the candidate ran. Free space there, or "
                          "point TMPDIR at a filesystem with room")


def _run_dir(mode: str) -> Path:
    # uid mode: the candidate must traverse to its scratch directory, so not under a private $TMPDIR.
    return Path(tempfile.mkdtemp(prefix="autolab-run-", dir=UID_SCRATCH_ROOT if mode == "uid" else None))


def _execute(candidate: Path, *, source: str, budget: float | None, startup_allowance: float | None,
             curve_path: Path, num_shards: int | None, endpoint: str | None, keep_run_dir: bool,
             mode: str, log: RunLog, result: dict[str, Any], compile_from: str | None = None,
             gate: Gate | None = None, handover: Path | None = None, handback: Path | None = None,
             eval_limit_seconds: float | None = None, starting: Path | None = None) -> None:
    """--phase all: prepare, (warm the compile cache,) train, evaluate, in this process."""
    code = _read_candidate(candidate, result)
    harness_hashes = _harness_hashes()
    budget, startup, export = _allowances(budget, startup_allowance)
    began = time.monotonic()
    data = _prepared(source, num_shards, endpoint, log)
    result["source"] = data.source
    prepared = round(time.monotonic() - began, 2)

    run_dir = _run_dir(mode)
    cleanup = [run_dir]
    evaluator = None
    try:
        # The evaluator's directory is the harness's, never the candidate's to see; on a GPU
        # machine the evaluator gets ready there (data, torch, GPU) while the candidate starts up.
        eval_dir = Path(tempfile.mkdtemp(prefix="autolab-eval-"))
        cleanup.append(eval_dir)
        _room_to_run(run_dir, eval_dir)
        hidden = [prepare.cache_root(), data.path, data.file("val.bin"), eval_dir]
        _warm_compile_cache(compile_from, starting, tokens=data.tokens("train"), source=data.source, mode=mode,
                            budget=budget, startup=startup, harness_hashes=harness_hashes, log=log, result=result,
                            hidden=hidden)
        if _early_evaluator():
            evaluator = Evaluator(eval_dir, data, log, sandbox.wants_gpu())
            log.harness("the evaluator gets ready (data, torch, device) while the candidate starts up")
        scratch = run_dir / "scratch"
        gpu = _gpu_memory(mode, evaluator)
        try:
            w, server = _train(code, run_dir=run_dir, scratch=scratch, tokens=data.tokens("train"),
                               source=data.source, mode=mode, budget=budget, startup=startup, export=export,
                               log=log, result=result, hidden=hidden, compile_from=compile_from, gate=gate)
        finally:
            gpu_memory = gpu.stop()
        training = _judge(w, server, mode=mode, harness_hashes=harness_hashes, budget=budget, result=result)
        _keep_compile_cache(compile_from, scratch, log, result)
        result["timing"]["prepare_seconds"] = prepared
        warmed = (result.get("compile_cache") or {}).get("warm_up")
        if warmed:
            result["timing"]["warm_up_seconds"] = warmed.get("seconds")
        _keep_curve(_regular_file("curve.jsonl", CURVE_LIMIT_BYTES, scratch), curve_path, result)

        # Out of the scratch directory into one the candidate never saw; nothing of it runs now.
        export_dir, stats = _take_export(scratch, "", eval_dir, w.rc)
        if not keep_run_dir:
            shutil.rmtree(scratch, ignore_errors=True)
        measuring = time.monotonic()
        evaluation = _measure(eval_dir, export_dir, data, log=log, exit_code=w.rc, evaluator=evaluator,
                              handover=handover, handback=handback, limit=eval_limit_seconds,
                              candidate_had_gpu=sandbox.wants_gpu())
        result["timing"]["evaluate_seconds"] = round(time.monotonic() - measuring, 2)
        _succeeded(result, stats, evaluation, training=training, total=time.monotonic() - began,
                   tokens=server.served, gpu=gpu_memory, had_gpu=sandbox.wants_gpu())
    finally:
        if evaluator is not None:
            evaluator.stop()
        if keep_run_dir:
            log.harness(f"run directory kept: {run_dir}")
            cleanup.remove(run_dir)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


def _survivors(namespace: str | None) -> list[int]:
    """Processes left in the candidate's PID namespace, killed. None can be left once its init
    exits (the kernel kills them), but one that is killed while it holds gigabytes (a torch
    process) takes a while to give its memory back on a loaded machine: it gets until
    SURVIVOR_GRACE_SECONDS. A zombie has exited (no memory, no files, no code left to run):
    it is not a survivor."""
    deadline = time.monotonic() + SURVIVOR_GRACE_SECONDS
    left = _living(sandbox.survivors(namespace))
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
        left = _living(sandbox.survivors(namespace))
    return left


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


def _write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temp file beside it, then a rename. The temp file has a
    random name and is made with O_EXCL|O_NOFOLLOW, so nothing planted in a directory a
    candidate can write (a FIFO or a link at a name it could guess) can take its place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.urandom(8).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def compact(result: dict[str, Any], limit: int = TERMINATION_LOG_LIMIT) -> str:
    """Compact JSON of the result within `limit` bytes (the reason is cut to fit)."""
    result = dict(result)
    text = json.dumps(result, separators=(",", ":"))
    while len(text.encode()) > limit and result.get("reason"):
        excess = len(text.encode()) - limit
        reason = result["reason"]
        result["reason"] = reason[: max(0, len(reason) - excess - 3)] + "..." if len(reason) > 3 else ""
        text = json.dumps(result, separators=(",", ":"))
    return text


def signature(key: bytes, result: dict[str, Any]) -> str:
    """HMAC-SHA256 of the result (without its signature), canonical JSON; the controller checks it."""
    body = {k: v for k, v in result.items() if k != "signature"}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
                    hashlib.sha256).hexdigest()


def default_termination_log() -> str | None:
    """/dev/termination-log when it exists and is writable (as in a Kubernetes container)."""
    return TERMINATION_LOG if os.path.isfile(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK) else None


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


def _new_result(run: str | None, source: str) -> dict[str, Any]:
    return {
        "version": RESULT_VERSION, "run": run, "status": "error", "reason_code": "HarnessError", "reason": "",
        "exit_code": None, "candidate_sha1": None, "profile": prepare.PROFILE, "source": source,
        "sandbox": None, "metrics": None, "curve": None,
    }


def _settle(result: dict[str, Any], run: Any) -> None:
    """Run `run()`, turning what it raises into the result's status."""
    try:
        run()
    except Outcome as o:
        result.update(status=o.status, reason_code=o.code, reason=o.reason)
        if o.exit_code is not None:
            result["exit_code"] = o.exit_code
    except Exception as e:  # a harness bug or a machine problem: retryable
        result.update(status="error", reason_code="HarnessError", reason=f"harness error: {type(e).__name__}: {e}")


# Where a run's wall time went, in the order it is spent. "prepare" is the data check (and a
# first run's tokenising); "compile-cache warm-up" the starting program's run up to its first
# batch on a machine that kept no cache of it (--starting-program); "start-up" runs from launching the candidate to its first training
# batch (imports, model build, sandbox); "export" from its last batch to its exit (the compiled
# model's export); "evaluate" the harness's own val_bpb pass on the exported model.
TIME_PARTS = (("prepare", "prepare_seconds"), ("compile-cache warm-up", "warm_up_seconds"),
              ("start-up", "startup_seconds"),
              ("waiting for the GPU", "gpu_wait_seconds"),
              ("training", "training_seconds"), ("export", "export_seconds"),
              ("evaluate", "evaluate_seconds"))


def time_breakdown(result: dict[str, Any]) -> str:
    """One line: each part of the run's time, the rest, and the time spent outside training."""
    timing = result.get("timing") or {}
    total = _number((result.get("metrics") or {}).get("total_seconds"))
    parts = [(label, _number(timing.get(key))) for label, key in TIME_PARTS]
    known = [(label, v) for label, v in parts if v is not None]
    text = ", ".join(f"{label} {v:.1f}s" for label, v in known)
    stages = timing.get("evaluate_stages") or {}
    if stages and "evaluate" in dict(known):
        inner = " ".join(f"{k} {_number(v):.1f}" for k, v in stages.items())
        text = text.replace(f"evaluate {dict(known)['evaluate']:.1f}s",
                            f"evaluate {dict(known)['evaluate']:.1f}s ({inner})")
    if total is not None:
        other = total - sum(v for _, v in known)
        training = _number(timing.get("training_seconds")) or 0.0
        text += f", other {max(other, 0.0):.1f}s; outside training {total - training:.1f}s of {total:.1f}s"
    return "time: " + text


def _finish(result: dict[str, Any], result_path: Path, *, log: RunLog, key: bytes | None,
            termination_log: str | os.PathLike | None) -> dict[str, Any]:
    """Sign, write the result and the termination message, print the marker line."""
    if result["status"] != "succeeded":
        result.pop("metrics", None)
    if result.get("sandbox") == "none":
        result["reason"] += " (the candidate ran WITHOUT a sandbox)"
    # Cut the reason so that the signed result fits the termination message whole: the
    # signature must cover exactly what a controller reads back.
    result["reason"] = json.loads(compact({**result, "signature": "0" * 64}))["reason"]
    if key:
        result["signature"] = signature(key, result)
    try:
        _write_atomic(result_path, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        log.harness(f"cannot write the result {result_path}: {e}")
    termination_log = termination_log if termination_log is not None else default_termination_log()
    if termination_log:
        try:
            Path(termination_log).write_text(compact(result))
        except OSError as e:
            log.harness(f"could not write the termination log {termination_log}: {e}")
    log.harness(f"{result['status']}: {result['reason']}")
    if result.get("timing"):
        log.harness(time_breakdown(result))
    if result.get("measured"):
        log.harness(figures_line(result))
    log.line(f"{RESULT_MARKER} {compact(result)}")
    log.close()
    return result


def run_candidate(candidate: str | os.PathLike, result_path: str | os.PathLike, *, source: str | None = None,
                  budget: float | None = None, startup_allowance: float | None = None,
                  log_path: str | os.PathLike | None = None, termination_log: str | os.PathLike | None = None,
                  curve_path: str | os.PathLike | None = None, num_shards: int | None = None,
                  endpoint: str | None = None, keep_run_dir: bool = False, echo: bool = True,
                  sandbox_request: str = "auto", key: bytes | None = None, run: str | None = None,
                  seed: int = 0, compile_from: str | None = None,
                  starting_program: str | os.PathLike | None = None, gate: str | os.PathLike | None = None,
                  gate_owner_fd: int | None = None,
                  handover: str | os.PathLike | None = None,
                  handback: str | os.PathLike | None = None,
                  eval_limit_seconds: float | None = None) -> dict[str, Any]:
    """Run one candidate end to end and return the result (also written to result_path).

    seed (the harness's, not the candidate's): 0 for a measured run; for the master's noise runs
    and for confirm runs, ones above 1000 no run can predict (the controller's choice; any int
    works). It
    moves the training data's start offset and is passed as $AUTOLAB_SEED, which bench/train.py
    reads; the program stays the same.

    source defaults to $AUTOLAB_SOURCE or "hub"; budget to prepare.TIME_BUDGET;
    the curve goes to curve_path, by default `<result stem>.curve.jsonl` next
    to the result. compile_from: the sha1 of the lab's starting program (see
    COMPILE_SEEDS); starting_program: the path of its bytes, run to warm the cache where none is
    kept (see --starting-program); gate, gate_owner_fd, handover, handback, eval_limit_seconds: see --gate,
    --gate-owner-fd, --handover, --handback,
    --eval-limit. Never raises for
    a failed candidate: see result["status"].
    """
    result_path = Path(result_path)
    source = source or os.environ.get("AUTOLAB_SOURCE") or "hub"
    curve = Path(curve_path) if curve_path else result_path.with_name(result_path.stem + ".curve.jsonl")
    log = RunLog(log_path, echo)
    result = _new_result(run, source)
    result["seed"] = int(seed)

    def execute() -> None:
        mode = sandbox_mode(sandbox_request)
        result["sandbox"] = mode
        _execute(Path(candidate), source=source, budget=budget, startup_allowance=startup_allowance,
                 curve_path=curve, num_shards=num_shards, endpoint=endpoint, keep_run_dir=keep_run_dir,
                 mode=mode, log=log, result=result, compile_from=compile_from,
                 gate=Gate(Path(gate), gate_owner_fd) if gate else None, handover=Path(handover) if handover else None,
                 handback=Path(handback) if handback else None, eval_limit_seconds=eval_limit_seconds,
                 starting=Path(starting_program) if starting_program and compile_from else None)

    _settle(result, execute)
    return _finish(result, result_path, log=log, key=key, termination_log=termination_log)


# --- phases: one container stages the data, one trains, one evaluates ----------------------------


def stage_data(train_data: str | os.PathLike, *, source: str | None = None, num_shards: int | None = None,
               endpoint: str | None = None, log_path: str | os.PathLike | None = None, echo: bool = True,
               termination_log: str | os.PathLike | None = None) -> dict[str, Any]:
    """--phase stage: prepare the data, copy train.bin (checked) and its record into train_data.
    Returns {"ok": bool, "reason": ...}."""
    log = RunLog(log_path, echo)
    source = source or os.environ.get("AUTOLAB_SOURCE") or "hub"
    out = Path(train_data)
    try:
        data = _prepared(source, num_shards, endpoint, log)
        out.mkdir(parents=True, exist_ok=True)
        want = data.sha256("train.bin")
        digest = hashlib.sha256()
        size = 0
        fd = _open_regular(data.file("train.bin"), 2**40)
        if fd is None:
            raise Outcome("error", "DataUnavailable", f"{data.file('train.bin')} is not a regular file")
        with os.fdopen(fd, "rb") as f, open(out / "train.bin", "wb") as dst:
            while chunk := f.read(2**22):
                digest.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        if digest.hexdigest() != want:
            raise Outcome("error", "DataTampered", f"{data.file('train.bin')} does not match its manifest's sha256")
        _write_atomic(out / STAGED_RECORD, json.dumps({
            "version": 1, "source": data.source, "profile": prepare.PROFILE, "sha256": want,
            "bytes": size, "tokens": size // 2}) + "\n")
        status = {"ok": True, "reason": f"staged {size // 2:,} training tokens of {data.source} in {out}"}
    except Outcome as o:
        status = {"ok": False, "reason_code": o.code, "reason": o.reason}
    except Exception as e:
        status = {"ok": False, "reason_code": "HarnessError", "reason": f"harness error: {type(e).__name__}: {e}"}
    termination_log = termination_log if termination_log is not None else default_termination_log()
    if termination_log:
        try:
            Path(termination_log).write_text(json.dumps(status)[:TERMINATION_LOG_LIMIT])
        except OSError:
            pass
    log.harness(("staged: " if status["ok"] else "staging failed: ") + status["reason"])
    log.close()
    return status


def _staged_tokens(train_data: Path):
    """The training tokens the stage phase left in train_data, and its record."""
    import numpy as np

    record = _json_object(_regular_file(train_data / STAGED_RECORD, RECORD_LIMIT_BYTES))
    if record.get("profile") != prepare.PROFILE or not isinstance(record.get("bytes"), int):
        raise Outcome("error", "DataUnavailable", f"{train_data} holds no training data staged for the "
                                                  f"{prepare.PROFILE} profile (run --phase stage first)")
    path = train_data / "train.bin"
    fd = _open_regular(path, 2**40)
    if fd is None or os.fstat(fd).st_size != record["bytes"]:
        if fd is not None:
            os.close(fd)
        raise Outcome("error", "DataUnavailable", f"{path} is missing or not the size its record says")
    os.close(fd)
    return np.memmap(path, dtype=np.uint16, mode="r"), record


def _withdraw_staged(train_data: Path) -> None:
    """Unlink the staged training split once it is mapped (the mapping keeps it for the data
    stream). In container mode the candidate runs as this process's uid: a train.bin it could
    open would be training data outside the stream, read during its start-up allowance before
    the harness's clock starts (and during the export allowance after it stops). Refuses to
    run the candidate (SandboxUnavailable) when the file cannot be removed (a read-only
    train-data volume)."""
    try:
        os.unlink(train_data / "train.bin")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise Outcome("error", "SandboxUnavailable",
                      f"cannot remove the staged training split {train_data / 'train.bin'} ({e}); a "
                      "candidate of this uid could read it outside the timed stream, so it is not run "
                      "(mount the train-data volume writable in the train container)") from e
    if os.path.lexists(train_data / "train.bin"):
        raise Outcome("error", "SandboxUnavailable", f"{train_data / 'train.bin'} is still there")


def train_phase(candidate: str | os.PathLike, export_dir: str | os.PathLike, train_data: str | os.PathLike, *,
                budget: float | None = None, startup_allowance: float | None = None,
                sandbox_request: str = "bwrap", log_path: str | os.PathLike | None = None,
                echo: bool = True, seed: int = 0) -> dict[str, Any]:
    """--phase train: run the candidate with export_dir/scratch as its directory and write the
    record export_dir/record.json (returned). Never raises. seed: as run_candidate's."""
    log = RunLog(log_path, echo)
    export_dir = Path(export_dir)
    started = time.monotonic()
    record: dict[str, Any] = {"version": 1, "phase": "train", "candidate_sha1": None, "sandbox": None,
                              "source": None, "budget": None, "outcome": None, "exit_code": None,
                              "timing": None, "seed": int(seed)}

    def execute() -> None:
        mode = sandbox_mode(sandbox_request)
        record["sandbox"] = mode
        code = _read_candidate(Path(candidate), record)
        harness_hashes = _harness_hashes()
        budget_, startup, export = _allowances(budget, startup_allowance)
        record["budget"] = budget_
        tokens, staged = _staged_tokens(Path(train_data))
        record["source"] = staged.get("source")
        if mode == "container":  # the candidate has this process's uid: the file must go
            _withdraw_staged(Path(train_data))
        export_dir.mkdir(parents=True, exist_ok=True)
        scratch = export_dir / "scratch"
        if scratch.exists():
            raise Outcome("error", "HarnessError", f"{scratch} exists already: the export directory of a "
                                                   "train phase must start empty")
        hidden = [prepare.cache_root()] if os.path.exists(prepare.cache_root()) else []
        _room_to_run(export_dir)
        gpu = _gpu_memory(mode)
        try:
            w, server = _train(code, run_dir=export_dir, scratch=scratch, tokens=tokens,
                               source=str(staged.get("source")), mode=mode, budget=budget_, startup=startup,
                               export=export, log=log, result=record, hidden=hidden)
        finally:
            record["gpu_memory"] = gpu.stop()
            record["had_gpu"] = sandbox.wants_gpu()
        try:
            _judge(w, server, mode=mode, harness_hashes=harness_hashes, budget=budget_, result=record)
        finally:
            record["exit_code"] = w.rc

    outcome: dict[str, Any] = {"status": "succeeded"}
    _settle(outcome, execute)
    if outcome["status"] != "succeeded":
        record["outcome"] = {k: outcome.get(k) for k in ("status", "reason_code", "reason", "exit_code")}
    record["elapsed_seconds"] = round(time.monotonic() - started, 2)
    try:
        _end_the_container()
        _write_record(export_dir / TRAIN_RECORD, json.dumps(record, indent=1) + "\n")
        record["written"] = True
    except OSError as e:
        log.harness(f"cannot write the train record {export_dir / TRAIN_RECORD}: {e}")
        record["written"] = False
    log.harness("train phase: " + (record["outcome"]["reason"] if record["outcome"]
                                   else "the candidate trained and exported; evaluate next"))
    log.close()
    return record


def _end_the_container() -> None:
    """As its container's first process (a Kubernetes train container), kill every other
    process in it before the record is written: a candidate's setsid child escapes the process
    group, and until this process exits it could rewrite the record (its outcome) after it was
    written. kill(-1) from a PID namespace's init reaches exactly the rest of that namespace."""
    if os.getpid() != 1:
        return
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)
    deadline = time.monotonic() + SURVIVOR_GRACE_SECONDS
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not _living([int(e) for e in os.listdir("/proc") if e.isdigit() and e != "1"]):
            return
        time.sleep(0.05)


def _write_record(path: Path, text: str) -> None:
    """Write the train record into a directory the candidate can write (container mode):
    `_write_atomic`, with whatever the candidate left at the record's own name that is not a
    file moved aside first (a directory there would make the rename fail, and the run a
    retryable harness error)."""
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        os.rename(path, path.with_name(f".{path.name}.left-by-candidate.{os.urandom(8).hex()}"))
    _write_atomic(path, text)


def _train_record(export_dir: Path, mode: str) -> dict[str, Any]:
    """The train phase's record, checked for shape; Outcome if there is none."""
    blame = "failed" if mode in UNSANDBOXED else "error"  # there, the candidate could have removed it
    record = _json_object(_regular_file(export_dir / TRAIN_RECORD, RECORD_LIMIT_BYTES))
    if record.get("phase") != "train":
        raise Outcome(blame, "HarnessError", f"the train phase left no record in {export_dir / TRAIN_RECORD}")
    timing = record.get("timing") if isinstance(record.get("timing"), dict) else {}
    record["timing"] = {k: _number(timing.get(k)) for k in
                        ("startup_seconds", "training_seconds", "export_seconds", "tokens_served")}
    if not isinstance(record.get("outcome"), dict):
        record["outcome"] = None
    gpu = record.get("gpu_memory") if isinstance(record.get("gpu_memory"), dict) else {}
    record["gpu_memory"] = {"peak_mb": _number(gpu.get("peak_mb")), "samples": _number(gpu.get("samples")),
                            "how": gpu.get("how") if gpu.get("how") in ("nvml", "nvidia-smi") else None}
    record["had_gpu"] = record.get("had_gpu") is True
    return record


def evaluate_phase(candidate: str | os.PathLike, export_dir: str | os.PathLike, result_path: str | os.PathLike, *,
                   source: str | None = None, budget: float | None = None,
                   startup_allowance: float | None = None, log_path: str | os.PathLike | None = None,
                   termination_log: str | os.PathLike | None = None, curve_path: str | os.PathLike | None = None,
                   num_shards: int | None = None, endpoint: str | None = None, echo: bool = True,
                   sandbox_request: str = "bwrap", key: bytes | None = None, run: str | None = None,
                   eval_limit_seconds: float | None = None) -> dict[str, Any]:
    """--phase evaluate: the signed result of what a train phase left in export_dir."""
    result_path = Path(result_path)
    export_dir = Path(export_dir)
    source = source or os.environ.get("AUTOLAB_SOURCE") or "hub"
    curve = Path(curve_path) if curve_path else result_path.with_name(result_path.stem + ".curve.jsonl")
    log = RunLog(log_path, echo)
    result = _new_result(run, source)
    started = time.monotonic()
    # What the train phase was asked to run in (this phase runs no candidate; the record is not asked).
    mode = sandbox_request if sandbox_request in ("bwrap", "uid", "container", "none") else None

    def execute() -> None:
        _read_candidate(Path(candidate), result)
        budget_, startup, export = _allowances(budget, startup_allowance)
        result["limits"] = {"budget_seconds": budget_, "startup_allowance_seconds": startup,
                            "export_allowance_seconds": export,
                            "train_phase_seconds": round(train_phase_limit(budget_, startup, export), 1)}
        record = _train_record(export_dir, mode or "container")
        claimed = record.get("sandbox") if record.get("sandbox") in ("bwrap", "uid", "container", "none") else None
        result["sandbox"] = mode or claimed or "container"
        untrusted = result["sandbox"] not in ("bwrap", "uid")
        result["timing"] = record["timing"]
        if record.get("candidate_sha1") != result["candidate_sha1"]:
            raise Outcome("failed" if untrusted else "error", "HarnessError",
                          "the train phase ran another candidate than the one to evaluate")
        out = record["outcome"]
        if out:
            status = out.get("status") if out.get("status") in ("failed", "error") else "error"
            code = out.get("reason_code") if isinstance(out.get("reason_code"), str) else "HarnessError"
            exit_code = out.get("exit_code") if isinstance(out.get("exit_code"), int) else None
            raise Outcome(status, code[:64], str(out.get("reason"))[:2000], exit_code)
        result["exit_code"] = record.get("exit_code") if isinstance(record.get("exit_code"), int) else None
        training = record["timing"]["training_seconds"]
        if training is None:
            raise Outcome("failed" if untrusted else "error", "HarnessError",
                          "the train phase's record does not say how long the candidate trained")
        if training > budget_ + budget_slack(budget_):
            raise Outcome("failed", "BudgetExceeded",
                          f"the candidate trained for {training:.1f}s, measured by the harness of the train "
                          f"phase from its first batch, past its budget of {budget_:g}s "
                          f"(+{budget_slack(budget_):.1f}s slack)", result["exit_code"])
        try:  # the prepared data, read only (a Kubernetes evaluator mounts the cache read-only)
            src = prepare.make_source(source, num_shards=num_shards, endpoint=endpoint)
            data = prepare.load_prepared(prepare._data_dir(src, prepare.PROFILES[prepare.PROFILE]))
        except prepare.PrepareError as e:
            raise Outcome("error", "DataUnavailable", f"the prepared data ({source}) is not there: {e}") from e
        result["source"] = data.source
        _keep_curve(_regular_file("scratch/curve.jsonl", CURVE_LIMIT_BYTES, export_dir), curve, result)
        eval_dir = Path(tempfile.mkdtemp(prefix="autolab-eval-"))
        try:
            model_dir, stats = _take_export(export_dir, "scratch/", eval_dir, result["exit_code"])
            measuring = time.monotonic()
            evaluation = _measure(eval_dir, model_dir, data, log=log, exit_code=result["exit_code"],
                                  limit=eval_limit_seconds)
            result["timing"]["evaluate_seconds"] = round(time.monotonic() - measuring, 2)
        finally:
            shutil.rmtree(eval_dir, ignore_errors=True)
        elapsed = _number(record.get("elapsed_seconds")) or 0.0
        _succeeded(result, stats, evaluation, training=training, total=elapsed + time.monotonic() - started,
                   tokens=int(record["timing"]["tokens_served"] or 0), gpu=record["gpu_memory"],
                   had_gpu=record["had_gpu"], untrusted_timing=untrusted)

    _settle(result, execute)
    return _finish(result, result_path, log=log, key=key, termination_log=termination_log)


def _read_key(key_fd: int | None, key_file: str | None) -> bytes | None:
    if key_fd is not None:
        with os.fdopen(key_fd, "rb") as f:
            return f.read(KEY_LIMIT_BYTES)
    if key_file:
        raw = _regular_file(key_file, KEY_LIMIT_BYTES, follow=True)
        if raw is None:
            raise SystemExit(f"cannot read the key file {key_file}")
        return raw.strip()
    return None


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _sha1_arg(text: str) -> str:
    if len(text) != 40 or any(c not in "0123456789abcdef" for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a sha1 (40 lowercase hex digits)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one candidate train.py under the benchmark's rules.")
    parser.add_argument("--phase", choices=PHASES, default="all",
                        help="all (default) | stage | train | evaluate: see the module docstring")
    parser.add_argument("--candidate", default=None, help="the candidate train.py (all, train, evaluate)")
    parser.add_argument("--result", default=None, help="where to write the result JSON (all, evaluate)")
    parser.add_argument("--train-data", default=None, help="stage, train: the staged training data directory")
    parser.add_argument("--export-dir", default=None,
                        help="train, evaluate: the directory the candidate's scratch and the train record live in")
    parser.add_argument("--source", default=None, help="hub | synthetic | dir:PATH (default $AUTOLAB_SOURCE or hub)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"training seconds (default: the profile's, {prepare.TIME_BUDGET:g})")
    parser.add_argument("--startup-allowance", type=float, default=None,
                        help="seconds from the start to the first training batch (default: the profile's, "
                             f"{prepare.PROFILES[prepare.PROFILE].startup_allowance:g})")
    parser.add_argument("--log", default=None, help="also append all output to this file")
    parser.add_argument("--termination-log", default=None,
                        help=f"compact result goes here (default {TERMINATION_LOG} if it exists and is writable)")
    parser.add_argument("--curve", default=None, help="JSONL step curve (default <result stem>.curve.jsonl)")
    parser.add_argument("--num-shards", type=int, default=None, help="hub source: training shards")
    parser.add_argument("--endpoint", default=None, help="hub source: Hub endpoint (default $HF_ENDPOINT)")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the run directory (export, copy)")
    parser.add_argument("--sandbox", choices=SANDBOX_MODES, default="bwrap",
                        help="bwrap (default): refuse to run unsandboxed; uid: another uid without namespaces "
                             "(as root); isolated: bwrap, else uid; container: the caller's container is the "
                             "boundary; none: no boundary")
    parser.add_argument("--key-fd", type=int, default=None,
                        help="read the result-signing key from this file descriptor (then close it)")
    parser.add_argument("--key-file", default=None, help="read the result-signing key from this file")
    parser.add_argument("--run", default=None, help="the run's name, recorded in the signed result")
    parser.add_argument("--seed", type=int, default=0,
                        help="the harness's seed: 0 for a measured run, 1, 2, ... for repeat runs of one "
                             "program (data offset and $AUTOLAB_SEED)")
    parser.add_argument("--compile-cache-from", default=None, type=_sha1_arg, metavar="SHA1",
                        help="the sha1 of the lab's starting train.py (its owner's code, not an agent's): a run "
                             "of exactly those bytes keeps its compile cache, and every run starts with a copy "
                             "(phase all)")
    parser.add_argument("--starting-program", default=None, metavar="PATH",
                        help="with --compile-cache-from: the starting train.py's bytes (their sha1 must be that "
                             "one); where no compile cache of it is kept yet, the harness first runs it in the "
                             "sandbox up to its first batch to compile and keep one (phase all; not a measurement)")
    parser.add_argument("--gate", default=None, metavar="FILE",
                        help="phase all: the candidate's first batch waits while FILE exists (the controller "
                             "started this run while the one before it on the GPU is evaluated); the wait is "
                             "not start-up time")
    parser.add_argument("--gate-owner-fd", type=int, default=None, metavar="FD",
                        help="with --gate: the read end of a pipe the controller holds open; at its end of file "
                             "(the controller is gone) a run still waiting at its gate gives up (an error)")
    parser.add_argument("--handover", default=None, metavar="FILE",
                        help="phase all: written once the candidate is gone and the evaluator holds its GPU "
                             "memory: from then on the next run may start up on this GPU")
    parser.add_argument("--handback", default=None, metavar="FILE",
                        help="phase all, with --handover: an evaluation that runs out of time after the "
                             "handover writes FILE and waits until it is removed (the controller stopped the "
                             "next run), then is measured again alone")
    parser.add_argument("--eval-limit", type=_seconds_arg, default=None, metavar="SECONDS",
                        help="all, evaluate: the evaluation may take at most this long, if less than the "
                             "profile's eval_timeout (the controller bounds a candidate by the master's own "
                             "evaluation time)")
    args = parser.parse_args(argv)
    need = {"all": ("candidate", "result"), "stage": ("train_data",),
            "train": ("candidate", "train_data", "export_dir"), "evaluate": ("candidate", "result", "export_dir")}
    missing = [f"--{n.replace('_', '-')}" for n in need[args.phase] if getattr(args, n) is None]
    if missing:
        parser.error(f"--phase {args.phase} needs {' '.join(missing)}")
    if args.phase == "stage":
        status = stage_data(args.train_data, source=args.source, num_shards=args.num_shards,
                            endpoint=args.endpoint, log_path=args.log, termination_log=args.termination_log)
        return EXIT_SUCCEEDED if status["ok"] else EXIT_HARNESS_ERROR
    if args.phase == "train":
        record = train_phase(args.candidate, args.export_dir, args.train_data, budget=args.budget,
                             startup_allowance=args.startup_allowance, sandbox_request=args.sandbox,
                             log_path=args.log, seed=args.seed)
        return EXIT_SUCCEEDED if record["written"] else EXIT_HARNESS_ERROR
    key = _read_key(args.key_fd, args.key_file)
    if args.phase == "evaluate":
        result = evaluate_phase(
            args.candidate, args.export_dir, args.result, source=args.source, budget=args.budget,
            startup_allowance=args.startup_allowance, log_path=args.log, termination_log=args.termination_log,
            curve_path=args.curve, num_shards=args.num_shards, endpoint=args.endpoint,
            sandbox_request=args.sandbox, key=key, run=args.run, eval_limit_seconds=args.eval_limit,
        )
        return EXIT_CODES[result["status"]]
    result = run_candidate(
        args.candidate, args.result, source=args.source, budget=args.budget,
        startup_allowance=args.startup_allowance, log_path=args.log, termination_log=args.termination_log,
        curve_path=args.curve, num_shards=args.num_shards, endpoint=args.endpoint, keep_run_dir=args.keep_run_dir,
        sandbox_request=args.sandbox, key=key, run=args.run, seed=args.seed,
        compile_from=args.compile_cache_from, starting_program=args.starting_program, gate=args.gate,
        gate_owner_fd=args.gate_owner_fd, handover=args.handover,
        handback=args.handback, eval_limit_seconds=args.eval_limit,
    )
    return EXIT_CODES[result["status"]]


if __name__ == "__main__":
    sys.exit(main())

"""The run harness: the one entry point every backend runs for an experiment.

    python -I bench/run.py --candidate PATH/train.py --result PATH/result.json
                           [--source SRC] [--budget SECONDS] [--startup-allowance SECONDS]
                           [--log PATH] [--termination-log PATH] [--curve PATH]
                           [--num-shards N] [--endpoint URL] [--keep-run-dir]
                           [--sandbox auto|bwrap|none] [--key-fd FD] [--run NAME]

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
   export allowance after training.
3. When the sandbox's first process exits the kernel kills every process left
   in its PID namespace; the harness checks that none is left before it goes
   on (`ProcessesLeft`).
4. Moves the exported model out of the scratch directory (regular files only)
   and measures val_bpb in a separate evaluator process (`python -I
   evaluate.py`, this directory's own copy) that runs no candidate code and
   refuses archives that would. The metric comes only from there.
5. Writes one result JSON, atomically, always: signed (HMAC-SHA256) when the
   controller passed a key on --key-fd, and the same JSON, compact and at most
   4 KiB, to the termination log (Kubernetes reads it from the Pod). The
   informational figures are the harness's own (training_seconds,
   total_seconds, total_tokens_M, num_params_M) or listed in
   result["self_reported"] (the candidate's stats.json: peak_vram_mb,
   mfu_percent, num_steps, depth).

`--sandbox none` runs the candidate as a plain child (the container is the
boundary, or the user said --unsafe-no-sandbox); the result says so.

Exit codes: EXIT_SUCCEEDED (0); EXIT_CANDIDATE_FAILED (3: the candidate
crashed, ran out of time, diverged, exported nothing or an unusable model;
retrying will not help); EXIT_HARNESS_ERROR (4: data, cache, sandbox or
machine problem; retryable). argparse usage errors exit 2 before anything runs.

No torch here: the harness process stays small and starts fast.
"""

from __future__ import annotations

import argparse
import collections
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
SELF_REPORTED = ("peak_vram_mb", "mfu_percent", "num_steps", "depth")  # from the candidate's stats.json
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_LIMIT = 4096  # bytes Kubernetes keeps of a termination message
HARNESS_FILES = ("prepare.py", "run.py", "evaluate.py", "sandbox.py")
KILL_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
RESULT_MARKER = "AUTOLAB_RESULT"  # the harness's last stdout line: marker + compact result JSON
LOG_LIMIT_BYTES = 16 * 2**20  # candidate output kept in the log; the rest is counted, not written
CURVE_LIMIT_BYTES = 2**20  # the step curve read back from the scratch directory
EXPORT_LIMIT_BYTES = 8 * 2**30  # model.pt2
STATS_LIMIT_BYTES = 2**16  # stats.json


def budget_slack(budget: float) -> float:
    """Training time past the budget that is still on time: the last step may overrun it."""
    return 1.0 + 0.01 * budget


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


class DataServer:
    """Streams the training split to the candidate over a socket and notes the time.

    The candidate asks for n tokens at a time (prepare.make_loader); it gets the
    next n of a sequential pass over train.bin from a seeded offset, wrapping at
    the end. The first request starts the harness's clock; a "done" request (or
    the end of the connection) stops it, and nothing more is served.
    """

    def __init__(self, tokens, conn: socket.socket, seed: int) -> None:
        self.tokens, self.conn = tokens, conn
        self.pos = seed % max(1, len(tokens))
        self.first: float | None = None
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
                    self.first = time.monotonic()
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
        self.started = self.ended = 0.0
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.namespace: str | None = None


def _run_sandboxed(argv: list[str], *, cwd: Path, env: dict[str, str], pass_fds: tuple[int, ...],
                   server: DataServer, budget: float, startup: float, export: float,
                   log: RunLog, limits: sandbox.Limits, info_fd: int | None, info_r: int | None) -> Watch:
    """Start argv, stream its output, enforce the deadlines; returns when it has exited."""
    w = Watch()
    fds = pass_fds + ((info_fd,) if info_fd is not None else ())
    w.started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=fds,
                            preexec_fn=lambda: sandbox.set_limits(limits))

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            text = raw[:4000].decode("utf-8", errors="replace").rstrip("\n")
            w.tail.append(text)
            log.candidate(text)

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
    while proc.poll() is None:
        now = time.monotonic()
        if server.first is None and now - w.started > startup:
            w.killed = (f"it asked for no training data within the start-up allowance of {startup:g}s "
                        "(compile and warm up take place before the first batch)")
        elif server.first is not None and server.done is None and now - server.first > train_limit:
            w.killed = f"it trained past its budget of {budget:g}s (+{budget_slack(budget):.1f}s slack)"
        elif server.done is not None and now - server.done > export:
            w.killed = f"it ran {export:g}s past the end of training (the export allowance)"
        if w.killed:
            _kill(proc)
            break
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()
    w.ended = time.monotonic()
    w.rc = proc.returncode
    reader.join(timeout=5.0)
    proc.stdout.close()
    return w


def _regular_file(path: Path, limit: int) -> bytes | None:
    """The bytes of path if it is a regular file (no symlink) of at most limit bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def _copy_regular(src: Path, dst: Path, limit: int) -> bool:
    """Copy src (a regular file, not a link, at most limit bytes) to dst; False if it is not one."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return False
        with os.fdopen(fd, "rb", closefd=False) as f, open(dst, "wb") as out:
            shutil.copyfileobj(f, out, 2**22)
        return True
    finally:
        os.close(fd)


def _curve(raw: bytes | None) -> list[dict]:
    """The candidate's step curve, kept only as well-formed numbers (it is informational)."""
    lines = []
    for text in (raw or b"").decode("utf-8", errors="replace").splitlines():
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if isinstance(d, dict) and all(isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool)
                                       and math.isfinite(d[k]) for k in ("step", "loss", "tokens_per_sec")):
            lines.append({k: d[k] for k in ("step", "loss", "tokens_per_sec", "time") if k in d})
    return lines


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _metrics(stats: dict[str, Any], evaluation: dict[str, Any], *, training: float, total: float,
             tokens: int) -> dict:
    """The result's metrics: the harness's own figures, and the candidate's informational ones."""
    metrics: dict[str, Any] = {k: _number(stats.get(k)) for k in METRIC_KEYS}
    metrics.update(val_bpb=evaluation["val_bpb"], training_seconds=round(training, 2),
                   total_seconds=round(total, 1), total_tokens_M=round(tokens / 1e6, 3),
                   num_params_M=round(evaluation["num_params"] / 1e6, 3))
    for key, digits in (("peak_vram_mb", 1), ("mfu_percent", 2)):
        if metrics[key] is not None:
            metrics[key] = round(metrics[key], digits)
    for key in ("num_steps", "depth"):
        if metrics[key] is not None:
            metrics[key] = int(metrics[key])
    return metrics


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


def _execute(candidate: Path, *, source: str, budget: float | None, startup_allowance: float | None,
             curve_path: Path, num_shards: int | None, endpoint: str | None, keep_run_dir: bool,
             mode: str, log: RunLog, result: dict[str, Any]) -> None:
    code = _regular_file(candidate, 2**22)
    if code is None:
        raise Outcome("error", "HarnessError", f"cannot read the candidate {candidate} (a regular file of at most 4 MiB)")
    result["candidate_sha1"] = hashlib.sha1(code).hexdigest()
    harness_hashes = {name: _sha256(BENCH_DIR / name) for name in HARNESS_FILES}
    prof = prepare.PROFILES[prepare.PROFILE]
    budget = float(budget if budget is not None else prepare.TIME_BUDGET)
    startup = float(startup_allowance if startup_allowance is not None else prof.startup_allowance)
    export = prof.export_allowance
    if not (budget > 0 and startup >= 0):
        raise Outcome("error", "HarnessError", f"budget must be > 0 and start-up allowance >= 0, not {budget} and {startup}")

    try:
        data = prepare.prepare(source, num_shards=num_shards, endpoint=endpoint, verify="full",
                               log=lambda m: log.harness(m))
    except prepare.PrepareError as e:
        raise Outcome("error", "DataUnavailable", f"preparing the data ({source}) failed: {e}") from e
    result["source"] = data.source

    run_dir = Path(tempfile.mkdtemp(prefix="autolab-run-"))
    cleanup = [run_dir]
    try:
        scratch = run_dir / "scratch"
        scratch.mkdir()
        (scratch / "train.py").write_bytes(code)  # the bytes that were hashed are the bytes that run
        sandbox.prepare_scratch(scratch)
        sandboxed = mode == "bwrap"
        where = Path(sandbox.SCRATCH) if sandboxed else scratch
        gpu = bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
        env = _harness_env()
        env.update({
            "HOME": str(where), "TMPDIR": str(where / "tmp"), "USER": "autolab", "LOGNAME": "autolab",
            "PYTHONPATH": sandbox.HARNESS if sandboxed else str(BENCH_DIR),
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
            "AUTOLAB_BENCH_PROFILE": prepare.PROFILE, "AUTOLAB_SOURCE": data.source,
            "AUTOLAB_EXPORT_DIR": str(where / "export"), "AUTOLAB_CURVE_PATH": str(where / "curve.jsonl"),
            "AUTOLAB_TIME_BUDGET": repr(budget),
        })
        # The compile cache is the run's own: a shared one is a place to leave something for the next run.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(where / "compile")
        env["TRITON_CACHE_DIR"] = str(where / "triton")
        if prepare.PROFILE == "tiny":
            # Toy tensors gain nothing from threads, and spinning OpenMP threads on a busy CPU
            # make each step tens of times slower: one thread keeps tiny runs steady.
            env.setdefault("OMP_NUM_THREADS", "1")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env[prepare.DATA_FD_ENV] = str(theirs.fileno())
        seed = int.from_bytes(os.urandom(4), "little")
        server = DataServer(data.tokens("train"), ours, seed).start()
        limits = sandbox.Limits(address_space=None if gpu else _memory_limit())
        python = [sys.executable, "-s", "-P", "train.py"]
        info_r = info_w = None
        if sandboxed:
            info_r, info_w = os.pipe()
            argv = sandbox.command(python, scratch=scratch, harness=BENCH_DIR, gpu=gpu)
            argv[1:1] = ["--info-fd", str(info_w)]
        else:
            argv = python
        log.harness(f"running candidate {result['candidate_sha1'][:12]} ({prepare.PROFILE} profile, budget "
                    f"{budget:g}s, {'sandboxed' if sandboxed else 'NOT sandboxed'})")
        try:
            w = _run_sandboxed(argv, cwd=scratch, env=env, pass_fds=(theirs.fileno(),), server=server,
                               budget=budget, startup=startup, export=export, log=log, limits=limits,
                               info_fd=info_w, info_r=info_r)
        finally:
            theirs.close()
        if info_r is not None:
            os.close(info_r)
        ours.close()
        server.thread.join(timeout=5.0)
        result["exit_code"] = w.rc
        if log.dropped:
            log.harness(f"{log.dropped} more lines of output were not kept (log limit {LOG_LIMIT_BYTES} bytes)")

        left = _survivors(w.namespace)
        if sandboxed and not w.namespace:
            raise Outcome("error", "SandboxUnavailable", "the sandbox did not report its PID namespace; "
                                                         "cannot check that no candidate process is left", w.rc)
        if left:
            raise Outcome("failed", "ProcessesLeft", f"{len(left)} process(es) of the candidate outlived it and "
                                                     "were killed; the run is void", w.rc)
        changed = [n for n, h in harness_hashes.items() if _sha256(BENCH_DIR / n) != h]
        if changed:
            raise Outcome("error", "HarnessTampered", f"the harness file(s) {', '.join(changed)} in {BENCH_DIR} "
                                                      "changed while the candidate ran; the run is void", w.rc)
        first, done = server.first, server.done or w.ended
        training = (done - first) if first is not None else 0.0
        result["timing"] = {"startup_seconds": round((first or w.ended) - w.started, 2),
                            "training_seconds": round(training, 2),
                            "export_seconds": round(w.ended - done, 2) if first is not None else None,
                            "tokens_served": server.served}
        if w.killed:
            code_ = "BudgetExceeded"
            raise Outcome("failed", code_, f"the candidate was killed: {w.killed}")
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

        curve = _curve(_regular_file(scratch / "curve.jsonl", CURVE_LIMIT_BYTES))
        if curve:
            curve_path.parent.mkdir(parents=True, exist_ok=True)
            curve_path.write_text("".join(json.dumps(c) + "\n" for c in curve))
            result["curve"] = str(curve_path)

        # Out of the scratch directory into one the candidate never saw; nothing of it runs now.
        eval_dir = Path(tempfile.mkdtemp(prefix="autolab-eval-"))
        cleanup.append(eval_dir)
        export_dir = eval_dir / "export"
        export_dir.mkdir()
        if not _copy_regular(scratch / "export" / "model.pt2", export_dir / "model.pt2", EXPORT_LIMIT_BYTES):
            raise Outcome("failed", "NoExport", "the candidate finished without exporting its model "
                                                "(train.py must call prepare.export_model(model, stats) at the end)",
                          w.rc)
        raw_stats = _regular_file(scratch / "export" / "stats.json", STATS_LIMIT_BYTES)
        try:
            stats = json.loads(raw_stats) if raw_stats else {}
        except ValueError:
            stats = {}
        if not isinstance(stats, dict):
            stats = {}
        if not keep_run_dir:
            shutil.rmtree(scratch, ignore_errors=True)

        eval_env = _harness_env()
        if prepare.PROFILE == "tiny":
            eval_env.setdefault("OMP_NUM_THREADS", "1")
        eval_env.update({"PYTHONUNBUFFERED": "1", "AUTOLAB_BENCH_PROFILE": prepare.PROFILE,
                         "AUTOLAB_CACHE": str(prepare.cache_root()), "HOME": str(eval_dir)})
        out = eval_dir / "evaluation.json"
        log.harness("measuring val_bpb of the exported model in a separate evaluator process")
        eval_rc, eval_timed_out, eval_tail = _child(
            [sys.executable, "-I", str(BENCH_DIR / "evaluate.py"), "--export-dir", str(export_dir),
             "--data-dir", str(data.path), "--val-sha256", data.sha256("val.bin"),
             "--token-bytes-sha256", data.sha256("token_bytes.npy"), "--out", str(out)],
            cwd=eval_dir, env=eval_env, timeout=prof.eval_timeout, log=log, prefix="[evaluate] ",
        )
        total_seconds = time.monotonic() - w.started
        if eval_timed_out:
            raise Outcome("failed", "EvaluationFailed", f"evaluating the exported model took longer than "
                                                        f"{prof.eval_timeout:g}s", w.rc)
        try:
            evaluation = json.loads(out.read_text())
        except (OSError, ValueError):
            raise Outcome("failed", "EvaluationFailed", f"the evaluator could not run the exported model (exit "
                                                        f"code {eval_rc}): {_last_words(eval_tail)}", w.rc) from None
        if not evaluation.get("ok"):
            status = "error" if evaluation.get("blame") == "harness" else "failed"
            raise Outcome(status, evaluation.get("reason_code") or "EvaluationFailed",
                          f"evaluation failed: {evaluation.get('reason')}", w.rc)
        result["metrics"] = _metrics(stats, evaluation, training=training, total=total_seconds,
                                     tokens=server.served)
        result["self_reported"] = [k for k in SELF_REPORTED if result["metrics"].get(k) is not None]
        result.update(status="succeeded", reason_code="Succeeded",
                      reason=f"val_bpb {evaluation['val_bpb']:.6f}, measured by the harness on the exported "
                             f"model ({evaluation['device']})")
    finally:
        if keep_run_dir:
            log.harness(f"run directory kept: {run_dir}")
            cleanup.remove(run_dir)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


def _survivors(namespace: str | None) -> list[int]:
    """Processes left in the candidate's PID namespace, killed. None can be left once its init
    exits (the kernel kills them); a zombie being reaped gets a moment to go."""
    deadline = time.monotonic() + 2.0
    left = sandbox.survivors(namespace)
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
        left = sandbox.survivors(namespace)
    return left


def _child(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, log: RunLog,
           prefix: str = "") -> tuple[int | None, bool, list[str]]:
    """Run a trusted helper (the evaluator) in its own process group; (exit code, timed out, last lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            tail.append(text)
            log.candidate(text, prefix)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill(proc)
    reader.join(timeout=5.0)
    proc.stdout.close()
    return (None if timed_out else proc.returncode), timed_out, list(tail)


def _last_words(tail: list[str]) -> str:
    lines = [t.strip() for t in tail if t.strip()]
    return lines[-1][:500] if lines else "(no output)"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
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
    """"bwrap" or "none"; "auto" picks bwrap where it works. Raises Outcome if bwrap was asked for
    and cannot run here."""
    if requested == "none":
        return "none"
    why = sandbox.available()
    if why is None:
        return "bwrap"
    if requested == "auto":
        return "none"
    raise Outcome("error", "SandboxUnavailable", f"cannot sandbox the candidate: {why}")


def run_candidate(candidate: str | os.PathLike, result_path: str | os.PathLike, *, source: str | None = None,
                  budget: float | None = None, startup_allowance: float | None = None,
                  log_path: str | os.PathLike | None = None, termination_log: str | os.PathLike | None = None,
                  curve_path: str | os.PathLike | None = None, num_shards: int | None = None,
                  endpoint: str | None = None, keep_run_dir: bool = False, echo: bool = True,
                  sandbox_request: str = "auto", key: bytes | None = None, run: str | None = None) -> dict[str, Any]:
    """Run one candidate end to end and return the result (also written to result_path).

    source defaults to $AUTOLAB_SOURCE or "hub"; budget to prepare.TIME_BUDGET;
    the curve goes to curve_path, by default `<result stem>.curve.jsonl` next
    to the result. Never raises for a failed candidate: see result["status"].
    """
    result_path = Path(result_path)
    source = source or os.environ.get("AUTOLAB_SOURCE") or "hub"
    curve = Path(curve_path) if curve_path else result_path.with_name(result_path.stem + ".curve.jsonl")
    log = RunLog(log_path, echo)
    result: dict[str, Any] = {
        "version": RESULT_VERSION, "run": run, "status": "error", "reason_code": "HarnessError", "reason": "",
        "exit_code": None, "candidate_sha1": None, "profile": prepare.PROFILE, "source": source,
        "sandbox": None, "metrics": None, "curve": None,
    }
    try:
        mode = sandbox_mode(sandbox_request)
        result["sandbox"] = mode
        _execute(Path(candidate), source=source, budget=budget, startup_allowance=startup_allowance,
                 curve_path=curve, num_shards=num_shards, endpoint=endpoint, keep_run_dir=keep_run_dir,
                 mode=mode, log=log, result=result)
    except Outcome as o:
        result.update(status=o.status, reason_code=o.code, reason=o.reason)
        if o.exit_code is not None:
            result["exit_code"] = o.exit_code
    except Exception as e:  # a harness bug or a machine problem: retryable
        result.update(status="error", reason_code="HarnessError", reason=f"harness error: {type(e).__name__}: {e}")
    if result["status"] != "succeeded":
        result.pop("metrics", None)
    if result.get("sandbox") == "none":
        result["reason"] += " (the candidate ran WITHOUT a sandbox)"
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
    log.line(f"{RESULT_MARKER} {compact(result)}")
    log.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one candidate train.py under the benchmark's rules.")
    parser.add_argument("--candidate", required=True, help="the candidate train.py")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
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
    parser.add_argument("--sandbox", choices=["auto", "bwrap", "none"], default="bwrap",
                        help="bwrap (default): refuse to run unsandboxed; none: the caller isolates the run")
    parser.add_argument("--key-fd", type=int, default=None,
                        help="read the result-signing key from this file descriptor (then close it)")
    parser.add_argument("--run", default=None, help="the run's name, recorded in the signed result")
    args = parser.parse_args(argv)
    key = None
    if args.key_fd is not None:
        with os.fdopen(args.key_fd, "rb") as f:
            key = f.read(256)
    result = run_candidate(
        args.candidate, args.result, source=args.source, budget=args.budget,
        startup_allowance=args.startup_allowance, log_path=args.log, termination_log=args.termination_log,
        curve_path=args.curve, num_shards=args.num_shards, endpoint=args.endpoint, keep_run_dir=args.keep_run_dir,
        sandbox_request=args.sandbox, key=key, run=args.run,
    )
    return EXIT_CODES[result["status"]]


if __name__ == "__main__":
    sys.exit(main())

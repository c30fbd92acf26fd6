"""The run harness: the one entry point every backend runs for an experiment.

    python bench/run.py --candidate PATH/train.py --result PATH/result.json
                        [--source SRC] [--budget SECONDS] [--startup-allowance SECONDS]
                        [--log PATH] [--termination-log PATH] [--curve PATH]
                        [--num-shards N] [--endpoint URL] [--keep-run-dir]

1. Prepares the data (in this process; idempotent, checksums verified).
2. Runs the candidate in a child process: `python -P train.py` in a fresh
   run directory holding a copy of the candidate's bytes, PYTHONPATH = this
   directory, so `import prepare` is always the trusted prepare.py next to
   this file. A hard deadline (budget + start-up allowance) kills the whole
   process group. Output streams line by line to stdout and to --log.
3. After the candidate exited: checks that the harness files and the
   validation data were not modified, then measures val_bpb of the model the
   candidate exported (prepare.export_model) in a separate evaluator process
   (evaluate.py) that runs no candidate code. The metric is only ever taken
   from there, never from the candidate's output.
4. Writes one result JSON, atomically, always; and the same JSON, compact and
   at most 4 KiB, to the termination log (Kubernetes reads it from the Pod).

Exit codes: EXIT_SUCCEEDED (0); EXIT_CANDIDATE_FAILED (3: the candidate
crashed, ran out of time, diverged, exported nothing or an unusable model;
retrying will not help); EXIT_HARNESS_ERROR (4: data, cache or machine
problem; retryable). argparse usage errors exit 2 before anything runs.

No torch here: the harness process stays small and starts fast.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import shutil
import signal
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

EXIT_SUCCEEDED = 0
EXIT_CANDIDATE_FAILED = 3
EXIT_HARNESS_ERROR = 4
EXIT_CODES = {"succeeded": EXIT_SUCCEEDED, "failed": EXIT_CANDIDATE_FAILED, "error": EXIT_HARNESS_ERROR}

RESULT_VERSION = 1
METRIC_KEYS = (
    "val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
    "total_tokens_M", "num_steps", "num_params_M", "depth",
)
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_LIMIT = 4096  # bytes Kubernetes keeps of a termination message
HARNESS_FILES = ("prepare.py", "run.py", "evaluate.py")
KILL_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL of a process group
RESULT_MARKER = "AUTOLAB_RESULT"  # the harness's last stdout line: marker + compact result JSON


class RunLog:
    """Lines to stdout and, if given, appended to a log file."""

    def __init__(self, path: str | os.PathLike | None, echo: bool = True) -> None:
        self.echo = echo
        self.file = None
        self.lock = threading.Lock()
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

    def harness(self, text: str) -> None:
        self.line(f"[bench] {text}")

    def close(self) -> None:
        if self.file:
            self.file.close()


class Outcome(Exception):
    """Ends a run early with a status and a reason for a person."""

    def __init__(self, status: str, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.exit_code = status, reason, exit_code


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _child(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, log: RunLog,
           prefix: str = "") -> tuple[int | None, bool, list[str]]:
    """Run cmd in its own process group, streaming its output; (exit code, timed out, last lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=30)

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            tail.append(text)
            log.line(prefix + text)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
    proc.wait()
    reader.join(timeout=5.0)
    proc.stdout.close()
    return (None if timed_out else proc.returncode), timed_out, list(tail)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _last_words(tail: list[str]) -> str:
    lines = [t.strip() for t in tail if t.strip()]
    return lines[-1][:500] if lines else "(no output)"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _metrics(stats: dict[str, Any], evaluation: dict[str, Any], total_seconds: float, deadline: float) -> dict:
    """The result's metrics: val_bpb, total_seconds and num_params_M from the harness; the rest
    from the candidate's stats (informational), training_seconds bounded by the deadline."""
    metrics: dict[str, Any] = {k: _number(stats.get(k)) for k in METRIC_KEYS}
    metrics["val_bpb"] = evaluation["val_bpb"]
    metrics["total_seconds"] = round(total_seconds, 1)
    metrics["num_params_M"] = round(evaluation["num_params"] / 1e6, 3)
    if metrics["training_seconds"] is not None:
        metrics["training_seconds"] = min(max(metrics["training_seconds"], 0.0), deadline)
    for key, digits in (("training_seconds", 2), ("peak_vram_mb", 1), ("mfu_percent", 2), ("total_tokens_M", 3)):
        if metrics[key] is not None:
            metrics[key] = round(metrics[key], digits)
    for key in ("num_steps", "depth"):
        if metrics[key] is not None:
            metrics[key] = int(metrics[key])
    return metrics


def _execute(candidate: Path, *, source: str, budget: float | None, startup_allowance: float | None,
             curve_path: Path, num_shards: int | None, endpoint: str | None, keep_run_dir: bool,
             log: RunLog, result: dict[str, Any]) -> None:
    try:
        code = candidate.read_bytes()
    except OSError as e:
        raise Outcome("error", f"cannot read the candidate {candidate}: {e}") from e
    result["candidate_sha1"] = hashlib.sha1(code).hexdigest()
    harness_hashes = {name: _sha256(BENCH_DIR / name) for name in HARNESS_FILES}
    budget = float(budget if budget is not None else prepare.TIME_BUDGET)
    allowance = float(startup_allowance if startup_allowance is not None
                      else prepare.PROFILES[prepare.PROFILE].startup_allowance)
    if not (budget > 0 and allowance >= 0):
        raise Outcome("error", f"budget must be > 0 and start-up allowance >= 0, not {budget} and {allowance}")
    deadline = budget + allowance

    try:
        data = prepare.prepare(source, num_shards=num_shards, endpoint=endpoint, verify="full",
                               log=lambda m: log.harness(m))
    except prepare.PrepareError as e:
        raise Outcome("error", f"preparing the data ({source}) failed: {e}") from e
    result["source"] = data.source

    run_dir = Path(tempfile.mkdtemp(prefix="autolab-run-"))
    cleanup = [run_dir]
    try:
        (run_dir / "train.py").write_bytes(code)  # the bytes that were hashed are the bytes that run
        export_dir = run_dir / "export"
        curve_path.unlink(missing_ok=True)
        curve_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": str(BENCH_DIR),
            "PYTHONUNBUFFERED": "1",
            "AUTOLAB_BENCH_PROFILE": prepare.PROFILE,
            "AUTOLAB_DATA_DIR": str(data.path),
            "AUTOLAB_SOURCE": data.source,
            "AUTOLAB_EXPORT_DIR": str(export_dir),
            "AUTOLAB_CURVE_PATH": str(curve_path),
            "AUTOLAB_TIME_BUDGET": repr(budget),
        })
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(prepare.cache_root() / "compile"))
        if prepare.PROFILE == "tiny":
            # Toy tensors gain nothing from threads, and spinning OpenMP threads on a busy CPU
            # make each step tens of times slower: one thread keeps tiny runs steady.
            env.setdefault("OMP_NUM_THREADS", "1")
        log.harness(f"running candidate {result['candidate_sha1'][:12]} ({prepare.PROFILE} profile, budget "
                    f"{budget:g}s, deadline {deadline:g}s) in {run_dir}")
        started = time.time()
        rc, timed_out, tail = _child([sys.executable, "-P", "train.py"], cwd=run_dir, env=env,
                                     timeout=deadline, log=log)
        result["exit_code"] = rc
        if curve_path.is_file() and curve_path.stat().st_size:
            result["curve"] = str(curve_path)

        changed = [n for n, h in harness_hashes.items() if _sha256(BENCH_DIR / n) != h]
        if changed:
            raise Outcome("failed", f"the harness file(s) {', '.join(changed)} in {BENCH_DIR} changed while the "
                                    "candidate ran; the run is void", rc)
        tampered = [n for n in ("val.bin", "token_bytes.npy") if _sha256(data.file(n)) != data.sha256(n)]
        if tampered:
            raise Outcome("failed", f"{', '.join(tampered)} in {data.path} changed while the candidate ran; "
                                    "the run is void (the cache is rebuilt on the next run)", rc)
        if timed_out:
            raise Outcome("failed", f"the candidate ran past its deadline of {deadline:g}s (budget {budget:g}s + "
                                    f"start-up allowance {allowance:g}s) and was killed")
        if rc != 0:
            raise Outcome("failed", f"the candidate exited with code {rc}: {_last_words(tail)}", rc)
        if not (export_dir / "model.pt2").is_file() or not (export_dir / "stats.json").is_file():
            raise Outcome("failed", "the candidate finished without exporting its model "
                                    "(train.py must call prepare.export_model(model, stats) at the end)", rc)
        try:
            stats = json.loads((export_dir / "stats.json").read_text())
            if not isinstance(stats, dict):
                raise ValueError("not an object")
        except ValueError as e:
            raise Outcome("failed", f"the candidate's stats.json is unreadable: {e}", rc) from e

        # A directory the candidate could not know (or plant files in) while it ran.
        eval_dir = Path(tempfile.mkdtemp(prefix="autolab-eval-"))
        cleanup.append(eval_dir)
        eval_env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLAB_")}
        if prepare.PROFILE == "tiny":
            eval_env.setdefault("OMP_NUM_THREADS", "1")
        eval_env.update({"PYTHONPATH": str(BENCH_DIR), "PYTHONUNBUFFERED": "1",
                         "AUTOLAB_BENCH_PROFILE": prepare.PROFILE, "AUTOLAB_CACHE": str(prepare.cache_root())})
        out = eval_dir / "evaluation.json"
        log.harness("measuring val_bpb of the exported model in a separate evaluator process")
        eval_rc, eval_timed_out, eval_tail = _child(
            [sys.executable, "-P", str(BENCH_DIR / "evaluate.py"), "--export-dir", str(export_dir),
             "--data-dir", str(data.path), "--val-sha256", data.sha256("val.bin"),
             "--token-bytes-sha256", data.sha256("token_bytes.npy"), "--out", str(out)],
            cwd=eval_dir, env=eval_env, timeout=prepare.PROFILES[prepare.PROFILE].eval_timeout, log=log,
            prefix="[evaluate] ",
        )
        total_seconds = time.time() - started
        if eval_timed_out:
            raise Outcome("failed", "evaluating the exported model took longer than "
                                    f"{prepare.PROFILES[prepare.PROFILE].eval_timeout:g}s", rc)
        try:
            evaluation = json.loads(out.read_text())
        except (OSError, ValueError):
            raise Outcome("failed", f"the evaluator could not run the exported model (exit code {eval_rc}): "
                                    f"{_last_words(eval_tail)}", rc) from None
        if not evaluation.get("ok"):
            status = "error" if evaluation.get("blame") == "harness" else "failed"
            raise Outcome(status, f"evaluation failed: {evaluation.get('reason')}", rc)
        result["metrics"] = _metrics(stats, evaluation, total_seconds, deadline)
        result["status"] = "succeeded"
        result["reason"] = (f"val_bpb {evaluation['val_bpb']:.6f}, measured by the harness on the exported "
                            f"model ({evaluation['device']})")
    finally:
        if keep_run_dir:
            log.harness(f"run directory kept: {run_dir}")
            cleanup.remove(run_dir)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


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


def default_termination_log() -> str | None:
    """/dev/termination-log when it exists and is writable (as in a Kubernetes container)."""
    return TERMINATION_LOG if os.path.isfile(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK) else None


def run_candidate(candidate: str | os.PathLike, result_path: str | os.PathLike, *, source: str | None = None,
                  budget: float | None = None, startup_allowance: float | None = None,
                  log_path: str | os.PathLike | None = None, termination_log: str | os.PathLike | None = None,
                  curve_path: str | os.PathLike | None = None, num_shards: int | None = None,
                  endpoint: str | None = None, keep_run_dir: bool = False, echo: bool = True) -> dict[str, Any]:
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
        "version": RESULT_VERSION, "status": "error", "reason": "", "exit_code": None, "candidate_sha1": None,
        "profile": prepare.PROFILE, "source": source, "metrics": None, "curve": None,
    }
    try:
        _execute(Path(candidate), source=source, budget=budget, startup_allowance=startup_allowance,
                 curve_path=curve, num_shards=num_shards, endpoint=endpoint, keep_run_dir=keep_run_dir,
                 log=log, result=result)
    except Outcome as o:
        result.update(status=o.status, reason=o.reason)
        if o.exit_code is not None:
            result["exit_code"] = o.exit_code
    except Exception as e:  # a harness bug or a machine problem: retryable
        result.update(status="error", reason=f"harness error: {type(e).__name__}: {e}")
    if result["status"] != "succeeded":
        result.pop("metrics", None)
    try:
        _write_atomic(result_path, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        result.pop("metrics", None)
        result.update(status="error", reason=f"cannot write the result {result_path}: {e}")
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
                        help="seconds beyond the budget before the candidate is killed (default: the profile's, "
                             f"{prepare.PROFILES[prepare.PROFILE].startup_allowance:g})")
    parser.add_argument("--log", default=None, help="also append all output to this file")
    parser.add_argument("--termination-log", default=None,
                        help=f"compact result goes here (default {TERMINATION_LOG} if it exists and is writable)")
    parser.add_argument("--curve", default=None, help="JSONL step curve (default <result stem>.curve.jsonl)")
    parser.add_argument("--num-shards", type=int, default=None, help="hub source: training shards")
    parser.add_argument("--endpoint", default=None, help="hub source: Hub endpoint (default $HF_ENDPOINT)")
    parser.add_argument("--keep-run-dir", action="store_true", help="keep the run directory (export, copy)")
    args = parser.parse_args(argv)
    result = run_candidate(
        args.candidate, args.result, source=args.source, budget=args.budget,
        startup_allowance=args.startup_allowance, log_path=args.log, termination_log=args.termination_log,
        curve_path=args.curve, num_shards=args.num_shards, endpoint=args.endpoint, keep_run_dir=args.keep_run_dir,
    )
    return EXIT_CODES[result["status"]]


if __name__ == "__main__":
    sys.exit(main())

"""Phases (`--phase`): so that a Kubernetes Pod can train in one container and
evaluate in another, with no candidate process surviving into evaluation:

- `all` (the default): everything run.py's docstring lists, in this process (harness_one_run).
- `stage`: prepare the data (the cache must be writable) and copy only what
  the train phase needs, train.bin and its record (data.json), into
  `--train-data` (never val.bin).
- `train`: run the candidate on the staged training data (streamed over the
  socket, timed as in phase all) with `--export-dir DIR/scratch` as its scratch
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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import prepare  # the trusted one, next to this file
import sandbox  # the trusted one, next to this file
from harness_candidate import SURVIVOR_GRACE_SECONDS, _living, sandbox_mode
from harness_common import (CURVE_LIMIT_BYTES, Outcome, RECORD_LIMIT_BYTES, RunLog, TERMINATION_LOG_LIMIT,
                            UNSANDBOXED, budget_slack, train_phase_limit)
from harness_evaluator import _gpu_memory, _measure
from harness_files import _json_object, _number, _open_regular, _regular_file
from harness_result import _finish, _new_result, _settle, _succeeded, _write_atomic, default_termination_log
from harness_train import (_allowances, _harness_hashes, _judge, _keep_curve, _prepared, _read_candidate,
                           _room_to_run, _take_export, _train)


STAGED_RECORD = "data.json"  # in --train-data, next to train.bin
TRAIN_RECORD = "record.json"  # in --export-dir, next to the candidate's scratch/


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

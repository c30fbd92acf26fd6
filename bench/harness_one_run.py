"""Phase all: prepare, (warm the compile cache,) train and evaluate a candidate in this process.

`run_candidate` is what `python -I run.py` does by default and what the Hugging Face entry point
calls in process. It writes one result whatever happens (see harness_result).

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
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import prepare  # the trusted one, next to this file
import sandbox  # the trusted one, next to this file
from harness_candidate import sandbox_mode
from harness_common import CURVE_LIMIT_BYTES, RunLog
from harness_compile_cache import _keep_compile_cache
from harness_evaluator import Evaluator, _early_evaluator, _gpu_memory, _measure
from harness_files import _regular_file
from harness_result import _finish, _new_result, _settle, _succeeded
from harness_stream import Gate
from harness_train import (_allowances, _harness_hashes, _judge, _keep_curve, _prepared, _read_candidate,
                           _room_to_run, _take_export, _train)
from harness_uid import _run_dir
from harness_warm_up import _warm_compile_cache


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

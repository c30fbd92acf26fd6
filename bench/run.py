"""The run harness: the one entry point every backend runs for an experiment.

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

This file is the entry: the command line and its phases. The harness is the files bench/HARNESS
lists, one concern each, pinned by a lab as one unit (controller/lab/harness.py):

    run.py                    the command line (this file)
    harness_common.py         exit codes, the result's shape, limits, the run log, Outcome, the manifest
    harness_stream.py         the training stream: data in over a socket, time measured, the gate
    harness_candidate.py      the candidate in its sandbox: start, watch, kill, nothing left; --sandbox
    harness_uid.py            uid mode: another uid, no namespaces
    harness_files.py          files the candidate could have touched: regular files only, no links
    harness_figures.py        the harness's own figures: MFU and GPU memory
    harness_compile_cache.py  the compile cache of the lab's starting program
    harness_warm_up.py        warming that cache on a fresh machine
    harness_train.py          a run up to its verdict on training: prepare, run, judge, take the export
    harness_evaluator.py      val_bpb, measured in a process that runs no candidate code
    harness_result.py         the result: signed, written atomically, the termination log
    harness_one_run.py        --phase all: everything, in this process (run_candidate)
    harness_phases.py         --phase stage | train | evaluate: one container each
    prepare.py, evaluate.py, sandbox.py   the data, the evaluator, the sandbox's command line
    prepare_*.py, evaluate_*.py           their parts, one concern each (see their docstrings)

`python -I` puts neither this file's directory nor the working directory on sys.path. This
file puts its own directory first, so its siblings are imported from the pinned copy beside
it and from nowhere else: the candidate runs in another process, with its scratch directory as
its working directory, and nothing of it is on this path.

The candidate `train.py` is hostile code that wants a lower number. The harness
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
   where the machine hides them (see harness_figures).
   What the candidate said is kept apart in result["reported"], and how the
   harness's figures came about in result["measured"].

The compile cache (harness_compile_cache, harness_warm_up), starting up during the previous
run's evaluation (harness_one_run), the sandboxes (harness_candidate) and the phases
(harness_phases) are described where they are done.

Exit codes: EXIT_SUCCEEDED (0); EXIT_CANDIDATE_FAILED (3: the candidate
crashed, ran out of time, diverged, exported nothing or an unusable model;
retrying will not help); EXIT_HARNESS_ERROR (4: data, cache, sandbox or
machine problem; retryable). argparse usage errors exit 2 before anything runs.
The stage phase exits 0 or 4, the train phase 0 once its record is written.

No torch here: the harness process stays small and starts fast.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # -I left it off: the siblings come from here, first (see above)


def _own_modules() -> None:
    """Forget a harness module imported from another directory (a caller that ran another copy of
    the harness in this process): this copy runs with its own siblings only."""
    for name in list(sys.modules):
        path = getattr(sys.modules[name], "__file__", None)
        if name.startswith("harness_") and path and Path(path).resolve().parent != BENCH_DIR:
            del sys.modules[name]


_own_modules()

import prepare  # noqa: E402  (the trusted one, next to this file)
from harness_common import (EXIT_CANDIDATE_FAILED, EXIT_CODES, EXIT_HARNESS_ERROR,  # noqa: E402,F401  (its exit codes)
                            EXIT_SUCCEEDED, KEY_LIMIT_BYTES, PHASES, SANDBOX_MODES, TERMINATION_LOG)
from harness_files import _regular_file  # noqa: E402
from harness_one_run import run_candidate  # noqa: E402
from harness_phases import evaluate_phase, stage_data, train_phase  # noqa: E402
from harness_result import compact  # noqa: E402,F401  (for in-process callers: bench/hf_entry.py)


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
                        help="all (default) | stage | train | evaluate: see bench/harness_phases.py")
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

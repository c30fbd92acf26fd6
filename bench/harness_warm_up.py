"""Warming the compile cache on a fresh machine: the starting program, run up to its first batch.

`--starting-program PATH`, with `--compile-cache-from`. A lab resumed on a new host has measured its master
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
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import sandbox  # the trusted one, next to this file
from harness_candidate import Watch, _last_words
from harness_common import BENCH_DIR, Outcome, RunLog, _sha256
from harness_compile_cache import CACHE_DIRS, _keep_compile_cache, seed_cache_entry
from harness_files import _regular_file
from harness_stream import DataServer
from harness_train import _train
from harness_uid import _run_dir


# --starting-program: the largest train.py the warm-up reads (as for a candidate).
PROGRAM_LIMIT_BYTES = 2**22


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
    what it compiled (see the module docstring).
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

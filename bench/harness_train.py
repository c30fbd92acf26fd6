"""The parts of a run up to its verdict on training: read the candidate, prepare the data, run it, judge it.

`_train` runs the candidate in the chosen sandbox with its scratch as its directory and the data
stream as its only data; it returns once no process of it is left. `_judge` turns what happened
into the training time or an `Outcome`: an unfit sandbox, a process that outlived it, a harness
file that changed while it ran (`HarnessTampered`: every file of the manifest is hashed before
and after), a run over its budget. `_take_export` moves what it exported out of its reach.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import prepare  # the trusted one, next to this file
import sandbox  # the trusted one, next to this file
from harness_candidate import Watch, _harness_env, _last_words, _memory_limit, _run_sandboxed, _survivors
from harness_common import (BENCH_DIR, EXPORT_LIMIT_BYTES, LOG_LIMIT_BYTES, STATS_LIMIT_BYTES, Outcome, RunLog,
                            _sha256, budget_slack, harness_files)
from harness_compile_cache import CACHE_DIRS, _chown_tree, _seed_compile_cache
from harness_files import _copy_regular, _curve, _json_object, _regular_file
from harness_stream import DataServer, Gate
from harness_uid import _as_uid, _uid_preflight, _uid_workspace, sandbox_uid, sweep_uid


# Largest file a candidate may write (RLIMIT_FSIZE): its exported model and compile caches fit with room
# (the default profile's model.pt2 is ~0.2 GiB, the tiny one's ~2 MiB).
MAX_FILE_BYTES = {"tiny": 256 * 2**20, "default": 4 * 2**30}
# Free space a run needs where its scratch and its evaluator's directory are, checked before the
# candidate starts: its export, compile cache and their copies. Less is the machine's fault (an
# error), not a candidate that crashed writing its model.
MIN_FREE_BYTES = {"tiny": 64 * 2**20, "default": 2 * 2**30}


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
    return {name: _sha256(BENCH_DIR / name) for name in harness_files()}


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
        _uid_preflight(uid, scratch, [BENCH_DIR, *(BENCH_DIR / n for n in harness_files()), *hidden])
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

"""The evaluator: val_bpb measured in a process that runs no candidate code.

`Evaluator` starts `python -I evaluate.py` (this directory's own copy), which refuses archives
that would run code, and hands it the export once the candidate is gone. The metric comes only
from there. An evaluator that dies before it is ready (before it read anything of the export)
died of its machine: it is started once more, then it is an error.

The evaluation's time limit is the profile's `eval_timeout`, or `--eval-limit
SECONDS` where the controller asks for less: it bounds a candidate by the
master's own evaluation time (a few times it), so a model that is legal but
slow to score cannot hold a GPU for the profile's whole limit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import prepare  # the trusted one, next to this file
import sandbox  # the trusted one, next to this file
from harness_candidate import _harness_env, _kill, _last_words, _lines
from harness_common import BENCH_DIR, Outcome, RunLog
from harness_figures import GpuMemory
from harness_uid import sandbox_uid


# --handback: how long an evaluation that ran out of time beside the next run's start-up waits for
# the controller to stop that run (it removes the handback file) before giving up: the local
# controller looks at its running runs about once a second.
HANDBACK_WAIT_SECONDS = 60.0

# The evaluator starts before the candidate where it has cores of its own: on a GPU machine its
# torch import and CUDA set-up then overlap the candidate's start-up (4-8 s off every run on an
# H200). A CPU run would make it compete with the candidate for the same cores (and the tests'
# runs for two of them): there it starts once training is over. "1"/"0" in the harness's
# environment says which, whatever the machine.
EARLY_EVALUATOR_ENV = "AUTOLAB_EARLY_EVALUATOR"


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


def _gpu_memory(mode: str, evaluator: Evaluator | None = None) -> GpuMemory:
    """The sampler of the candidate's GPU memory, started (see GpuMemory)."""
    return GpuMemory(exclude=(evaluator.proc.pid,) if evaluator is not None else (),
                     uid=sandbox_uid() if mode == "uid" else None).start()

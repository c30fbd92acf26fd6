"""What every part of the harness shares: its directory and manifest, the exit codes, the
result's shape, the limits on what it reads back, the run log and `Outcome`.

The harness is the files bench/HARNESS lists (and the manifest), pinned by a lab as one unit:
`harness_files()` reads that list, so the harness's own check that nothing changed it while a
candidate ran (`harness_train._harness_hashes`) covers every module, this one included. The
controller reads the same manifest (controller/lab/harness.py); the list lives only there.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent  # the harness's own directory: a lab's pinned copy
MANIFEST = "HARNESS"  # in BENCH_DIR: the harness's files, one a line ('#' starts a comment)

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

RESULT_MARKER = "AUTOLAB_RESULT"  # the harness's last stdout line: marker + compact result JSON
LOG_LIMIT_BYTES = 16 * 2**20  # candidate output kept in the log; the rest is counted, not written

CURVE_LIMIT_BYTES = 2**20  # the step curve read back from the scratch directory
EXPORT_LIMIT_BYTES = 8 * 2**30  # model.pt2
STATS_LIMIT_BYTES = 2**16  # stats.json
RECORD_LIMIT_BYTES = 2**16  # the train phase's record, the staged data's record
KEY_LIMIT_BYTES = 256

PHASES = ("all", "stage", "train", "evaluate")

SANDBOX_MODES = ("auto", "bwrap", "uid", "isolated", "container", "none")
UNSANDBOXED = ("container", "none")  # the candidate runs as the harness's own user

# Seconds of a train phase beyond the candidate's allowances: the harness's own start and
# finish, and the one-second resolution of the timestamps a Pod's status gives.
TRAIN_PHASE_OVERHEAD = 30.0


def harness_files() -> tuple[str, ...]:
    """The harness's files, as its manifest lists them, and the manifest."""
    text = (BENCH_DIR / MANIFEST).read_text()
    return (*(n for n in (line.split("#", 1)[0].strip() for line in text.splitlines()) if n), MANIFEST)


def kill_until_gone(find, seconds: float) -> list[int]:
    """SIGKILL whatever `find()` lists (pids) until it lists nothing or `seconds` have passed;
    returns what is still there. A process killed while it holds gigabytes takes a while to go
    on a loaded machine, so one SIGKILL and one look are not enough."""
    deadline = time.monotonic() + seconds
    left = find()
    while left and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
        left = find()
    return left


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

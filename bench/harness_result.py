"""The result: one JSON, written atomically, always; signed; and its compact copy for the termination log.

The result is signed (HMAC-SHA256 over the result without its signature) when the controller
passed a key the candidate never sees, and the same JSON, compact and at most 4 KiB (the reason
is cut to fit before signing), goes to the termination log (Kubernetes reads it from the Pod).
The harness's last stdout line is RESULT_MARKER and that compact JSON. `_settle` turns whatever
a run raised into the result's status; `time_breakdown` says where a run's seconds went.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import prepare  # the trusted one, next to this file
from harness_common import (METRIC_KEYS, Outcome, RESULT_MARKER, RESULT_VERSION, RunLog, TERMINATION_LOG,
                            TERMINATION_LOG_LIMIT)
from harness_figures import ALWAYS_SELF_REPORTED, _metrics, _reported, figures_line, peak_flops
from harness_files import _number


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

"""The harness's own figures: MFU and GPU memory.

What the candidate says of itself (its stats.json) is kept as it said it (result["reported"]),
never as a measurement. The harness measures what it can from outside the candidate's reach:

- MFU = tokens served x FLOPs per token / training seconds / the GPU's bf16 peak. The tokens
  are the ones the data server streamed (the loader's read-ahead of a few batches included:
  +0.3 % over the default 300 s), the seconds its own clock, the FLOPs per token the evaluator's count
  on the exported graph (evaluate.model_figures: train.py's formula), the peak the table below
  looked up by the name CUDA gives the evaluator's GPU. On a CPU, or a GPU not in the table,
  there is no peak and no MFU: empty, never the candidate's figure.
- Peak GPU memory: the driver's per-process figure (NVML, else `nvidia-smi`) for the
  candidate's processes, summed per reading, the largest of the readings taken every
  GPU_SAMPLE_SECONDS while it runs. It is what the process holds (CUDA context and the caching
  allocator's reserve included), more than torch.cuda.max_memory_allocated(), which train.py
  reports. The candidate's processes are this process's descendants outside the evaluator's
  (and, in uid mode, every process of the sandbox's uid).
- Depth and parameter count: from the exported model (the evaluator).

Where the harness cannot measure a figure it keeps the candidate's and lists it in
result["self_reported"]: the number of optimiser steps always, GPU memory where the driver
could not be read or shows no process of the candidate's (a container that hides host PIDs),
depth where the graph calls no scaled_dot_product_attention.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from typing import Any

from harness_common import METRIC_KEYS
from harness_files import _number


# Dense bf16 tensor-core peak FLOP/s (NVIDIA datasheets, without sparsity), matched against the
# GPU's name, longest key first. The harness's own copy: the one in train.py is the candidate's.
PEAK_BF16_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989.5e12,  # SXM
    "H200": 989.5e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "L4": 121e12,
}
ALWAYS_SELF_REPORTED = ("num_steps",)  # the harness sees no optimiser step
GPU_SAMPLE_SECONDS = 0.5  # between two readings of the driver's per-process GPU memory
NVIDIA_SMI_TIMEOUT = 10.0


def peak_flops(device_name: str | None) -> float | None:
    """The bf16 peak of a GPU by its name (None: a CPU, or a GPU the table does not know)."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


def harness_mfu(tokens: int, training: float, flops_per_token: Any, device_name: Any) -> float | None:
    """MFU in percent from the harness's own figures; None where one is missing."""
    peak = peak_flops(device_name if isinstance(device_name, str) else None)
    fpt = _number(flops_per_token)
    if not (peak and fpt and training > 0):
        return None
    return round(100 * tokens * fpt / training / peak, 2)


def _nvml_reader():
    """A function giving {pid: bytes of GPU memory} over every GPU, through NVML; None without it."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # not installed, no driver, no device
        return None

    def read() -> dict[int, int]:
        used: dict[int, int] = {}
        for handle in handles:
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if isinstance(proc.usedGpuMemory, int):  # None: not available to this caller
                    used[proc.pid] = used.get(proc.pid, 0) + proc.usedGpuMemory
        return used

    return read


def _nvidia_smi_reader():
    """The same through `nvidia-smi --query-compute-apps` (MiB); None if there is none."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None

    def read() -> dict[int, int]:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise OSError(f"nvidia-smi exited with {out.returncode}")
        used: dict[int, int] = {}
        for line in out.stdout.splitlines():
            pid, _, mib = (part.strip() for part in line.partition(","))
            try:
                used[int(pid)] = used.get(int(pid), 0) + int(float(mib) * 2**20)
            except ValueError:  # "[N/A]": not available to this caller
                continue
        return used

    return read


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])  # the name may hold ") "
    except (OSError, ValueError, IndexError):
        return None


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class GpuMemory:
    """The most GPU memory the candidate's processes held at one reading, read from the driver.

    Started before the candidate and stopped once it is gone; each reading lists the GPU's
    processes and sums those of the candidate's: this process's descendants, but none under an
    excluded process (the evaluator, which may get ready on the GPU meanwhile), and in uid mode
    any process of the sandbox's uid (one that left the tree). `stop()` gives
    {"peak_mb", "how", "samples"}: peak_mb None where the driver could not be read or never
    listed a process of the candidate's.
    """

    def __init__(self, exclude: tuple[int, ...] = (), uid: int | None = None,
                 interval: float = GPU_SAMPLE_SECONDS) -> None:
        self.root = os.getpid()
        self.exclude = set(exclude)
        self.uid = uid
        self.interval = interval
        self.how: str | None = None
        self.samples = 0
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-memory")

    def start(self) -> "GpuMemory":
        self._thread.start()
        return self

    def _run(self) -> None:
        for how, make in (("nvml", _nvml_reader), ("nvidia-smi", _nvidia_smi_reader)):
            read = make()
            if read is not None:
                self.how = how
                break
        else:
            return
        while True:
            try:
                used = read()
            except Exception:  # a reading that failed is a reading not taken
                used = None
            if used is not None:
                self.samples += 1
                mine = [b for pid, b in used.items() if self._candidates(pid)]
                if mine:
                    self.peak = max(self.peak or 0, sum(mine))
            if self._stop.wait(self.interval):
                return

    def _candidates(self, pid: int) -> bool:
        if self.uid is not None and _owner(pid) == self.uid:
            return True
        for _ in range(64):  # up the tree to this process
            if pid in self.exclude or pid == self.root:
                return False
            parent = _parent(pid)
            if parent is None:
                return False
            if parent == self.root:
                return True
            pid = parent
        return False

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=NVIDIA_SMI_TIMEOUT + 5)
        peak = round(self.peak / 2**20, 1) if self.peak is not None else None
        return {"peak_mb": peak, "how": self.how, "samples": self.samples}


def _metrics(stats: dict[str, Any], evaluation: dict[str, Any], *, training: float, total: float,
             tokens: int, gpu: dict[str, Any] | None, had_gpu: bool) -> tuple[dict, list[str]]:
    """The result's metrics, and those of them that are the candidate's word (see above)."""
    reported = {k: _number(stats.get(k)) for k in METRIC_KEYS}
    metrics: dict[str, Any] = dict.fromkeys(METRIC_KEYS)
    metrics.update(val_bpb=evaluation["val_bpb"], training_seconds=round(training, 2),
                   total_seconds=round(total, 1), total_tokens_M=round(tokens / 1e6, 3),
                   num_params_M=round(evaluation["num_params"] / 1e6, 3),
                   mfu_percent=harness_mfu(tokens, training, evaluation.get("flops_per_token"),
                                           evaluation.get("device_name")),
                   peak_vram_mb=(gpu or {}).get("peak_mb"),
                   depth=evaluation.get("depth") if isinstance(evaluation.get("depth"), int) else None)
    own = []
    for key in ("peak_vram_mb", "num_steps", "depth"):
        if metrics[key] is None and reported[key] is not None and (key != "peak_vram_mb" or had_gpu):
            metrics[key] = reported[key]  # no GPU, no GPU memory: not the candidate's figure either
            own.append(key)
    if metrics["peak_vram_mb"] is not None:
        metrics["peak_vram_mb"] = round(metrics["peak_vram_mb"], 1)
    for key in ("num_steps", "depth"):
        if metrics[key] is not None:
            metrics[key] = int(metrics[key])
    return metrics, own


def _reported(stats: dict[str, Any]) -> dict[str, Any]:
    """What the candidate's stats.json says of the summary figures, as it said it (finite numbers)."""
    return {k: stats[k] for k in METRIC_KEYS if k != "val_bpb" and _number(stats.get(k)) is not None}


def figures_line(result: dict[str, Any]) -> str:
    """One log line: how the harness's MFU and GPU memory came about, next to the candidate's word."""
    metrics, measured = result.get("metrics") or {}, result.get("measured") or {}
    reported = result.get("reported") or {}
    fpt, peak = measured.get("flops_per_token"), measured.get("peak_flops")
    if metrics.get("mfu_percent") is not None:
        mfu = (f"MFU {metrics['mfu_percent']:.2f}% ({fpt / 1e6:.1f} MFLOP/token x "
               f"{metrics['total_tokens_M']:.1f}M tokens served / {metrics['training_seconds']:.1f}s / "
               f"{peak / 1e12:g} TFLOP/s, {measured.get('device_name')})")
    else:
        mfu = f"MFU not measured (no bf16 peak known for {measured.get('device_name') or 'a CPU'})"
    own = set(result.get("self_reported") or ())
    vram = metrics.get("peak_vram_mb")
    memory = ("peak GPU memory not measured" if vram is None else
              f"peak GPU memory {vram:.1f} MiB " + ("(the candidate's figure: the driver showed none of its "
                                                     "processes)" if "peak_vram_mb" in own else
                                                     f"({measured.get('gpu_memory')}, "
                                                     f"{measured.get('gpu_memory_samples')} readings)"))
    said = ", ".join(f"{k} {reported[k]}" for k in ("mfu_percent", "peak_vram_mb") if k in reported)
    return f"measured: {mfu}; {memory}" + (f"; the candidate says {said}" if said else "")

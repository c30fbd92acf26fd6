"""Where a training step's GPU time goes: bench/train.py under torch.profiler.

Runs the surface (bench/train.py, or another file with --train, after any
--patch OLD=>NEW edits, applied in order like startup_bench.py's) in this
process with a short budget, and profiles three optimiser steps after the
first seventeen (fifteen skipped, two profiler warm-up; compilation and the
warm-up passes come before all of them), using a global optimizer-step hook
so train.py needs no profiling code. Prints a coarse split of the GPU time
(matmuls, attention, the rest), how busy the GPU was over the window, the
top CUDA kernels with their share and call counts, and torch.profiler's table.
The CPU runs ahead of the GPU (up to about a step when the GPU is the
bottleneck), so the kernels recorded in the window can amount to about four
steps' worth, not three: the call counts say how many (the attention
backward runs DEPTH x gradient-accumulation times a step). The split and
the shares do not depend on that.

    AUTOLAB_SOURCE=dir:/path AUTOLAB_TIME_BUDGET=10 python3 bench/perf/profile_train.py \\
        [--sdpa cudnn|flash|default] [--train FILE] [--patch "OLD=>NEW" ...]
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

bench = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser()
ap.add_argument("--sdpa", choices=["default", "cudnn", "flash"], default="default")
ap.add_argument("--train", type=Path, default=bench / "train.py", help="another train.py to profile")
ap.add_argument("--patch", action="append", default=[], metavar="OLD=>NEW", help="edit the source first (repeatable)")
a = ap.parse_args()
source = a.train.read_text()
for patch in a.patch:
    old, new = patch.split("=>", 1)
    if old not in source:
        sys.exit(f"patch does not apply: {old!r}")
    source = source.replace(old, new, 1)
sys.path.insert(0, str(bench))
os.environ.setdefault("AUTOLAB_TIME_BUDGET", "10")
if a.sdpa != "default":
    torch.backends.cuda.enable_flash_sdp(a.sdpa == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(a.sdpa == "cudnn")
    torch.backends.cuda.enable_math_sdp(False)

# repeat=1: one window of three steps; a longer budget does not start a second one.
prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
               schedule=schedule(wait=15, warmup=2, active=3, repeat=1))


def on_step(opt, args, kwargs):
    if isinstance(opt, torch.optim.AdamW):
        prof.step()


register_optimizer_step_post_hook(on_step)
prof.start()
try:
    exec(compile(source, str(a.train.resolve()), "exec"), {"__name__": "__main__", "__file__": str(a.train.resolve())})
except SystemExit:
    pass
finally:
    prof.stop()
print(f"train.py: {a.train}; patches: " + ("; ".join(a.patch) or "none"))
# GPU-side events only (kernels, copies, sets): a CPU op carries its kernels' time too, as self
# device time, and a user annotation spans kernels; counting those would count time twice.
events = [e for e in prof.key_averages()
          if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
total = sum(e.self_device_time_total for e in events)
if not total:
    sys.exit("no GPU time recorded: the budget ended before the profiled steps")
buckets = {"matmul (gemm)": 0, "attention": 0, "other": 0}
kernels = []
for e in events:
    n = e.key.lower()
    k = ("attention" if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn"))
         else "matmul (gemm)" if any(s in n for s in ("gemm", "sm90", "cutlass", "nvjet", "matmul"))
         else "other")
    buckets[k] += e.self_device_time_total
    if e.self_device_time_total > 0:
        kernels.append((e.self_device_time_total, e.count, k, e.key))
print(f"\nGPU time recorded in a window of 3 optimiser steps: {total / 1e3:.1f} ms (sdpa={a.sdpa})")
for k, v in buckets.items():
    print(f"  {k:<14} {v / 1e3:8.1f} ms  {100 * v / total:5.1f} %")
try:  # how busy the GPU was: the union of kernel intervals against the window they span
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy, end = 0.0, None
    for s, t in spans:
        if end is None or s > end:
            busy, end = busy + t - s, t
        elif t > end:
            busy, end = busy + t - end, t
    window = spans[-1][1] - spans[0][0] if spans else 0.0
    print(f"  GPU busy {busy / 1e3:.1f} ms of a {window / 1e3:.1f} ms window ({100 * busy / max(window, 1):.1f} %)")
except Exception as e:  # an API that moved: informational
    print(f"  GPU busy: n/a ({e})")
print("\ntop kernels by GPU time (share of the GPU time recorded):")
for t, count, k, name in sorted(kernels, reverse=True)[:15]:
    print(f"  {100 * t / total:5.1f} %  {t / 1e3:8.1f} ms  x{count:<5} [{k}] {name[:110]}")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))

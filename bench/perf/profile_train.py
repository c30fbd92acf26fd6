"""Where a training step's GPU time goes: bench/train.py under torch.profiler.

Runs the surface unchanged (runpy), with a short budget, and profiles three
optimiser steps after the first fifteen (compilation and warm-up excluded),
using a global optimizer-step hook so train.py needs no profiling code.
Prints the top CUDA kernels and a coarse split: matmuls, attention, the rest.

    AUTOLAB_SOURCE=dir:/path AUTOLAB_TIME_BUDGET=10 python3 bench/perf/profile_train.py [--sdpa cudnn|flash|default]
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

ap = argparse.ArgumentParser()
ap.add_argument("--sdpa", choices=["default", "cudnn", "flash"], default="default")
a = ap.parse_args()
bench = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(bench))
os.environ.setdefault("AUTOLAB_TIME_BUDGET", "10")
if a.sdpa != "default":
    torch.backends.cuda.enable_flash_sdp(a.sdpa == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(a.sdpa == "cudnn")
    torch.backends.cuda.enable_math_sdp(False)

prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
               schedule=schedule(wait=15, warmup=2, active=3))


def on_step(opt, args, kwargs):
    if isinstance(opt, torch.optim.AdamW):
        prof.step()


register_optimizer_step_post_hook(on_step)
prof.start()
try:
    runpy.run_path(str(bench / "train.py"), run_name="__main__")
except SystemExit:
    pass
finally:
    prof.stop()
events = [e for e in prof.key_averages() if e.device_time_total > 0]
total = sum(e.self_device_time_total for e in events)
buckets = {"matmul (gemm)": 0, "attention": 0, "other": 0}
for e in events:
    n = e.key.lower()
    k = ("attention" if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn"))
         else "matmul (gemm)" if any(s in n for s in ("gemm", "sm90", "cutlass", "nvjet", "matmul"))
         else "other")
    buckets[k] += e.self_device_time_total
print(f"\nGPU time over 3 optimiser steps: {total / 1e3:.1f} ms (sdpa={a.sdpa})")
for k, v in buckets.items():
    print(f"  {k:<14} {v / 1e3:8.1f} ms  {100 * v / max(total, 1):5.1f} %")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))

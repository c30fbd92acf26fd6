"""What the trust boundary costs an honest run on a CPU (tiny profile, synthetic data).

    python bench/perf/sandbox_bench.py [--runs N] [--budget SECONDS]

Runs the unchanged bench/train.py through the real harness (`python -I bench/run.py`)
alternately with `--sandbox bwrap` (bubblewrap, another uid, PID/network namespaces,
streamed data, harness timing) and `--sandbox none` (a plain child process: what the
harness did before, minus the sandbox), N times each, and prints per mode: the wall time of
the whole harness call, the harness's start-up time before the first batch, the evaluation
and export time, val_bpb (mean and spread). The difference of the mean wall times is what
the boundary adds per run; the val_bpb columns show the sandbox does not change the result
beyond the profile's noise. Needs root or unprivileged user namespaces, and bwrap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def one(mode: str, budget: float, out: Path, env: dict) -> dict:
    result = out / f"{mode}-{time.monotonic_ns()}.json"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(BENCH / "train.py"),
                    "--result", str(result), "--source", "synthetic", "--budget", str(budget),
                    "--sandbox", mode, "--termination-log", str(out / "t.json")],
                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - t0
    r = json.loads(result.read_text())
    if r["status"] != "succeeded":
        raise SystemExit(f"{mode}: {r['status']}: {r['reason']}")
    return {"wall": wall, "val_bpb": r["metrics"]["val_bpb"], "startup": r["timing"]["startup_seconds"],
            "training": r["metrics"]["training_seconds"], "steps": r["metrics"].get("num_steps", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--budget", type=float, default=4.0)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="autolab-sandbox-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLAB_")}
    env.update(AUTOLAB_BENCH_PROFILE="tiny", AUTOLAB_CACHE=str(out / "cache"))
    subprocess.run([sys.executable, str(BENCH / "prepare.py"), "--source", "synthetic"], env=env,
                   stdout=subprocess.DEVNULL, check=True)
    seen: dict[str, list[dict]] = {"bwrap": [], "none": []}
    for _ in range(args.runs):
        for mode in ("none", "bwrap"):
            seen[mode].append(one(mode, args.budget, out, env))
    print(f"tiny profile, budget {args.budget:g}s, {args.runs} runs per mode, {os.cpu_count()} CPUs")
    means = {}
    for mode, runs in seen.items():
        walls = [r["wall"] for r in runs]
        bpbs = [r["val_bpb"] for r in runs]
        means[mode] = statistics.mean(walls)
        print(f"{mode:>6}: wall {statistics.mean(walls):6.2f} s (min {min(walls):.2f}) | start-up to first batch "
              f"{statistics.mean(r['startup'] for r in runs):5.2f} s | training "
              f"{statistics.mean(r['training'] for r in runs):5.2f} s | steps "
              f"{statistics.mean(r['steps'] for r in runs):6.1f} | val_bpb {statistics.mean(bpbs):.4f} "
              f"± {statistics.pstdev(bpbs):.4f}")
    print(f"the boundary adds {means['bwrap'] - means['none']:+.2f} s per run (mean wall time, bwrap - none)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One campaign through `autolab run` on a GPU, as a new user runs it: research progress per GPU-hour.

A lab of the default profile with the lab's own defaults (`autolab init`: `minDelta: auto`,
pairs on the lab's secret seeds, the online FDR level, the queue by creation time), at a short
budget, gets nine experiments, applied at once in this order (the queue's order):

- four changes translated from karpathy/autoresearch PR #44's top wins: the batch halved
  (`TOTAL_BATCH_TOKENS = 2**18`), `DEPTH = 9` (width kept: ASPECT_RATIO 57 as there), the
  embedding LR up by a third (`EMBEDDING_LR = 0.4`; 0.6 -> 0.8 there), a larger RoPE base
  (`ROPE_BASE = 50_000.0`; the PR's exact value is not quoted here);
- `MATRIX_LR = 0.022`, a gain measured before (../shared/notes/gpu-noise.md);
- `DEPTH = 2`: a large gain at this budget whose paired differences carry the master's whole
  spread (the hard decision that held the slot for 13 runs before);
- controls: a dead constant, a `SEED`-only variant (no effect), and `WARMDOWN_RATIO = 0.7` (a
  loser here).

It prints each experiment's outcome, its runs (the master's at new places included), when its
first run started after it was applied, and why it stopped; every run; the wall time; the
longest wait for a first run; decisions per GPU-hour, and that figure projected to the 300-s
budget from the runs' time outside training. `--wall-limit S` stops `autolab run` after S seconds
(a device call is bounded) and reports what was decided by then; `--resume` goes on with a lab
made before (a fresh machine: its runs in flight are found lost and run again).

    python bench/perf/gpu_campaign.py --data dir:PATH [--budget 45] [--lab /tmp/gpu-lab]
    python bench/perf/gpu_campaign.py --profile tiny --data synthetic --budget 5   # a CPU smoke

The data directory is `tools/mkcorpus.py`'s (offline machines); `--data hub` downloads.
"""

from __future__ import annotations

import argparse
import difflib
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

EDITS = {  # name: (old, new, hypothesis), applied in this order; old/new may be tuples of lines
    "batch-2-18": ("TOTAL_BATCH_TOKENS = 2**19", "TOTAL_BATCH_TOKENS = 2**18",
                   "PR #44: halve the batch, more steps in the budget."),
    "depth-9": (("DEPTH = 8  #", "ASPECT_RATIO = 64  #"), ("DEPTH = 9  #", "ASPECT_RATIO = 57  #"),
                "PR #44: one more block, about the same width (aspect ratio 57)."),
    "embedding-lr-04": ("EMBEDDING_LR = 0.3", "EMBEDDING_LR = 0.4",
                        "PR #44: a third higher embedding learning rate."),
    "rope-50k": ("ROPE_BASE = 10_000.0", "ROPE_BASE = 50_000.0",
                 "PR #44: a larger RoPE base."),
    "matrix-lr-022": ("MATRIX_LR = 0.02", "MATRIX_LR = 0.022",
                      "A slightly higher matrix learning rate trains faster in the budget."),
    "depth-2": ("DEPTH = 8  #", "DEPTH = 2  #",
                "A much smaller model sees far more tokens in a short budget."),
    "dead-constant": ("MATRIX_LR = 0.02", "UNUSED_KNOB = 7  # read by nothing\nMATRIX_LR = 0.02",
                      "A constant nothing reads (a control: no gain)."),
    "seed-only": ("SEED = 42 +", "SEED = 43 +", "Another initialisation (a control: no gain)."),
    "warmdown-07": ("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.7",
                    "A longer warmdown (a loser at this budget before)."),
}
RUN_OVERHEAD = 20.0  # seconds a warm run spends outside training (docs/results.md)


def autolab(*args: str, cwd: Path, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, input=input)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="dir:PATH (mkcorpus) or hub (not with --resume)")
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--lab", default="/tmp/autolab-gpu-campaign")
    ap.add_argument("--profile", default="default", help="tiny: a smoke test on a CPU")
    ap.add_argument("--wall-limit", type=float, default=None, help="stop autolab run after S s")
    ap.add_argument("--resume", action="store_true", help="go on with the lab at --lab")
    ap.add_argument("--report-only", action="store_true",
                    help="print the tables of the lab at --lab (a campaign may still run)")
    a = ap.parse_args()
    root = Path(a.lab)
    from controller.local import LocalLab
    if a.report_only:
        return report(root, a.budget, float("nan"))
    if a.resume:
        return report(root, a.budget, run(root, a.wall_limit))
    made = autolab("init", str(root), "--profile", a.profile, "--data", a.data,
                   "--budget", str(a.budget), cwd=REPO)
    if made.returncode != 0:
        print(made.stderr, file=sys.stderr)
        return 1
    lab = LocalLab(root)
    src = lab.repo.master_source()
    for name, (old, new, hypothesis) in EDITS.items():
        edited = src
        for o, n in zip(*((x,) if isinstance(x, str) else x for x in (old, new))):
            assert o in edited, f"{o!r} is not in bench/train.py"
            edited = edited.replace(o, n, 1)
        diff = "".join(difflib.unified_diff(src.splitlines(True), edited.splitlines(True),
                                            "a/train.py", "b/train.py"))
        doc = {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
               "metadata": {"name": name},
               "spec": {"hypothesis": hypothesis, "parent": lab.repo.master().hash[:12],
                        "diff": diff, "campaign": "gpu-campaign"}}
        ok = autolab("apply", "-f", "-", cwd=root, input=yaml.safe_dump(doc, sort_keys=False))
        print(ok.stdout.strip() or ok.stderr.strip(), flush=True)
    return report(root, a.budget, run(root, a.wall_limit))


def run(root: Path, limit: float | None) -> float:
    """`autolab run` in the lab until it is done (or `limit` seconds); the wall time."""
    started = time.time()
    try:
        subprocess.run([sys.executable, "-m", "controller.cli.main", "run"], cwd=root,
                       timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"autolab run stopped after {limit:.0f} s (--wall-limit)", flush=True)
    return time.time() - started


def _ts(text: str | None) -> float | None:
    from datetime import datetime
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def report(root: Path, budget: int, wall: float) -> int:
    from controller.local import LocalLab
    lab = LocalLab(root)
    rows = lab.ledger.rows()
    names = [n for n in EDITS if (root / "experiments" / f"{n}.yaml").exists()]
    print(f"{'experiment':16} {'outcome':24} {'runs':>4} {'first run after':>15}  why")
    waits, decided = [], 0
    for name in names:
        st = lab.read_record(name)["status"]
        p = st.get("pairs") or {}
        why = (p.get("verdict") or {}).get("explain", st.get("message") or "")
        mine = [r for r in rows if r.get("experiment_id") == name]
        runs = len({r["run_id"] for r in mine if r.get("backend")})
        applied, first = _ts(st.get("createdAt")), _ts(st.get("startedAt"))
        wait = None if applied is None or first is None else first - applied
        if wait is not None:
            waits.append(wait)
        decided += st.get("phase") in ("Succeeded", "Failed", "Duplicate", "Invalid", "Conflict")
        outcome = f"{st.get('phase')} {st.get('outcome') or st.get('reason') or ''}"
        print(f"{name:16} {outcome:24} {runs:>4} {'-' if wait is None else f'{wait:.0f} s':>15}"
              f"  {str(why)[:160]}")
    runs = [r for r in rows if r.get("val_bpb")]
    for r in runs:
        print(f"  {r['run_id']:48} {r['status']:10} {r['val_bpb']:>10} "
              f"{r.get('training_seconds') or '':>8} {r.get('total_seconds') or '':>8}")
    every = [r for r in rows if r.get("backend")]  # every run the GPU made, lost tries too
    hours = sum(float(r.get("total_seconds") or 0) for r in every) / 3600
    decisions = max(1, decided)
    print(f"{len(every)} runs ({len(runs)} with a val_bpb), {decided} of {len(names)} decided, "
          f"{wall:.0f} s wall; longest wait for a first run "
          f"{max(waits) if waits else float('nan'):.0f} s; "
          f"{decided / hours if hours else float('nan'):.1f} decisions per GPU-hour at {budget} s")
    per = len(every) / decisions  # the baseline and the master's places included
    print(f"projected to 300 s: {3600 / ((300 + RUN_OVERHEAD) * per):.1f} decisions per "
          f"GPU-hour ({per:.2f} runs per decision)")
    print(json.dumps({"wall_seconds": round(wall, 1), "runs": len(every), "decided": decided,
                      "longest_first_wait_s": max(waits) if waits else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One campaign through `autolab run` on a GPU, as a new user runs it: can the lab see a real gain?

A lab of the default profile with the lab's own defaults (`autolab init`: `minDelta: auto`,
pairs on the lab's secret seeds), at a short budget, gets three experiments:

- `matrix-lr-022`: `MATRIX_LR = 0.022`, a real gain (-0.0059 to -0.0081 per seed at 45 s on
  an H100, ../shared/notes/gpu-noise.md): it should be promoted;
- `seed-only`: another `SEED`, a new initialisation and nothing else: it should not;
- `dead-constant`: a constant nothing reads: it should not.

It prints each experiment's outcome, its pairs and why it stopped, every run with its
val_bpb, and the wall time; then decisions per GPU-hour, and that figure projected to the
300-s budget from the runs' time outside training.

    python bench/perf/gpu_campaign.py --data dir:PATH [--budget 60] [--lab /tmp/gpu-lab]
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

EDITS = {
    "matrix-lr-022": ("MATRIX_LR = 0.02", "MATRIX_LR = 0.022",
                      "A slightly higher matrix learning rate trains faster in the budget."),
    "seed-only": ("SEED = 42 +", "SEED = 43 +", "Another initialisation (a control: no gain)."),
    "dead-constant": ("MATRIX_LR = 0.02", "UNUSED_KNOB = 7  # read by nothing\nMATRIX_LR = 0.02",
                      "A constant nothing reads (a control: no gain)."),
}
RUN_OVERHEAD = 20.0  # seconds a warm run spends outside training (docs/results.md)


def autolab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="dir:PATH (mkcorpus) or hub")
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--lab", default="/tmp/autolab-gpu-campaign")
    ap.add_argument("--profile", default="default", help="tiny: a smoke test on a CPU")
    a = ap.parse_args()
    root = Path(a.lab)
    made = autolab("init", str(root), "--profile", a.profile, "--data", a.data,
                   "--budget", str(a.budget), cwd=REPO)
    if made.returncode != 0:
        print(made.stderr, file=sys.stderr)
        return 1
    from controller.local import LocalLab
    lab = LocalLab(root)
    src = lab.repo.master_source()
    for name, (old, new, hypothesis) in EDITS.items():
        assert old in src, f"{old!r} is not in bench/train.py"
        diff = "".join(difflib.unified_diff(src.splitlines(True),
                                            src.replace(old, new, 1).splitlines(True),
                                            "a/train.py", "b/train.py"))
        doc = {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
               "metadata": {"name": name},
               "spec": {"hypothesis": hypothesis, "parent": lab.repo.master().hash[:12],
                        "diff": diff, "campaign": "gpu-campaign"}}
        (root / "experiments" / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    started = time.time()
    ran = subprocess.run([sys.executable, "-m", "controller.cli.main", "run"], cwd=root)
    wall = time.time() - started
    if ran.returncode != 0:
        return ran.returncode
    lab = LocalLab(root)
    rows = lab.ledger.rows()
    for name in EDITS:
        st = lab.read_record(name)["status"]
        p = st.get("pairs") or {}
        why = (p.get("verdict") or {}).get("explain", st.get("message"))
        print(f"{name:14} {st.get('phase')} {st.get('outcome') or ''}: {why}")
    runs = [r for r in rows if r.get("val_bpb")]
    for r in runs:
        print(f"  {r['run_id']:48} {r['status']:10} {r['val_bpb']:>10} "
              f"{r.get('training_seconds') or '':>8} {r.get('total_seconds') or '':>8}")
    hours = sum(float(r.get("total_seconds") or 0) for r in runs) / 3600
    decisions = len(EDITS)
    print(f"{len(runs)} runs, {wall:.0f} s wall; {decisions / hours:.1f} decisions per GPU-hour "
          f"at {a.budget} s")
    per = len(runs) / decisions  # every run the GPU made: the baseline and the master's places too
    print(f"projected to 300 s: {3600 / ((300 + RUN_OVERHEAD) * per):.1f} decisions per "
          f"GPU-hour ({per:.2f} runs per decision)")
    print(json.dumps({"wall_seconds": round(wall, 1), "runs": len(runs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

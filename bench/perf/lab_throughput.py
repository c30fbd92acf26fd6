"""Useful experiments per GPU-hour, measured through the lab itself (issue 15).

Makes a lab (`autolab init`), writes N experiment specs (small changes to constants of
bench/train.py), runs `autolab run` until they are done, and reads back from the lab what
each run spent: the harness's time breakdown (prepare, start-up, training, export,
evaluate; bench/run.py's `timing`), the controller's share (from one run's result to the
next run's launch, as the local backend records them), and the wall time of the whole
`autolab run`. Then the GPU's timeline (each result's trained_from/trained_until): the time
between one run's last training second and the next run's first, which is what a run costs
the GPU beyond its budget once the next run starts up during its evaluation; and from it,
experiments per GPU-hour at the measured budget and at a 300-s budget (start-up, export and
evaluation do not grow with the budget).

    python bench/perf/lab_throughput.py --data dir:/path/to/corpus [--budget 60] [--experiments 3]
        [--profile default] [--lab /tmp/autolab-throughput] [--unsafe-no-sandbox]

On a GPU machine bench/perf/gpu_throughput.sh runs it with the corpus of mkcorpus.py.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from controller.lab.ledger import Ledger  # noqa: E402
from controller.lab.paths import LabPaths  # noqa: E402

# One change per experiment: (constant, new value, why). Real changes, so the runs are the
# kind a lab spends its GPUs on; their val_bpb does not matter here. No two are on adjacent
# lines of train.py: a winner moves the master, the next one is rebased onto it, and changes
# to touching lines would conflict (git's three-way merge), which spends no GPU at all.
CHANGES = [
    ("WARMDOWN_RATIO", "0.4", "a shorter warmdown keeps the peak LR longer"),
    ("MATRIX_LR", "0.025", "a higher Muon LR trains faster in a short budget"),
    ("WEIGHT_DECAY", "0.05", "less weight decay"),
    ("UNEMBEDDING_LR", "0.005", "a higher lm_head LR"),
]
# Changes that lose (nothing to promote, so no later candidate is rebased): every run after the
# first experiment is started up during its predecessor's evaluation and kept (--changes losing).
LOSING = [
    ("MATRIX_LR", "0.0", "no Muon step: the blocks do not learn"),
    ("UNEMBEDDING_LR", "0.0", "the lm_head does not learn"),
    ("WEIGHT_DECAY", "5.0", "weight decay that shrinks the matrices to nothing"),
    ("WARMDOWN_RATIO", "0.99", "an LR that decays from the start"),
]
TARGET_BUDGET = 300.0  # the budget the goal is stated at


def autolab(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "controller.cli.main", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True)


def spec_for(i: int, source: str, master: str, changes: list[tuple[str, str, str]] = CHANGES) -> str:
    name, value, why = changes[i % len(changes)]
    lines = source.splitlines(keepends=True)
    new = []
    for line in lines:
        if line.startswith(f"{name} = "):
            rest = line.split("#", 1)
            comment = ("  #" + rest[1]) if len(rest) > 1 else "\n"
            line = f"{name} = {value}{comment}"
        new.append(line)
    diff = "".join(difflib.unified_diff(lines, new, "a/train.py", "b/train.py", n=3))
    doc = {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
           "metadata": {"name": f"tp-{i + 1}-{name.lower().replace('_', '-')}"},
           "spec": {"hypothesis": f"{why} ({name} = {value})", "parent": master[:12],
                    "campaign": "throughput", "diff": diff}}
    import yaml
    return yaml.safe_dump(doc, sort_keys=False, width=1000)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="synthetic | hub | dir:PATH")
    p.add_argument("--budget", type=float, default=60.0)
    p.add_argument("--experiments", type=int, default=3)
    p.add_argument("--profile", default="default")
    p.add_argument("--lab", default="/tmp/autolab-throughput")
    p.add_argument("--changes", choices=("plausible", "losing"), default="plausible",
                   help="plausible: real tweaks, some of which win (a win moves the master: the next "
                        "run is rebased and starts over); losing: changes that lose, so each next run's "
                        "start during its predecessor's evaluation is kept")
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run without bubblewrap (a GPU machine without it; the repo's own code)")
    a = p.parse_args(argv)
    if a.experiments < 3:
        p.error("--experiments: at least 3, as the issue asks")
    lab = Path(a.lab)
    shutil.rmtree(lab, ignore_errors=True)
    # minDelta 0: the experiments follow the baseline at once (a new lab's `auto` would first
    # run the master five more times to measure its noise: once per lab, not the steady state).
    made = autolab("init", str(lab), "--profile", a.profile, "--data", a.data,
                   "--budget", f"{a.budget:g}", "--min-delta", "0")
    if made.returncode != 0:
        print(made.stdout + made.stderr, file=sys.stderr)
        return 1
    paths = LabPaths.of(lab)
    master = json.loads(paths.master_file.read_text())
    source = (lab / "bench" / "train.py").read_text()
    for i in range(a.experiments):
        (paths.experiments / f"tp-{i + 1}.yaml").write_text(
            spec_for(i, source, master["hash"], LOSING if a.changes == "losing" else CHANGES))
    run_args = ["run", "--lab", str(lab)] + (["--unsafe-no-sandbox"] if a.unsafe_no_sandbox else [])
    t0 = time.monotonic()
    ran = autolab(*run_args)
    wall = time.monotonic() - t0
    (lab / "autolab-run.log").write_text(ran.stdout + ran.stderr)
    if ran.returncode != 0:
        print(f"autolab run exited {ran.returncode}; see {lab / 'autolab-run.log'}", file=sys.stderr)

    rows = [r for r in Ledger(paths.ledger).rows() if r.get("status") in ("succeeded", "baseline")]
    runs = []
    for r in rows:
        d = paths.run_dir(r["run_id"])
        try:
            result = json.loads((d / "result.json").read_text())
            launch = json.loads((d / "launch.json").read_text())
        except (OSError, ValueError):
            continue
        runs.append({"run": r["run_id"], "started": launch["startedAt"], "ahead": bool(launch.get("ahead")),
                     "ended": (d / "result.json").stat().st_mtime, "timing": result.get("timing") or {},
                     "total": (result.get("metrics") or {}).get("total_seconds"),
                     "val_bpb": (result.get("metrics") or {}).get("val_bpb")})
    runs.sort(key=lambda x: x["started"])
    if len(runs) < 2:
        print(f"only {len(runs)} run(s) finished; see {lab / 'autolab-run.log'}", file=sys.stderr)
        return 1
    print(f"{'run':34} {'val_bpb':>8} {'prepare':>8} {'start-up':>9} {'GPU wait':>9} {'training':>9} "
          f"{'export':>7} {'evaluate':>9} {'ahead':>6}")
    for x in runs:
        t = x["timing"]
        print(f"{x['run']:34} {x['val_bpb'] or float('nan'):8.4f} {t.get('prepare_seconds', 0):8.1f} "
              f"{t.get('startup_seconds', 0):9.1f} {t.get('gpu_wait_seconds') or 0:9.1f} "
              f"{t.get('training_seconds', 0):9.1f} {t.get('export_seconds') or 0:7.1f} "
              f"{t.get('evaluate_seconds', 0):9.1f} {'yes' if x['ahead'] else 'no':>6}")
    # The GPU's own timeline: from one run's last training second to the next run's first. That
    # holds the first run's export and evaluation, the controller, and whatever of the next
    # run's start-up did not overlap them (all of it for a run not started ahead).
    timed = [x for x in runs if x["timing"].get("trained_from") and x["timing"].get("trained_until")]
    pairs = list(zip(timed, timed[1:]))
    if not pairs:
        print("no two runs carry trained_from/trained_until (a harness before issue 15's timeline)")
        return 1
    idle = [b["timing"]["trained_from"] - a_["timing"]["trained_until"] for a_, b in pairs]
    handoff = [b["timing"]["trained_from"] - a_["ended"] for a_, b in pairs]  # verdict -> next first batch
    steady = [g for (a_, b), g in zip(pairs, idle) if not a_["run"].startswith("baseline")]
    print(f"\nruns: {len(runs)} (baseline + {len(runs) - 1} experiments), budget {a.budget:g} s, "
          f"autolab run wall {wall:.1f} s; started ahead: {sum(x['ahead'] for x in runs)}")
    print("GPU not training between runs (last training second -> next first): "
          + ", ".join(f"{g:.1f}" for g in idle) + " s")
    print("one run's verdict -> the next run's first batch (the controller, and start-up left over): "
          + ", ".join(f"{h:.1f}" for h in handoff) + " s")
    mean_idle = statistics.mean(steady or idle)
    print(f"between experiments (the baseline's own gap left out: nothing can start before the master "
          f"is measured): mean {mean_idle:.1f} s")
    print(f"experiments per GPU-hour at {a.budget:g} s: {3600 / (a.budget + mean_idle):.1f}")
    print(f"experiments per GPU-hour at {TARGET_BUDGET:g} s (the same time between trainings): "
          f"{3600 / (TARGET_BUDGET + mean_idle):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

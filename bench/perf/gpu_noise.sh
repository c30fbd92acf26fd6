#!/usr/bin/env bash
# The run-to-run noise of the default profile on a GPU (issue 12): the same bench/train.py,
# RUNS times, differing only in the seed the harness sets (run.py --seed: the training data's
# start offset and $AUTOLAB_SEED), as `autolab noise` runs it.
#
#   bench/perf/gpu_noise.sh BUDGET RUNS MKCORPUS
#
# Prints one line per run, then the mean and sigma (n - 1) of val_bpb. The candidate is the
# repo's own train.py, trusted: it runs without the sandbox (--sandbox none), which changes
# the start-up time, not the training.
set -euo pipefail
BUDGET=${1:-60}; RUNS=${2:-4}; MKCORPUS=$3
. "$(dirname "$0")/gpu_env.sh"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
prepare_corpus "$MKCORPUS"
for seed in $(seq 0 $((RUNS - 1))); do
  $PY -I bench/run.py --candidate bench/train.py --result "$OUTDIR/seed-$seed.json" \
      --source "dir:$DATA" --budget "$BUDGET" --seed "$seed" --log "$OUTDIR/seed-$seed.log" \
      --termination-log "$OUTDIR/seed-$seed.term" --sandbox none >/dev/null 2>&1 || true
  $PY - "$OUTDIR/seed-$seed.json" "$seed" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1])); m = r.get("metrics") or {}
if r["status"] != "succeeded":
    print(f"seed {sys.argv[2]}: {r['status']}: {r.get('reason')}", flush=True); sys.exit(0)
print(f"seed {sys.argv[2]}: val_bpb {m['val_bpb']:.6f} | training {m['training_seconds']:.1f} s | "
      f"steps {m['num_steps']} | mfu {m['mfu_percent']:.2f} % | "
      f"outside training {m['total_seconds'] - m['training_seconds']:.1f} s", flush=True)
PYEOF
done
$PY - "$OUTDIR" "$RUNS" <<'PYEOF'
import json, statistics, sys
vals = []
for s in range(int(sys.argv[2])):
    try:
        r = json.load(open(f"{sys.argv[1]}/seed-{s}.json"))
    except (OSError, ValueError):
        continue
    if r.get("status") == "succeeded":
        vals.append(r["metrics"]["val_bpb"])
if len(vals) >= 2:
    print(f"noise: {len(vals)} runs, mean {statistics.mean(vals):.6f}, sigma {statistics.stdev(vals):.6f} "
          f"(min {min(vals):.6f}, max {max(vals):.6f})")
else:
    print(f"noise: only {len(vals)} successful run(s)")
PYEOF

#!/usr/bin/env bash
# Measure the benchmark on a GPU machine (default profile), as docs/results.md records it.
#
#   bench/perf/gpu_bench.sh BUDGET RUNS [MKCORPUS]
#
# 1. builds the offline corpus from this machine's Python site-packages with mkcorpus.py
#    (climbmix-layout parquet, --max-mb 1500), unless it exists;
# 2. prepares it (tokenizer + uint16 shards) in $AUTOLAB_CACHE, timed;
# 3. runs the harness RUNS times on bench/train.py with the given training budget,
#    the compile cache kept in $AUTOLAB_CACHE, so run 2+ start warm;
# 4. prints one summary line per run: val_bpb, tokens/s, MFU, start-up overhead.
set -euo pipefail
BUDGET=${1:-300}; RUNS=${2:-2}; MKCORPUS=${3:-../shared/tools/mkcorpus.py}
. "$(dirname "$0")/gpu_env.sh"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ ! -f "$DATA/shard_06542.parquet" ]; then
  t0=$(date +%s)
  $PY "$MKCORPUS" "$SITE" "$DATA" --max-mb 1500
  echo "mkcorpus: $(( $(date +%s) - t0 )) s"
fi
t0=$(date +%s)
$PY bench/prepare.py --source "dir:$DATA"
echo "prepare: $(( $(date +%s) - t0 )) s"
for i in $(seq "$RUNS"); do
  $PY bench/run.py --candidate bench/train.py --result "$OUTDIR/result-$i.json" \
      --source "dir:$DATA" --budget "$BUDGET" --log "$OUTDIR/log-$i.txt" \
      --termination-log "$OUTDIR/termination-$i.json" > /dev/null 2>&1 || true
  $PY - "$OUTDIR/result-$i.json" "$i" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1])); m = r.get("metrics") or {}
if r["status"] != "succeeded":
    print(f"run {sys.argv[2]}: {r['status']}: {r.get('reason')}"); sys.exit(0)
t = r.get("timing") or {}
tps = t["tokens_served"] / t["training_seconds"]  # the harness's count: tokens it served while the clock ran
print(f"run {sys.argv[2]}: val_bpb {m['val_bpb']:.6f} | training {m['training_seconds']:.1f} s | "
      f"total {m['total_seconds']:.1f} s | outside training {m['total_seconds'] - m['training_seconds']:.1f} s | "
      f"tokens/s {tps / 1e6:.3f} M | mfu {m['mfu_percent']:.2f} % | "
      f"steps {m['num_steps']} | peak VRAM {m['peak_vram_mb']:.0f} MiB | params {m['num_params_M']:.1f} M")
PYEOF
done

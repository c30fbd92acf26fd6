#!/usr/bin/env bash
# The cost of the trust boundary on a GPU (issue 10): the same train.py budget through the
# harness before the sandbox (OLD_BENCH, e.g. `git show 7263221:bench/{prepare,run,evaluate,train}.py`)
# and through today's harness (bubblewrap, streamed data, harness-timed), side by side.
#
#   bench/perf/gpu_trust.sh BUDGET OLD_BENCH MKCORPUS [BWRAP_DIR]
#
# Prints one line per run: tokens/s over the timed training, MFU, val_bpb, time outside training.
set -euo pipefail
BUDGET=${1:-60}; OLD=$2; MKCORPUS=$3
[ -n "${4:-}" ] && export PATH="$4:$PATH"
. "$(dirname "$0")/gpu_env.sh"
[ -f "$DATA/shard_06542.parquet" ] || $PY "$MKCORPUS" "$SITE" "$DATA" --max-mb 1500 >/dev/null
$PY bench/prepare.py --source "dir:$DATA" | tail -1
$PY -I bench/sandbox.py
summary() {  # $1 result json, $2 label
  $PY - "$1" "$2" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1])); m = r.get("metrics") or {}
if r["status"] != "succeeded":
    print(f"{sys.argv[2]}: {r['status']}: {r.get('reason')}"); sys.exit(0)
t = r.get("timing") or {}
# Old harness: the first 10 steps (compilation) were untimed and left out; new: every step is timed.
tokens = m["total_tokens_M"] * 1e6 if "sandbox" in r else (m["num_steps"] - 10) * 2**19
print(f"{sys.argv[2]}: val_bpb {m['val_bpb']:.6f} | training {m['training_seconds']:.1f} s | "
      f"tokens/s {tokens / m['training_seconds'] / 1e6:.3f} M (timed steps) | mfu {m['mfu_percent']:.2f} % | "
      f"steps {m['num_steps']} | outside training {m['total_seconds'] - m['training_seconds']:.1f} s | "
      f"sandbox {r.get('sandbox', 'none (old harness)')} | timing {json.dumps(t)}")
PYEOF
}
for round in 1 2; do
  (cd "$OLD" && $PY run.py --candidate train.py --result "$OUTDIR/old-$round.json" --source "dir:$DATA" \
      --budget "$BUDGET" --log "$OUTDIR/old-$round.log" --termination-log "$OUTDIR/old-$round.term" >/dev/null 2>&1 || true)
  summary "$OUTDIR/old-$round.json" "old-$round"
  $PY -I bench/run.py --candidate bench/train.py --result "$OUTDIR/new-$round.json" --source "dir:$DATA" \
      --budget "$BUDGET" --log "$OUTDIR/new-$round.log" --termination-log "$OUTDIR/new-$round.term" \
      --sandbox bwrap >/dev/null 2>&1 || true
  summary "$OUTDIR/new-$round.json" "new-$round"
done

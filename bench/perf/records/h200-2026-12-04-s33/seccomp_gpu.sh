#!/usr/bin/env bash
# The syscall filter on the H200: bench/train.py through the Kubernetes phases (stage, train in
# "container" mode, evaluate) with the filter (container) and without (none), BUDGET s each.
set -uo pipefail
BUDGET=${BUDGET:-30}
export OUT=${OUT:-/tmp/sc-out}
. bench/perf/gpu_env.sh
prepare_corpus build/mkcorpus.py
printf '%064d\n' 7 > /tmp/key
rm -rf /tmp/td && $PY -I bench/run.py --phase stage --source "dir:$DATA" --train-data /tmp/td | tail -1
for mode in container none container none; do
  ex=/tmp/ex-$mode-$RANDOM
  $PY -I bench/run.py --phase train --candidate bench/train.py --train-data /tmp/td --export-dir $ex \
      --budget "$BUDGET" --sandbox $mode > "$OUTDIR/train-$mode.log" 2>&1
  $PY -I bench/run.py --phase evaluate --candidate bench/train.py --export-dir $ex --result $ex.json \
      --termination-log $ex.term --source "dir:$DATA" --budget "$BUDGET" --sandbox $mode \
      --key-file /tmp/key --run exp-x-1 > "$OUTDIR/eval-$mode.log" 2>&1
  $PY -c "
import json; r=json.load(open('$ex.json')); m=r.get('metrics') or {}
print('$mode', r['status'], r.get('reason_code'), 'val_bpb', m.get('val_bpb'), 'tok/s', m.get('tokens_per_sec'), 'mfu', m.get('mfu_percent') or m.get('mfu'), 'steps', m.get('num_steps'), flush=True)"
  grep -i -E "error|denied|not permitted|Traceback" "$OUTDIR/train-$mode.log" | head -5
done
echo finished

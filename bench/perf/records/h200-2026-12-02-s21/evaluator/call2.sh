#!/usr/bin/env bash
# Evaluator with the compiled causality comparison: in-process scoring, then harness runs.
set -uo pipefail
. bench/perf/gpu_env.sh
prepare_corpus .devtools/mkcorpus.py
datadir=$(ls -d "$AUTOLAB_CACHE"/data/default-dir-* | head -1)
$PY bench/perf/evaluator_bench.py --repeat 1 --data-dir "$datadir" --profile-scoring 2>&1 | grep -v -i warning | grep -v "cls.__new__" | grep -v "^---\|^ \|^Self\|^  *Name" | tee $OUTDIR/evalprof.log
START=$(sha1sum bench/train.py | cut -d' ' -f1)
mkdir -p /tmp/v/lr
sed 's/^MATRIX_LR = 0.02 /MATRIX_LR = 0.025 /' bench/train.py > /tmp/v/lr/train.py
run() { # name candidate [extra args]
  local name=$1 cand=$2; shift 2
  local t0=$(date +%s%N)
  $PY bench/run.py --candidate "$cand" --result $OUTDIR/$name.json --source dir:$DATA --budget 20 \
      --sandbox none --log $OUTDIR/$name.log "$@" > /dev/null 2>&1
  echo "== $name ($(( ($(date +%s%N) - t0) / 1000000 )) ms wall)"
  grep -E "compile cache|time:|compar" $OUTDIR/$name.log | sed 's/^/   /'
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('metrics') or {}; t=r.get('timing') or {}; print('  ', r['status'], m.get('val_bpb'), m.get('mfu_percent'), 'start-up', t.get('startup_seconds'), 'eval stages', t.get('evaluate_stages'), 'ready', t.get('evaluator_ready'))" $OUTDIR/$name.json
}
run seed-cold bench/train.py --compile-cache-from $START
run seed-warm bench/train.py --compile-cache-from $START
run lr-warm /tmp/v/lr/train.py --compile-cache-from $START

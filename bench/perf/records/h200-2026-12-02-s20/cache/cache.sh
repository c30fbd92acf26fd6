#!/usr/bin/env bash
# Start-up with and without the starting program's kept compile cache (issue 15), H200.
set -uo pipefail
. bench/perf/gpu_env.sh
prepare_corpus .devtools/mkcorpus.py
START=$(sha1sum bench/train.py | cut -d' ' -f1)
mkdir -p /tmp/v/lr /tmp/v/mlp
sed 's/^MATRIX_LR = 0.02 /MATRIX_LR = 0.025 /' bench/train.py > /tmp/v/lr/train.py
sed 's/^MLP_RATIO = 4 /MLP_RATIO = 3 /' bench/train.py > /tmp/v/mlp/train.py
cmp -s bench/train.py /tmp/v/lr/train.py && echo "lr variant did not apply"
cmp -s bench/train.py /tmp/v/mlp/train.py && echo "mlp variant did not apply"
run() { # name candidate [extra args]
  local name=$1 cand=$2; shift 2
  local t0=$(date +%s%N)
  $PY bench/run.py --candidate "$cand" --result $OUTDIR/$name.json --source dir:$DATA --budget 20 \
      --sandbox none --log $OUTDIR/$name.log "$@" > /dev/null 2>&1
  echo "== $name ($(( ($(date +%s%N) - t0) / 1000000 )) ms wall)"
  grep -E "compile cache|time:" $OUTDIR/$name.log | sed 's/^/   /'
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('metrics') or {}; print('  ', r['status'], m.get('val_bpb'), m.get('mfu_percent'), 'start-up', (r.get('timing') or {}).get('startup_seconds'), r.get('compile_cache'))" $OUTDIR/$name.json
}
run seed-cold bench/train.py --compile-cache-from $START
run seed-warm bench/train.py --compile-cache-from $START
run lr-warm /tmp/v/lr/train.py --compile-cache-from $START
run mlp-warm /tmp/v/mlp/train.py --compile-cache-from $START
run lr-cold /tmp/v/lr/train.py
du -sh $AUTOLAB_CACHE/compile-seeds/*/* 2>/dev/null
find $AUTOLAB_CACHE/compile-seeds -type f | wc -l
datadir=$(ls -d "$AUTOLAB_CACHE"/data/default-dir-* | head -1)
rm -rf /tmp/oldbench && cp -r bench /tmp/oldbench && cp .devtools/evaluate_old.py /tmp/oldbench/evaluate.py
for b in /tmp/oldbench bench; do
  echo "== evaluator, $b"
  $PY $b/perf/evaluator_bench.py --repeat 1 --data-dir "$datadir" 2>&1 | grep -v -i warning | grep -v "cls.__new__"
done

#!/usr/bin/env bash
# Start-up with and without the kept compile cache of the lab's starting program (issue 15),
# through bench/run.py on a GPU machine, default profile, the mkcorpus.py corpus:
#
#   bench/perf/gpu_compile_cache.sh BUDGET MKCORPUS
#
# Five runs in order: the starting program from cold (it keeps its cache), the starting
# program again, a change that compiles the same graphs (MATRIX_LR), a change that compiles
# other graphs (MLP_RATIO), and the MATRIX_LR change without --compile-cache-from (cold).
# The machine has no bubblewrap, hence --sandbox none (the programs are the repo's own).
set -uo pipefail
BUDGET=${1:-20}; MKCORPUS=$2
. "$(dirname "$0")/gpu_env.sh"
prepare_corpus "$MKCORPUS"
START=$(sha1sum bench/train.py | cut -d' ' -f1)
V=$(mktemp -d)
mkdir -p $V/lr $V/mlp
sed 's/^MATRIX_LR = 0.02 /MATRIX_LR = 0.025 /' bench/train.py > $V/lr/train.py
sed 's/^MLP_RATIO = 4 /MLP_RATIO = 3 /' bench/train.py > $V/mlp/train.py
cmp -s bench/train.py $V/lr/train.py && { echo "the MATRIX_LR change did not apply"; exit 1; }
cmp -s bench/train.py $V/mlp/train.py && { echo "the MLP_RATIO change did not apply"; exit 1; }
run() { # name candidate [extra args]
  local name=$1 cand=$2; shift 2
  local t0=$(date +%s%N)
  $PY bench/run.py --candidate "$cand" --result $OUTDIR/$name.json --source dir:$DATA --budget "$BUDGET" \
      --sandbox none --log $OUTDIR/$name.log "$@" > /dev/null 2>&1
  echo "== $name ($(( ($(date +%s%N) - t0) / 1000000 )) ms wall)"
  grep -E "compile cache|time:" $OUTDIR/$name.log | sed 's/^/   /'
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('metrics') or {}; print('  ', r['status'], m.get('val_bpb'), m.get('mfu_percent'), 'start-up', (r.get('timing') or {}).get('startup_seconds'), r.get('compile_cache'))" $OUTDIR/$name.json
}
run seed-cold bench/train.py --compile-cache-from $START
run seed-warm bench/train.py --compile-cache-from $START
run lr-warm $V/lr/train.py --compile-cache-from $START
run mlp-warm $V/mlp/train.py --compile-cache-from $START
run lr-cold $V/lr/train.py
du -sh $AUTOLAB_CACHE/compile-seeds/*/* 2>/dev/null

#!/usr/bin/env bash
set -uo pipefail
. bench/perf/gpu_env.sh
prepare_corpus .devtools/mkcorpus.py
datadir=$(ls -d "$AUTOLAB_CACHE"/data/default-dir-* | head -1)
$PY bench/perf/evaluator_bench.py --repeat 1 --data-dir "$datadir" --profile-scoring 2>&1 | grep -v -i warning | grep -v "cls.__new__" | tee $OUTDIR/evalprof.log

#!/usr/bin/env bash
# Final evaluator (batched causality comparison, no compile; os._exit): scoring in-process, then the
# five harness runs of bench/perf/gpu_compile_cache.sh 20.
set -uo pipefail
. bench/perf/gpu_env.sh
prepare_corpus .devtools/mkcorpus.py
datadir=$(ls -d "$AUTOLAB_CACHE"/data/default-dir-* | head -1)
$PY bench/perf/evaluator_bench.py --repeat 1 --data-dir "$datadir" --profile-scoring 2>&1 | grep -v -i warning | grep -v "cls.__new__" > /tmp/evalprof.log
grep -v "^---\|^ \|^Self\|^  *Name\|^void\|^cudnn\|^nvjet\|USDT" /tmp/evalprof.log
mkdir -p /tmp/cc
OUT=/tmp/cc bash bench/perf/gpu_compile_cache.sh 20 .devtools/mkcorpus.py 2>&1 | grep -v "^   AUTOLAB_RESULT\|\[prepare\]" | tee /tmp/cc/gpu_compile_cache.log
cp /tmp/evalprof.log /tmp/cc/gpu_compile_cache.log /tmp/cc/*.json $OUT/

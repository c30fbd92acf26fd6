#!/usr/bin/env bash
# Call 1 of the seventh session: cold start on a fresh machine, then start-up variants.
set -u
export OUT=${OUT:-/tmp/out}
. bench/perf/gpu_env.sh
{ prepare_corpus .devtools/mkcorpus.py; } > $OUT/prep.log 2>&1
for i in 1 2; do
  python3 bench/run.py --candidate bench/train.py --result $OUT/cold$i.json --source dir:$DATA --budget 20 \
    --sandbox none --log $OUT/cold$i.log > $OUT/cold$i.out 2>&1
  grep "time:" $OUT/cold$i.log | tail -1 > $OUT/cold$i.time
done
export AUTOLAB_SOURCE=dir:$DATA
v() {  # name, patches...
  local name=$1; shift
  local args=()
  for p in "$@"; do args+=(--patch "$p"); done
  export TORCHINDUCTOR_CACHE_DIR=/tmp/sb-$name/compile TRITON_CACHE_DIR=/tmp/sb-$name/triton
  timeout 150 python3 bench/perf/startup_bench.py --budget 5 "${args[@]}" > $OUT/sb-$name.log 2>&1
}
A="import torch.nn.functional as F
"
v base
v nopw "$A=>${A}import torch._inductor.config as _ic; _ic.triton.autotune_pointwise = False
"
v warm "$A=>${A}from torch._inductor.async_compile import maybe_warm_pool; maybe_warm_pool()
"
v base2

#!/usr/bin/env bash
# issue 15, sixth session: fused lm_head+softcap+CE, QKV in one matmul, bf16 residual, 128 per pass.
set -uo pipefail
T0=$(date +%s); DEADLINE=$((T0 + ${DEADLINE_S:-540}))
. bench/perf/gpu_env.sh
LOG="$OUT/mfu2.log"
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
left() { local l=$((DEADLINE - $(date +%s))); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 45 ] && l=0; echo "$l"; }
variant() {
  local name=$1 cap=$2 t; t=$(left "$cap")
  echo; echo "=================== $name (elapsed $(elapsed), limit ${t} s)"
  [ "$t" -eq 0 ] && { echo "SKIPPED"; return; }
  cp .devtools/v/$name.py bench/train.py  # Triton reads a kernel's source from its file
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) timeout -k 5 "$t" \
    $PY bench/perf/startup_bench.py --budget ${BUDGET:-25} 2>&1 | grep -v -i -E "warning|cls.__new__|_warn_once" | grep -v "^step "
  echo "=================== end $name rc ${PIPESTATUS[0]} (elapsed $(elapsed))"
}
main() {
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  prepare_corpus .devtools/mkcorpus.py
  export AUTOLAB_SOURCE="dir:$DATA"
  echo "=================== kernel (elapsed $(elapsed))"
  timeout 90 $PY .devtools/kbench.py .devtools/v/b128_fused.py 2>&1 | grep -v -i warn
  timeout 60 $PY .devtools/kbench.py .devtools/v/b128_fused16w.py 2>&1 | grep -v -i warn | head -1
  for v in ${VARIANTS:-b128 b128_fused b128_fused_qkv b128_fused_qkv_bf16 base}; do variant $v 110; done
  echo "=================== all done (elapsed $(elapsed))"
}
main 2>&1 | tee "$LOG"

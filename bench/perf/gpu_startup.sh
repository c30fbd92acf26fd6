#!/usr/bin/env bash
# Where the time outside training goes on a GPU machine, and what train.py changes do to
# throughput (issue 15): the evaluator's stages on the default model, then train.py by hand
# (bench/perf/startup_bench.py) at a short budget, once as committed and once per patch.
#
#   bench/perf/gpu_startup.sh BUDGET MKCORPUS ["OLD=>NEW" ...]
#
# Each argument is one variant: OLD=>NEW edits to train.py, or file:PATH for another train.py
# to start from; several in one variant are joined with " && ".
set -euo pipefail
BUDGET=${1:-20}; MKCORPUS=$2; shift 2
. "$(dirname "$0")/gpu_env.sh"
prepare_corpus "$MKCORPUS"
export AUTOLAB_SOURCE="dir:$DATA"
datadir=$(ls -d "$AUTOLAB_CACHE"/data/default-dir-* | head -1)
echo "== evaluator stages (default profile model, $datadir)"
$PY bench/perf/evaluator_bench.py --repeat 2 --data-dir "$datadir" 2>&1 | grep -v -i warning | grep -v "cls.__new__"
run_variant() {
  local args=()
  IFS='&' read -ra edits <<< "${1// && /&}"
  for e in "${edits[@]}"; do
    case "$e" in file:*) args+=(--train "${e#file:}") ;; ?*) args+=(--patch "$e") ;; esac
  done
  echo "== train.py by hand, budget $BUDGET s"
  # A fresh compile cache per variant, as the harness gives each run: every start-up is cold.
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
    $PY bench/perf/startup_bench.py --budget "$BUDGET" "${args[@]}" 2>&1 | grep -v -i warning
}
run_variant ""
for v in "$@"; do run_variant "$v"; done

#!/usr/bin/env bash
# Which cheap changes to bench/train.py raise throughput (tok/s, MFU) on the default profile,
# and where a training step's GPU time goes: one call on a one-GPU H200 machine.
# Run from the repository root:  bash .devtools/mfu.sh   (needs .devtools/mkcorpus.py)
# Every variant runs train.py by hand (bench/perf/startup_bench.py) at a 15-s budget with a
# fresh compile cache; patches are OLD=>NEW text edits applied at run time (train.py is not edited).
#   A  committed file unchanged (runs first: it also pays the fresh machine's first-run costs)
#   B  DEVICE_BATCH 128
#   F  bench/perf/profile_train.py on B (3 optimiser steps; B's compile cache reused)
#   C  B + Muon's Newton-Schulz (orthogonalize) under torch.compile, compiled before the clock
#   D  B + inductor coordinate_descent_tuning (capped at 150 s: its compile may be long)
#   E  B + logits kept in bf16 through the softcap, cast to fp32 for the loss (numerics change slightly)
# Each step is skipped when too little of the 545 s since the start is left; set -e is off so a
# failing variant does not stop the rest.
set -uo pipefail
T0=$(date +%s)
DEADLINE=$((T0 + 545))
. bench/perf/gpu_env.sh
LOG="$OUTDIR/mfu.log"

B=$'DEVICE_BATCH = 64 =>DEVICE_BATCH = 128 '
C1=$'def orthogonalize(G, steps):=>@torch.compile(dynamic=False, fullgraph=True)\ndef orthogonalize(G, steps):'
C2=$'dummy_x, dummy_y = (=>with torch.no_grad():  # compile Muon\'s Newton-Schulz per shape before the clock (no_grad, as in Muon.step)\n    for _g in optimizers[1].param_groups:\n        orthogonalize(torch.zeros(len(_g["params"]), *_g["params"][0].shape, device=device), NS_STEPS)\ndummy_x, dummy_y = ('
D1=$'import torch.nn as nn=>import torch._inductor.config\ntorch._inductor.config.coordinate_descent_tuning = True\nimport torch.nn as nn'
E1=$'logits = self.lm_head(norm(x)).float()=>logits = self.lm_head(norm(x))'
E2=$'F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))=>F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))'

elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
# left CAP: seconds a step may take (at most CAP), 0 when under 40 s are left.
left() { local l=$((DEADLINE - $(date +%s))); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 40 ] && l=0; echo "$l"; }

variant() {  # variant NAME CAP [--patch P ...]
  local name=$1 cap=$2; shift 2
  local t; t=$(left "$cap")
  echo
  echo "=================== variant $name (elapsed $(elapsed), limit ${t} s)"
  if [ "$t" -eq 0 ]; then echo "SKIPPED: too little time left"; return; fi
  local ic tc
  ic=$(mktemp -d); tc=$(mktemp -d)
  [ "$name" = B ] && { B_IC=$ic; B_TC=$tc; }
  TORCHINDUCTOR_CACHE_DIR=$ic TRITON_CACHE_DIR=$tc timeout -k 5 "$t" \
    $PY bench/perf/startup_bench.py --budget 15 "$@" 2>&1 | grep -v -i -E "warning|cls.__new__"
  echo "=================== end of variant $name: rc ${PIPESTATUS[0]} (elapsed $(elapsed))"
}

main() {
  echo "mfu.sh on $(hostname), $(date -u +%FT%TZ)"
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  echo "=================== corpus (elapsed $(elapsed))"
  prepare_corpus .devtools/mkcorpus.py
  export AUTOLAB_SOURCE="dir:$DATA"
  echo "=================== corpus done (elapsed $(elapsed))"

  variant "A (committed train.py, unchanged; first compile on this fresh machine: absorbs the first-run penalty)" 120
  variant B 120 --patch "$B"

  local t; t=$(left 120)
  echo
  echo "=================== F: profile_train.py on variant B, 3 optimiser steps (elapsed $(elapsed), limit ${t} s)"
  if [ "$t" -eq 0 ]; then echo "SKIPPED: too little time left"; else
    TORCHINDUCTOR_CACHE_DIR=${B_IC:-$(mktemp -d)} TRITON_CACHE_DIR=${B_TC:-$(mktemp -d)} AUTOLAB_TIME_BUDGET=10 \
      timeout -k 5 "$t" $PY bench/perf/profile_train.py --patch "$B" 2>&1 \
      | grep -v -E "^step [0-9]+ \|" | grep -v -i -E "warning|cls.__new__" | tee "$OUTDIR/profile_B.log"
    echo "=================== end of F: rc ${PIPESTATUS[0]} (elapsed $(elapsed))"
  fi

  variant "C (B + orthogonalize compiled)" 120 --patch "$B" --patch "$C1" --patch "$C2"
  variant "D (B + coordinate_descent_tuning)" 150 --patch "$B" --patch "$D1"
  variant "E (B + bf16 logits through the softcap)" 120 --patch "$B" --patch "$E1" --patch "$E2"

  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  echo "=================== all done (elapsed $(elapsed))"
}

main 2>&1 | tee "$LOG"

#!/usr/bin/env bash
# The evaluation's bound on a GPU (run.py --eval-limit; the controller's bound is
# controller/core/evaluation.py: 5 x the master's own evaluation, at least 120 s). Two runs through
# bench/run.py, default profile, the mkcorpus.py corpus, both given LIMIT seconds to be scored:
# the master (scored well inside it), and a candidate whose exported model pushes its logits
# through 400 more matrix products (legal, slow to score), which fails at LIMIT, not at the
# profile's eval_timeout (600 s). Prints status, reason and timing of each.
# The GPU machines have no bubblewrap: SANDBOX=uid (default; as root, a uid of its own) or none.
#   bash bench/perf/gpu_eval_limit.sh MKCORPUS [BUDGET]     (LIMIT=120 by default)
set -u
source bench/perf/gpu_env.sh
BUDGET=${2:-30}
LIMIT=${LIMIT:-120}
SANDBOX=${SANDBOX:-uid}
export AUTOLAB_BENCH_PROFILE=default
prepare_corpus "$1"
slow=$OUTDIR/slow-to-score.py
$PY - bench/train.py "$slow" <<'PYEOF'
import sys
src = open(sys.argv[1]).read()
old = "        if targets is None:\n            return logits\n"
assert src.count(old) == 1, "bench/train.py changed: find where the exported model returns its logits"
new = ("        if targets is None:\n"
       "            square = torch.eye(logits.size(-1), dtype=logits.dtype, device=logits.device)\n"
       "            for _ in range(400):\n"
       "                logits = torch.tanh(logits @ square) * LOGIT_SOFTCAP\n"
       "            return logits\n")
open(sys.argv[2], "w").write(src.replace(old, new))
PYEOF
for name in master slow-to-score; do
  cand=bench/train.py
  [ "$name" = master ] || cand=$slow
  t0=$(date +%s)
  $PY -I bench/run.py --candidate "$cand" --result "$OUTDIR/$name.json" --source "dir:$DATA" \
      --budget "$BUDGET" --eval-limit "$LIMIT" --sandbox "$SANDBOX" --log "$OUTDIR/$name.log" > /dev/null 2>&1
  wall=$(( $(date +%s) - t0 ))
  $PY - "$OUTDIR/$name.json" "$name" "$wall" "$LIMIT" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1])); t = r.get("timing") or {}; m = r.get("metrics") or {}
print(f"{sys.argv[2]}: {r['status']} {r.get('reason_code') or ''} val_bpb {m.get('val_bpb')} "
      f"evaluate {t.get('evaluate_seconds')} s (limit {sys.argv[4]} s); run {sys.argv[3]} s in all")
if r["status"] != "succeeded":
    print(f"  reason: {r.get('reason')}")
PYEOF
done

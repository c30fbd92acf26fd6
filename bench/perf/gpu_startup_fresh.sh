#!/usr/bin/env bash
# Start-up on a fresh machine, where the lab's starting program never ran, against a warm one
# (issue 44), through bench/run.py on a GPU machine, default profile, the mkcorpus.py corpus:
#
#   bench/perf/gpu_startup_fresh.sh BUDGET MKCORPUS [MACHINES]
#
# Each machine starts with its kept compile caches removed (compile-seeds/; the prepared data
# stays) and runs two candidates that compile the starting program's graphs (a MATRIX_LR
# change, then a WARMDOWN_RATIO change), as a lab's first two experiments would:
#
#   cold   --compile-cache-from alone, as a lab resumed on a new host ran before the warm-up:
#          nothing keeps a cache, both runs compile from cold
#   fresh  --starting-program too: the first run's harness runs the starting program up to its
#          first batch and keeps its cache, then both candidates start from a copy
#   warm   the master ran here first (a full run of the starting program keeps its cache)
#
# MACHINES picks some of them ("cold fresh warm" by default; about 90 s a run at BUDGET 20).
# Each run prints its start-up (launch to first batch, result.timing.startup_seconds: the
# harness's own clock), the warm-up's seconds if there was one, and its wall time; the table at
# the end puts the second runs side by side, which is the figure asked for. The sandbox is
# bubblewrap where it works (the .devtools carry), else none (--sandbox auto; SANDBOX=... to
# choose); the programs are the repo's own.
set -uo pipefail
BUDGET=${1:-20}; MKCORPUS=$2; MACHINES=${3:-cold fresh warm}
. "$(dirname "$0")/gpu_env.sh"   # PY, DATA, AUTOLAB_CACHE, OUTDIR; prints the GPU
prepare_corpus "$MKCORPUS"
START=$(sha1sum bench/train.py | cut -d' ' -f1)
V=$(mktemp -d)
mkdir -p "$V/lr" "$V/wd"
sed 's/^MATRIX_LR = 0.02 /MATRIX_LR = 0.025 /' bench/train.py > "$V/lr/train.py"
sed 's/^WARMDOWN_RATIO = 0.5 /WARMDOWN_RATIO = 0.4 /' bench/train.py > "$V/wd/train.py"
cmp -s bench/train.py "$V/lr/train.py" && { echo "the MATRIX_LR change did not apply"; exit 1; }
cmp -s bench/train.py "$V/wd/train.py" && { echo "the WARMDOWN_RATIO change did not apply"; exit 1; }
TABLE=$OUTDIR/startup_fresh.tsv
printf 'machine\trun\tstartup_s\twarm_up_s\tseeded\twall_s\n' > "$TABLE"

run() {  # machine name candidate [extra run.py args]
  local machine=$1 name=$2 cand=$3; shift 3
  local t0; t0=$(date +%s%N)
  $PY -I bench/run.py --candidate "$cand" --result "$OUTDIR/$machine-$name.json" --source "dir:$DATA" \
      --budget "$BUDGET" --sandbox "${SANDBOX:-auto}" --log "$OUTDIR/$machine-$name.log" "$@" > /dev/null 2>&1
  local wall=$(( ($(date +%s%N) - t0) / 1000000 ))
  echo "== $machine / $name (${wall} ms wall)"
  grep "^\[bench\]" "$OUTDIR/$machine-$name.log" | grep -E "compile cache|warm|time:" | sed "s/^/   /"
  $PY - "$OUTDIR/$machine-$name.json" "$machine" "$name" "$wall" "$TABLE" <<'EOF'
import json, sys
path, machine, name, wall, table = sys.argv[1:]
r = json.load(open(path))
cc, timing = r.get("compile_cache") or {}, r.get("timing") or {}
warm = (cc.get("warm_up") or {}).get("seconds")
print("  ", r["status"], r.get("sandbox"), "val_bpb", (r.get("metrics") or {}).get("val_bpb"),
      "start-up", timing.get("startup_seconds"), "warm-up", warm, "seeded", cc.get("seeded"))
with open(table, "a") as f:
    f.write(f"{machine}\t{name}\t{timing.get('startup_seconds')}\t{warm or ''}\t{cc.get('seeded')}\t"
            f"{int(wall) / 1000:.1f}\n")
EOF
}

for machine in $MACHINES; do
  rm -rf "$AUTOLAB_CACHE/compile-seeds"
  case $machine in
    cold)  run cold first "$V/lr/train.py" --compile-cache-from "$START"
           run cold second "$V/wd/train.py" --compile-cache-from "$START" ;;
    fresh) run fresh first "$V/lr/train.py" --compile-cache-from "$START" --starting-program bench/train.py
           run fresh second "$V/wd/train.py" --compile-cache-from "$START" --starting-program bench/train.py ;;
    warm)  run warm master bench/train.py --compile-cache-from "$START"
           run warm second "$V/wd/train.py" --compile-cache-from "$START" --starting-program bench/train.py ;;
    *) echo "unknown machine $machine (cold, fresh or warm)"; exit 2 ;;
  esac
done
du -sh "$AUTOLAB_CACHE"/compile-seeds/*/* 2>/dev/null
echo "== start-up of each run (seconds; the second runs are the figure)"
column -t -s $'\t' "$TABLE" 2>/dev/null || cat "$TABLE"

#!/usr/bin/env bash
# The promotion campaign through `autolab run` on a GPU machine (bench/perf/gpu_campaign.py),
# with the bubblewrap sandbox on, split over device calls of at most 10 minutes.
#
#   bench/perf/gpu_campaign.sh start BUDGET WAIT   # set up, start the campaign, wait WAIT s
#   bench/perf/gpu_campaign.sh wait WAIT           # wait for it up to WAIT s more (a later call)
#   bench/perf/gpu_campaign.sh report              # the tables of a lab (also after each wait)
#
# carry: .whl (the controller's wheels the GPU image lacks), .devtools/bin and .devtools/lib
# (Debian's bwrap 0.8.0 and the libraries it links, behind a wrapper that hands the candidate
# the caller's LD_LIBRARY_PATH back), .devtools/mkcorpus.py (../shared/tools/mkcorpus.py).
# `start` runs gpu_campaign.py in a session of its own (setsid), so it outlives the call while
# the machine stays warm: issue the `wait` calls back to back. Each call ends with the tables of
# the lab so far and copies the log, the ledger and the tables to $OUT.
set -uo pipefail
MODE=${1:-report}
REPO=$(pwd)
LAB=${LAB:-/tmp/gpu-campaign-lab}
LOG=/tmp/gpu-campaign.log
export PYTHONUNBUFFERED=1 AUTOLAB_TRACKING=0
export PATH=$REPO/.devtools/bin:$PATH
if ! ${PYTHON:-python3} -c "import jsonschema" 2>/dev/null && [ ! -d /tmp/site/jsonschema ]; then
  ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
. "$(dirname "$0")/gpu_env.sh"   # PY, DATA, AUTOLAB_CACHE, OUTDIR; prints the GPU

wait_for() {  # wait_for SECONDS: until the campaign's process ends or SECONDS pass
  local until=$(( $(date +%s) + $1 )) pid
  pid=$(cat /tmp/gpu-campaign.pid 2>/dev/null || echo 0)
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$until" ]; do sleep 5; done
  if kill -0 "$pid" 2>/dev/null; then echo "STILL RUNNING after this call's wait (pid $pid)"
  else echo "FINISHED: $(tail -1 $LOG)"; fi
}

case $MODE in
  start)
    BUDGET=${2:-45}; WAIT=${3:-400}
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "bwrap: $(command -v bwrap) $(bwrap --version)"
    $PY -c "import sys; sys.path.insert(0, 'bench'); import sandbox; why = sandbox.available(); print('sandbox:', why or 'ok'); sys.exit(why is not None)" || exit 1
    $PY -c "import controller.local, controller.cli.main, jsonschema; print('controller imports ok')" || exit 1
    prepare_corpus .devtools/mkcorpus.py
    rm -rf "$LAB"
    date +%s > /tmp/gpu-campaign.started
    echo "$BUDGET" > /tmp/gpu-campaign.budget
    setsid $PY bench/perf/gpu_campaign.py --data "dir:$DATA" --budget "$BUDGET" --lab "$LAB" \
        > $LOG 2>&1 < /dev/null &
    echo $! > /tmp/gpu-campaign.pid
    wait_for "$WAIT" ;;
  wait) wait_for "${2:-540}" ;;
  one)  # one run of the master through the harness alone (no lab): MFU and memory, both ways
    prepare_corpus .devtools/mkcorpus.py
    $PY -I bench/run.py --candidate bench/train.py --result "$OUTDIR/one.json" --source "dir:$DATA" \
        --budget "${2:-45}" --sandbox bwrap --log "$OUTDIR/one.log" > /dev/null 2>&1
    $PY -c "
import json; r = json.load(open('$OUTDIR/one.json')); m, s = r['metrics'], r.get('reported') or {}
print(r['reason_code'], r['sandbox'], 'val_bpb', m.get('val_bpb'), 'steps', m.get('num_steps'), r.get('measured'))
print('MFU harness', m.get('mfu_percent'), 'train.py', s.get('mfu_percent'), 'VRAM harness', m.get('peak_vram_mb'), 'train.py', s.get('peak_vram_mb'))"
    grep "^\[bench\]" "$OUTDIR/one.log"; exit 0 ;;
esac

[ -d "$LAB/research" ] || { tail -30 $LOG; exit 1; }
( cd "$LAB" && $PY -m controller.cli.main get -o wide > "$OUTDIR/get-wide.txt" 2>&1
  for e in $(ls experiments | sed 's/\.yaml$//'); do
    $PY -m controller.cli.main describe $e 2>&1 | sed -n '/^Pairs:/,/^Conditions:/p'
  done > "$OUTDIR/pairs.txt" )
cp "$LAB/research/results.tsv" "$OUTDIR/"
cp $LOG "$OUTDIR/autolab-run.log"
tar czf "$OUTDIR/lab.tgz" -C "$(dirname "$LAB")" "$(basename "$LAB")"
$PY - "$LAB" /tmp/gpu-campaign.started > "$OUTDIR/table.txt" <<'EOF'
import json, sys, csv
from pathlib import Path
lab, started = Path(sys.argv[1]), float(Path(sys.argv[2]).read_text())
ledger = {r["run_id"]: r for r in csv.DictReader(open(lab / "research/results.tsv"), delimiter="\t")}
runs = []
for p in (lab / ".autolab/runs").glob("*/result.json"):
    r = json.loads(p.read_text()); r["_dir"] = p.parent.name
    runs.append(r)
runs.sort(key=lambda r: (r.get("timing") or {}).get("trained_from") or 0)
f = lambda v, n=2: "-" if v is None else (f"{v:.{n}f}" if isinstance(v, float) else str(v))
print(f"{'run':44} {'experiment':14} {'status':9} {'val_bpb':>9} {'steps':>5} {'train':>6} {'total':>6} "
      f"{'start':>5} {'eval':>5} {'MFU harn':>8} {'MFU self':>8} {'diff':>6} {'VRAM harn':>9} {'VRAM self':>9} sandbox")
gaps, prev_end, diffs = [], None, []
for r in runs:
    m, rep, t = r.get("metrics") or {}, r.get("reported") or {}, r.get("timing") or {}
    row = ledger.get(r["run"], {})
    hm, sm = m.get("mfu_percent"), rep.get("mfu_percent")
    d = hm - sm if isinstance(hm, (int, float)) and isinstance(sm, (int, float)) else None
    if d is not None: diffs.append(d)
    print(f"{r['run']:44} {row.get('experiment_id', '?'):14} {r.get('reason_code', '?')[:9]:9} "
          f"{f(m.get('val_bpb'), 6):>9} {f(m.get('num_steps')):>5} {f(m.get('training_seconds'), 1):>6} "
          f"{f(m.get('total_seconds'), 1):>6} {f(t.get('startup_seconds'), 1):>5} {f(t.get('evaluate_seconds'), 1):>5} "
          f"{f(hm):>8} {f(sm):>8} {f(d):>6} {f(m.get('peak_vram_mb'), 0):>9} {f(rep.get('peak_vram_mb'), 0):>9} "
          f"{r.get('sandbox')}")
    if t.get("trained_from") and prev_end: gaps.append(t["trained_from"] - prev_end)
    prev_end = t.get("trained_until") or prev_end
meas = runs[-1].get("measured", {}) if runs else {}
print(f"\n{len(runs)} runs; GPU {meas.get('device_name')}, peak {meas.get('peak_flops')} FLOP/s, "
      f"{meas.get('flops_per_token')} FLOPs/token (harness)")
if diffs:
    print(f"MFU harness - train.py: mean {sum(diffs)/len(diffs):+.2f}, max |diff| {max(abs(x) for x in diffs):.2f} points")
if gaps:
    print(f"GPU timeline between trainings (one run's last training second to the next's first): "
          f"mean {sum(gaps)/len(gaps):.1f} s over {len(gaps)} gaps {[round(g, 1) for g in gaps]}")
print(f"wall from launch to the ledger's last write: {(lab / 'research/results.tsv').stat().st_mtime - started:.0f} s")
EOF
$PY bench/perf/gpu_campaign.py --report-only --lab "$LAB" --budget "$(cat /tmp/gpu-campaign.budget 2>/dev/null || echo 45)" \
    > "$OUTDIR/outcomes.txt" 2>&1
cat "$OUTDIR/table.txt" "$OUTDIR/get-wide.txt" "$OUTDIR/outcomes.txt"

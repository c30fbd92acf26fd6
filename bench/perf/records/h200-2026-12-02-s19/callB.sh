# The variants were bench/train.py (3b8d3758a6d2) with train_regional.diff, and that plus
# train_regional_b128-on-top.diff, written to .devtools/ (git apply --directory or patch -o).
set -uo pipefail
. bench/perf/gpu_env.sh
prepare_corpus .devtools/mkcorpus.py
for c in bench/train.py .devtools/train_regional.py .devtools/train_regional_b128.py; do
  n=$(basename $c .py)
  echo "== harness run: $c"
  $PY bench/run.py --candidate $c --result $OUTDIR/$n.json --source dir:$DATA --budget 20 --sandbox none --log $OUTDIR/$n.log > /dev/null 2>&1
  grep -E "^step|time:|training done|succeeded|failed|error" $OUTDIR/$n.log | tail -6
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['status'], r.get('metrics',{}).get('mfu_percent'), r.get('timing'))" $OUTDIR/$n.json
done

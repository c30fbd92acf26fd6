set -uo pipefail
. bench/perf/gpu_env.sh
$PY -m pip install -q --no-deps --no-index --target /tmp/autolab-pydeps .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/autolab-pydeps
prepare_corpus build/mkcorpus.py
$PY build/handback.py "dir:$DATA" /tmp/hb > $OUTDIR/handback.txt 2>&1
echo "handback exit $?" >> $OUTDIR/handback.txt

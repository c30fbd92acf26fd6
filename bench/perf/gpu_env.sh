# Sourced by the GPU scripts in bench/perf/: where the corpus, the cache and the output go,
# and which GPU this is. Set PY, DATA, AUTOLAB_CACHE and OUTDIR (override with PYTHON,
# AUTOLAB_GPU_DATA, AUTOLAB_CACHE and OUT), and print the GPU.
PY=${PYTHON:-python3}
SITE=$($PY -c "import site; print(site.getsitepackages()[0])")  # what mkcorpus.py reads
DATA=${AUTOLAB_GPU_DATA:-/tmp/autolab-corpus}
export AUTOLAB_CACHE=${AUTOLAB_CACHE:-/tmp/autolab-cache}
OUTDIR=${OUT:-/tmp/autolab-gpu-out}
mkdir -p "$OUTDIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# prepare_corpus MKCORPUS: the mkcorpus.py corpus in $DATA (unless there) and its prepared
# shards in $AUTOLAB_CACHE, each step timed.
prepare_corpus() {
  local t0
  t0=$(date +%s)
  [ -f "$DATA/shard_06542.parquet" ] || $PY "$1" "$SITE" "$DATA" --max-mb 1500 >/dev/null
  echo "mkcorpus: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  $PY bench/prepare.py --source "dir:$DATA" | tail -1
  echo "prepare: $(( $(date +%s) - t0 )) s"
}

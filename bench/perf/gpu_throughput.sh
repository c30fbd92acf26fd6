#!/usr/bin/env bash
# Useful experiments per GPU-hour through `autolab run` on a GPU machine (issue 15): the real
# controller, the local backend, the default profile, the mkcorpus.py corpus.
#
#   bench/perf/gpu_throughput.sh BUDGET EXPERIMENTS MKCORPUS [plausible|losing]
#
# Builds and prepares the corpus (timed: that is the cold machine's first cost), then runs
# bench/perf/lab_throughput.py: a lab with a baseline and EXPERIMENTS specs, and the time each
# run spent outside training (prepare, start-up, export, evaluate) and between runs. The
# controller's Python dependencies that a bare GPU image lacks come as wheels in .whl/ (see
# docs/results.md). Candidates run without bubblewrap (the machine has none; the programs
# are the repo's own), which changes start-up by well under a second (bench/perf/sandbox_bench.py).
set -euo pipefail
BUDGET=${1:-60}; EXPERIMENTS=${2:-3}; MKCORPUS=$3; CHANGES=${4:-plausible}
. "$(dirname "$0")/gpu_env.sh"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ -d .whl ] && ! $PY -c "import jsonschema" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-index --target /tmp/autolab-pydeps .whl/*.whl
  export PYTHONPATH=/tmp/autolab-pydeps${PYTHONPATH:+:$PYTHONPATH}
fi
prepare_corpus "$MKCORPUS"
export AUTOLAB_TRACKING=${AUTOLAB_TRACKING:-0}  # trackio is not on the GPU image
$PY bench/perf/lab_throughput.py --data "dir:$DATA" --budget "$BUDGET" --experiments "$EXPERIMENTS" \
    --lab "$OUTDIR/lab" --unsafe-no-sandbox --changes "$CHANGES"
cp "$OUTDIR/lab/autolab-run.log" "$OUTDIR/" 2>/dev/null || true

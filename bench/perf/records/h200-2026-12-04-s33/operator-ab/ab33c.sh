set -e
pip install -q --no-index --find-links .whl --target /tmp/site kopf kubernetes kmock jsonschema 2>&1 | tail -2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
for cores in 2 all; do for r in 1 2 3 4 5 6; do for v in old new; do
  d=$PWD/build/$v; pre=""; [ $cores = 2 ] && pre="taskset -c 0,1"
  (cd $d && $pre python3 bench/perf/operator_bench.py --experiments 50 --resync 30 --settle 2 > $OUT/x.txt 2>&1) || echo "$v r$r failed"
  echo "$cores $v r$r: $(grep -h 'create -> Job created:' $OUT/x.txt | head -1 | sed 's/.*created: //') | $(grep -h 'CPU seconds' $OUT/x.txt | grep -o 'operator [0-9.]*, emulator [0-9.]*' | head -1)"
done; done; done
rm -f $OUT/*.txt

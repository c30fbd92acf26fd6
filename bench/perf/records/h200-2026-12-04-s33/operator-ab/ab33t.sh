set -e
pip install -q --no-index --find-links .whl --target /tmp/site kopf kubernetes kmock jsonschema 2>&1 | tail -2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
for r in 1 2 3 4 5 6; do for v in old new; do
  d=$PWD/build/$v
  (cd $d && taskset -c 0,1 python3 bench/perf/operator_bench.py --experiments 50 --resync 30 --settle 2 > $OUT/t2-$v-r$r.txt 2>&1) || echo "$v r$r failed"
  echo "2 cores $v r$r: $(grep -h 'create -> Job' $OUT/t2-$v-r$r.txt) | $(grep -h 'CPU seconds' $OUT/t2-$v-r$r.txt | grep -o 'operator [0-9.]*, emulator [0-9.]*')"
done; done
rm -f $OUT/*.txt

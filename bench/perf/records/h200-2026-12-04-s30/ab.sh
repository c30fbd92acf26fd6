set -e
pip install -q --no-index --find-links .whl --target /tmp/site kopf kubernetes kmock jsonschema 2>&1 | tail -2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
nproc; python3 -V; git --version
for r in 1 2 3 4 5; do for v in head old; do
  d=$PWD/build/$v
  (cd $d && python3 bench/perf/operator_bench.py --experiments 50 --resync 30 --settle 2 > $OUT/$v-r$r.txt 2>&1) || echo "$v r$r failed"
  echo "$v r$r: $(grep -h 'create -> Job' $OUT/$v-r$r.txt) | $(grep -h 'CPU seconds' $OUT/$v-r$r.txt)"
done; done
for v in head old; do (cd build/$v && python3 bench/perf/checks_bench.py --specs 1000 --rows 10000 > $OUT/checks-$v.txt 2>&1; echo "checks $v: $(grep -h 'all 1000' $OUT/checks-$v.txt) | $(grep -h 'per spec' $OUT/checks-$v.txt)"); done
cat $OUT/*-r*.txt > $OUT/all.txt; rm $OUT/*-r*.txt

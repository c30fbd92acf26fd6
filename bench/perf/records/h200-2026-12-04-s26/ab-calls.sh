set -e
pip install -q --no-index --find-links .whl --target /tmp/site kopf kubernetes kmock jsonschema py-spy 2>&1 | tail -2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
R=$PWD; nproc; python3 -V
for r in 1 2 3 4 5; do for v in base new; do
  if [ $v = new ]; then d=$PWD; else d=$PWD/build/ab-$v; fi
  (cd $d && python3 bench/perf/operator_bench.py --experiments 50 --resync 30 --settle 3 --json $OUT/$v-r$r.json > $OUT/$v-r$r.txt 2>&1) || echo "$v r$r failed"
  grep -h "create -> Job" $OUT/$v-r$r.txt | sed "s/^/$v r$r: /"
  grep -h "CPU seconds" $OUT/$v-r$r.txt | sed "s/^/$v r$r: /" | cut -c1-110
done; done
for v in base new; do
  if [ $v = new ]; then d=$PWD; else d=$PWD/build/ab-$v; fi
  echo "== trace $v"; (cd $d && python3 $R/build/trace.py 2>&1 | grep -E "create ->|^req|^mat|^pass|^guarded")
done

#!/usr/bin/env bash
# Call 2 of the seventh session: the lab's throughput on a fresh machine, then everything back as one archive.
set -u
R=$OUT; export OUT=/tmp/o; mkdir -p $OUT
{ lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; } > $R/machine.txt
timeout -k 5 ${LIMIT:-480} bash bench/perf/gpu_throughput.sh ${BUDGET:-20} 3 .devtools/mkcorpus.py losing > $OUT/gpu_throughput.log 2>&1
echo "rc=$?" >> $OUT/gpu_throughput.log
cp $OUT/gpu_throughput.log $R/
find $OUT/lab -name "*.json" -size -200k > /tmp/list 2>/dev/null
tar czf $R/lab.tgz -C / $(sed 's|^/||' /tmp/list) tmp/o/autolab-run.log 2>/dev/null

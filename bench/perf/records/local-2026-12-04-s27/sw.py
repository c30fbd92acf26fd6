"""Run from the repository root: the 50-Experiment round with the GIL switch interval from $SWITCH (seconds; unset: Python's 5 ms)."""
import os, sys, runpy
iv = float(os.environ.get("SWITCH", "0"))
if iv: sys.setswitchinterval(iv)
sys.argv = ["operator_bench.py", "--experiments", "50", "--resync", "30", "--settle", "1"]
if __name__ == "__main__":
    g = runpy.run_path(os.path.join(os.getcwd(), "bench/perf/operator_bench.py"), run_name="ob")
    g["main"]()

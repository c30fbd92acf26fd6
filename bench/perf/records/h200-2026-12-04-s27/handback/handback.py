"""On a GPU machine: an evaluation that runs out of time beside the next run's start-up, through
`autolab run` (the real controller, the local backend, the default profile, the mkcorpus corpus).

The pinned harness is this checkout's bench/ with the default profile's eval_timeout cut to
EVAL_LIMIT, so a model whose scoring takes minutes (the head's logits pushed through 60 square
matrix products) runs out of time within the call. Two specs: that one first (priority 1), then
one that loses (a frozen head). Prints what each run recorded, which run was started up ahead and
when, and the slow run's hand-back lines.

    python3 handback.py DATA_SOURCE OUT_DIR   (from the repository root; $EVAL_LIMIT, $BUDGET)
"""
import contextlib, json, os, shutil, subprocess, sys, threading, time
from pathlib import Path

REPO = Path.cwd()
sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "tests"))
from controller.lab import init  # noqa: E402
from controller.cli.lab import init_lab  # noqa: E402
from labkit import spec_from_edit  # noqa: E402

EVAL_LIMIT = float(os.environ.get("EVAL_LIMIT", "45"))
BUDGET = int(os.environ.get("BUDGET", "20"))
PROFILE = os.environ.get("PROFILE", "default")
LIMIT_NOW = {"default": "eval_timeout=600.0", "tiny": "eval_timeout=120.0"}[PROFILE]
SLOW_OLD = "        if targets is None:\n            return logits\n"
SLOW_NEW = ("        if targets is None:\n"
            "            square = torch.eye(logits.size(-1), dtype=logits.dtype, device=logits.device)\n"
            "            for _ in range(60):\n"
            "                logits = torch.tanh(logits @ square) * LOGIT_SOFTCAP\n"
            "            return logits\n")

data, out = sys.argv[1], Path(sys.argv[2])
bench = out / "bench-src"
shutil.copytree(REPO / "bench", bench, ignore=shutil.ignore_patterns("perf", "__pycache__"))
text = (bench / "prepare.py").read_text()
assert text.count(LIMIT_NOW) == 1
(bench / "prepare.py").write_text(text.replace(LIMIT_NOW, f"eval_timeout={EVAL_LIMIT}"))
init.bench_source_dir = lambda: bench
lab = init_lab(out / "lab", profile=PROFILE, data=data, budget=BUDGET)
lab.apply_file(spec_from_edit(lab, "slow-eval", SLOW_OLD, SLOW_NEW, "A deeper head helps.", priority=1), "gpu")
lab.apply_file(spec_from_edit(lab, "plain", "UNEMBEDDING_LR = 0.02", "UNEMBEDDING_LR = 0.0",
                              "A frozen head changes nothing."), "gpu")
runs = lab.root / ".autolab" / "runs"
ahead, done = [], threading.Event()

def watch():
    while not done.wait(0.1):
        for d in runs.glob(".next-*") if runs.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                launch = json.loads((d / "launch.json").read_text())
                if launch["run"] not in [a[0] for a in ahead]:
                    ahead.append((launch["run"], round(time.time(), 1)))
        for d in runs.glob("exp-*") if runs.is_dir() else []:
            if (d / "handback").exists() and ("handback", d.name) not in [a[:2] for a in ahead if len(a) == 3]:
                ahead.append(("handback", d.name, round(time.time(), 1)))

threading.Thread(target=watch, daemon=True).start()
env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), AUTOLAB_TRACKING="0")
t0 = time.time()
proc = subprocess.run([sys.executable, "-m", "controller.cli.main", "run", "--lab", str(lab.root),
                       "--interval", "0.5", "--unsafe-no-sandbox"], env=env, capture_output=True, text=True)
done.set()
print(f"autolab run: exit {proc.returncode} after {time.time() - t0:.0f} s")
(out / "autolab-run.log").write_text(proc.stdout + proc.stderr)
print("started ahead / hand-backs seen (run, unix time):", ahead)
for d in sorted(runs.iterdir()):
    if not (d / "result.json").exists():
        continue
    r = json.loads((d / "result.json").read_text())
    launch = json.loads((d / "launch.json").read_text())
    t = r.get("timing", {})
    print(f"{d.name}: {r['status']} {r['reason_code']}: {r['reason'][:200]}")
    print(f"   launched {launch['startedAt']:.1f} ahead={launch['ahead']}, result written "
          f"{(d / 'result.json').stat().st_mtime:.1f}; trained {t.get('trained_from')}..{t.get('trained_until')}; "
          f"evaluate_seconds {t.get('evaluate_seconds')}")
    shutil.copy(d / "result.json", out / f"{d.name}.result.json")
    log = (d / "log.txt").read_text(errors="replace")
    for line in log.splitlines():
        if "GPU back" in line or "once more" in line or "alone" in line or "timed out" in line or "longer than" in line:
            print("   log:", line[:220])
shutil.copy(lab.root / "research" / "results.tsv", out / "results.tsv")
print((lab.root / "research" / "results.tsv").read_text())

"""Where a candidate's start-up goes, and what a change to train.py does to it (issue 15).

Runs bench/train.py by hand (prepared data read directly, no harness, no export) in
this process, cut into sections at its own comments, and prints the seconds of each:
imports, setup, building the model and optimisers, the warm-up passes (where
torch.compile compiles: dynamo's own split is printed too), then the timed training
at the budget you give. --patch OLD=>NEW edits the source first (repeatable), to try
a change without committing it:

    AUTOLAB_SOURCE=dir:/path python bench/perf/startup_bench.py --budget 20 \\
        --patch "DEVICE_BATCH = 64 =>DEVICE_BATCH = 128 "
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
# Section ends: the text at which the next section starts (train.py's own headings and lines).
MARKS = (("imports", "# ---------------------------------------------------------------------------\n# Knobs"),
         ("setup", "raw_model = GPT().to(device)"),
         ("model and optimisers", "# Compile and warm up"),
         ("warm-up passes (compile)", "step = 0\n"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=20.0)
    ap.add_argument("--patch", action="append", default=[], metavar="OLD=>NEW")
    ap.add_argument("--train", type=Path, default=BENCH / "train.py", help="another train.py to start from")
    a = ap.parse_args()
    os.environ["AUTOLAB_TIME_BUDGET"] = repr(a.budget)
    os.environ.pop("AUTOLAB_EXPORT_DIR", None)
    sys.path.insert(0, str(BENCH))
    source = a.train.read_text()
    for patch in a.patch:
        old, new = patch.split("=>", 1)
        if old not in source:
            print(f"patch does not apply: {old!r}", file=sys.stderr)
            return 2
        source = source.replace(old, new, 1)
    cuts = [0] + [source.index(mark) for _, mark in MARKS] + [len(source)]
    names = [name for name, _ in MARKS] + ["training (budget) and summary"]
    scope: dict = {"__name__": "__main__", "__file__": str(BENCH / "train.py")}
    seconds = {}
    out = io.StringIO()
    t_all = time.perf_counter()
    for name, lo, hi in zip(names, cuts, cuts[1:]):
        t0 = time.perf_counter()
        with redirect_stdout(out):
            exec(compile("\n" * source.count("\n", 0, lo) + source[lo:hi], str(BENCH / "train.py"), "exec"), scope)
        torch = scope.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - t0
        if name.startswith("warm-up"):
            try:
                from torch._dynamo.utils import compile_times
                seconds["  of which dynamo says"] = compile_times(repr="str", aggregate=True)
            except Exception as e:  # an API that moved: the split is informational
                seconds["  of which dynamo says"] = f"n/a ({e})"
    text = out.getvalue()
    rates = [float(m) for m in re.findall(r"tok/s (\d+)", text)]
    mfus = [float(m) for m in re.findall(r"mfu ([\d.]+)%", text)]
    print(f"train.py: {a.train}; patches: " + ("; ".join(a.patch) or "none"))
    for name, v in seconds.items():
        print(f"  {name}: " + (f"{v:.2f}s" if isinstance(v, float) else str(v).replace("\n", " | ")))
    startup = sum(v for k, v in seconds.items() if isinstance(v, float) and not k.startswith("training"))
    print(f"  start-up (sum before training): {startup:.2f}s; total {time.perf_counter() - t_all:.2f}s")
    if rates:
        print(f"  tok/s last {rates[-1]:,.0f} (mean of logged {sum(rates) / len(rates):,.0f}); "
              f"mfu last {mfus[-1] if mfus else 0:.1f}%")
    summary = text.split("\n---\n")[-1].strip() if "\n---\n" in text else text[-600:]
    print("  " + summary.replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    sys.exit(main())

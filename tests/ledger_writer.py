"""A second process for tests/test_ledger.py, started once and given one trial at a time.

Per trial, two lines on stdin: `<ledger path>\\t<run id> <run id> ...` makes a Ledger on
that path and answers `ready`; then `go` appends the ids, each after a `has_run` check
as a controller's resume pass does, and answers `done` (or `error <text>`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.lab.ledger import Ledger  # noqa: E402


def main() -> None:
    for line in sys.stdin:
        path, ids = line.rstrip("\n").split("\t")
        ledger = Ledger(path)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        try:
            for run_id in ids.split():
                if not ledger.has_run(run_id):
                    ledger.append({"run_id": run_id, "status": "succeeded",
                                   "experiment_id": run_id, "comment": "second process"})
        except Exception as e:  # reported to the test, which fails on it
            print(f"error {type(e).__name__}: {e}", flush=True)
            continue
        print("done", flush=True)


if __name__ == "__main__":
    main()

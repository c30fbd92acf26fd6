"""Hostile candidates, one at a time, through the real local loop of one tiny lab.

Each test id is one candidate (advcandidates.py); the rig (advrig.py) runs it with
`python -m controller.cli.main run` and checks that the lab gave it no false metric, kept the lab as
it was apart from the experiment's own row and branch, left no process behind and ran none of
the code it tried to inject. The honest controls run first and last: an honest small change must
still be measured, so the suite cannot pass just because every run fails.

    .venv/bin/python -m pytest -q tests/adversarial            # ~60 runs of the tiny profile
    .venv/bin/python -m pytest -q tests/adversarial -k "control or bud-"
    ADV_REPORT=/tmp/adv.jsonl ...                              # one JSON line per candidate
"""

from __future__ import annotations

import json
import os

import pytest

import advcandidates as A
from advrig import Rig

pytestmark = pytest.mark.adversarial


# Session, not module: a worker that runs another module's test in between would tear a module
# fixture down and make it again; this one is made once per worker that uses it.
@pytest.fixture(scope="session")
def rig(tmp_path_factory):
    r = Rig(tmp_path_factory.mktemp("adversarial"))
    try:
        r.setup()
        yield r
    finally:
        r.teardown()
        if os.environ.get("ADV_REPORT"):
            with open(os.environ["ADV_REPORT"], "w") as f:
                f.write(json.dumps({"baseline": r.baseline, "lab": str(r.lab)}) + "\n")
                for row in r.report:
                    f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("name", [c.name for c in A.CANDIDATES])
def test_candidate(rig, name):
    cand = A.BY_NAME[name]
    res = rig.run_candidate(cand)
    assert not res.violations, (
        f"{name} [{cand.cls}]: {cand.attack}\n"
        f"A defended lab: {cand.defended}\n"
        f"Got: {res.phase}/{res.outcome} ({res.reason}), val_bpb {res.val_bpb} (baseline {rig.baseline:.4f}) "
        f"in {res.seconds:.0f}s: {res.message[:400]}\n"
        + "\n".join(f"  - {v}" for v in res.violations))

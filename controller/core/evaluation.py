"""How long a candidate's evaluation may take, bounded by the master's own.

The harness scores every run's exported model in an evaluator with a time
limit, the profile's `eval_timeout` (600 s on the default profile, about forty
times what the seed's model takes on an H200). A candidate may export a model
that is legal but slow to score: it trains for its budget like any other, then
holds the GPU for nearly the whole limit, and a small edit makes it a new
candidate the next time. Nothing is forged, but GPU hours go to evaluations that
teach nothing. So a candidate is bounded by what the master it competes with
took to be scored:

- `evaluation_limit(master_seconds, profile_limit)`: EVAL_LIMIT_FACTOR times the
  master's own evaluation, at least EVAL_LIMIT_FLOOR seconds (a cold machine, a
  slow start of the evaluator), never more than the profile allows. None when
  the master's evaluation time is not known (a lab measured before this bound
  existed, a harness that does not report it): then the profile's limit holds.

The master's time comes from its measured run: the baseline, or the run that
promoted it. Runs of the master itself (baseline, noise and pair runs) get
the profile's limit: they are how the bound is learned.
"""

from __future__ import annotations

import math

EVAL_LIMIT_FACTOR = 5.0   # a candidate may take 5x the master's evaluation: a model 5x as costly
EVAL_LIMIT_FLOOR = 120.0  # seconds; never less: evaluator start-up and a cold GPU vary that much


def evaluation_limit(master_seconds: object, profile_limit: float | None) -> float | None:
    """Seconds a candidate's evaluation may take, or None: the profile's limit (see the module)."""
    if isinstance(master_seconds, bool) or not isinstance(master_seconds, (int, float)) \
            or not math.isfinite(master_seconds) or master_seconds <= 0:
        return None
    limit = max(EVAL_LIMIT_FLOOR, EVAL_LIMIT_FACTOR * float(master_seconds))
    if profile_limit is not None and limit >= profile_limit:
        return None  # the profile's own limit is the tighter one
    return round(limit, 1)

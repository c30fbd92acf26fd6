"""A pass that failed, told on the experiment it failed for.

Front ends reconcile many experiments; an unexpected exception while
reconciling one of them (a status file that does not parse, a backend the
front end lacks, a bug its spec trips) must not stop the others. The front
end catches it, and tells it where a person looks: a Warning Event with
reason `ReconcileError`, and the condition `Reconciled` set to False with the
message. The phase is left alone: the loop is level-triggered, so the next
pass tries again, and a passing fault heals by itself. When a later pass goes
through, the condition turns True again.

The functions here only compute statuses; writing them is the front end's.
They return None when nothing changes, so a fault that repeats on every pass
is told once, not once a second.
"""

from __future__ import annotations

import copy

from controller.core.spec import SpecError

RECONCILED = "Reconciled"  # the condition type
RECONCILE_ERROR = "ReconcileError"  # its reason, and the Event's, while passes fail
RECOVERED = "Recovered"  # its reason once a pass went through again
MESSAGE_MAX = 2000


def failure_message(name: str, error: BaseException) -> str:
    """One line for a person: which experiment, what failed, and that the others went on."""
    what = str(error) if isinstance(error, SpecError) else f"{type(error).__name__}: {error}"
    what = " ".join(what.split())[:MESSAGE_MAX]
    return f"reconciling {name} failed: {what}; the other experiments go on"


def _condition(status: dict) -> dict | None:
    conds = status.get("conditions")
    if not isinstance(conds, list):
        return None
    return next((c for c in conds if isinstance(c, dict) and c.get("type") == RECONCILED), None)


def failing(status: dict) -> bool:
    """Whether the status says its last pass failed."""
    c = _condition(status) if isinstance(status, dict) else None
    return c is not None and c.get("status") == "False"


def with_failure(status: dict, message: str, now: str) -> dict | None:
    """The status with `Reconciled` False and `message`; None if it says so already."""
    c = _condition(status)
    if c is not None and c.get("status") == "False" and c.get("message") == message:
        return None
    out = copy.deepcopy(status)
    if not isinstance(out.get("conditions"), list):
        out["conditions"] = []
    cond = _condition(out)
    if cond is None:
        cond = {"type": RECONCILED}
        out["conditions"].append(cond)
    if cond.get("status") != "False":
        cond["lastTransitionTime"] = now
    cond.update(status="False", reason=RECONCILE_ERROR, message=message)
    return out


def with_recovery(status: dict, now: str) -> dict | None:
    """The status with `Reconciled` True again; None if no failure was told."""
    if not failing(status):
        return None
    out = copy.deepcopy(status)
    cond = _condition(out)
    assert cond is not None
    cond.update(status="True", reason=RECOVERED, lastTransitionTime=now,
                message="A later pass went through.")
    return out

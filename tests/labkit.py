"""Small helpers the end-to-end tests share: specs made from an edit of the master."""

from __future__ import annotations

import difflib

from controller.backends import Backend


def spec_from_edit(lab, name: str, old: str, new: str, hypothesis: str | None = None,
                   priority: int = 0) -> dict:
    """An Experiment that replaces `old` by `new` in the lab's master surface."""
    src = lab.repo.master_source()
    assert old in src, f"{old!r} is not in the master's surface"
    diff = "".join(difflib.unified_diff(src.splitlines(True),
                                        src.replace(old, new, 1).splitlines(True),
                                        "a/train.py", "b/train.py"))
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": name},
            "spec": {"hypothesis": hypothesis or f"{name}.", "parent": lab.repo.master().hash[:10],
                     "diff": diff, "priority": priority}}


def run_until_done(lab, steps: int = 60) -> dict:
    """Step the local loop until every experiment settled; the statuses by name."""
    summary = lab.step()
    for _ in range(steps):
        if summary.done:
            break
        summary = lab.step()
    assert summary.done, summary.rows
    return {n: st for n, st, _ in summary.rows}


class InstantBackend(Backend):
    """A backend whose runs finish at once with `value(request)` as their val_bpb (None: the
    run ends as a harness error)."""

    name = "local"

    def __init__(self, value, evaluate_seconds=None):
        self.value = value
        self.evaluate_seconds = evaluate_seconds  # request -> the harness's timing, if any
        self.requests: dict = {}

    def submit(self, req):
        self.requests.setdefault(req.run, req)
        return self.observe(req.run)

    def observe(self, run):
        from controller.core.reconcile import RunObservation

        req = self.requests.get(run)
        if req is None:
            return RunObservation(run, "missing")
        value = self.value(req)
        if value is None:  # ended as a harness error (as a candidate that can void its run ends it)
            return RunObservation(run, "error", message="the harness failed", result={
                "status": "error", "reason_code": "HarnessError", "reason": "the harness failed"})
        result = {"metrics": {"val_bpb": value}}
        if self.evaluate_seconds is not None:
            result["timing"] = {"evaluate_seconds": self.evaluate_seconds(req)}
        return RunObservation(run, "succeeded", result=result)

    def cancel(self, run):
        from controller.core.reconcile import RunObservation

        return RunObservation(run, "cancelled")

    def cleanup(self, run):
        pass  # nothing outside this process to remove

    def leftovers(self, run):
        return False

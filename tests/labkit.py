"""Small helpers the end-to-end tests share: specs made from an edit of the master."""

from __future__ import annotations

import difflib


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

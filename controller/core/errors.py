"""One root for the failures autolab knows, in the two kinds a user must tell apart.

Every known failure of the controller is an `AutolabError`, and one of two kinds:

- `InputError`: yours to fix. A spec, a file you wrote, a command's arguments, the lab's
  settings: the same input fails the same way on any machine; change it, then run again.
- `MachineError`: the machine's to fix. Git, the disk, the cluster, a token, a file the
  controller itself keeps (master.json, a status, the ledger) that something damaged: what you
  wrote may be fine; mend the environment, then run the same thing again.

As kopf tells a `PermanentError` from a `TemporaryError`, a class says its kind once, and
whoever shows the failure (`autolab` prints it after the message) reads `kind_of` instead of
guessing from the message. A failure that is neither (a bug) is not an `AutolabError`.
"""

from __future__ import annotations

INPUT, MACHINE = "yours to fix", "the machine's to fix"


class AutolabError(Exception):
    """A failure autolab knows and can explain in a sentence; `kind` says who must act."""

    kind: str = MACHINE


class InputError(AutolabError):
    """Yours to fix: a spec, a file you wrote, an argument or a lab setting is wrong."""

    kind = INPUT


class MachineError(AutolabError):
    """The machine's to fix: the environment failed (git, disk, cluster, token, a damaged
    file the controller keeps); the same input runs once it is mended."""

    kind = MACHINE


def kind_of(error: BaseException) -> str | None:
    """Who must act on `error` (`INPUT` or `MACHINE`); None for an error autolab does not know."""
    return error.kind if isinstance(error, AutolabError) else None

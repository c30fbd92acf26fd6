"""Timestamps as the controller writes them: ISO 8601, UTC, whole seconds, a trailing Z.

One definition for every status, ledger row, record and emulated API object, so they all
sort and parse the same way (`2024-05-01T12:00:00Z`). One exception: when an experiment was
created (`precise`, to the microsecond), which orders the queue, so that the specs of one
`autolab apply` keep the order they were given in.
"""

from __future__ import annotations

import datetime as _dt

FORMAT = "%Y-%m-%dT%H:%M:%SZ"
PRECISE = "%Y-%m-%dT%H:%M:%S.%fZ"


def utcnow() -> str:
    """Now, as `FORMAT`."""
    return _dt.datetime.now(_dt.timezone.utc).strftime(FORMAT)


def iso(ts: float) -> str:
    """A POSIX timestamp (seconds since the epoch) as `FORMAT`."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime(FORMAT)


def parse(value: str) -> _dt.datetime:
    """`FORMAT` back to an aware datetime (UTC); ValueError if `value` is not in it."""
    return _dt.datetime.strptime(value, FORMAT).replace(tzinfo=_dt.timezone.utc)


def precise(ts: float) -> str:
    """A POSIX timestamp as `PRECISE` (microseconds): a creation time."""
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime(PRECISE)

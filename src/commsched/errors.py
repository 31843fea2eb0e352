"""Errors commsched raises, and the one helper that words a bad-argument message the same way everywhere."""

from __future__ import annotations

from typing import Any, Iterable


class CommSchedConfigError(ValueError):
    """A strategy argument or Trainer setting commsched cannot work with."""


class PeerFailureError(RuntimeError):
    """A collective failed: a peer died, hung past the process-group timeout, or the link broke."""


class ScheduleError(RuntimeError):
    """The training step did something the schedule cannot keep exact (e.g. a stale parameter was read)."""


def bad_value(field: str, value: Any, allowed: str | Iterable[Any]) -> CommSchedConfigError:
    """Build the error for `field=value`, naming what is allowed, so every refusal reads alike."""
    if not isinstance(allowed, str):
        allowed = "one of " + ", ".join(repr(a) for a in allowed)
    return CommSchedConfigError(f"commsched: invalid {field}={value!r}; allowed: {allowed}.")

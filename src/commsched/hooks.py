"""Hooks commsched puts on a user's modules, made so that copies of the module do not carry them.

`copy.deepcopy(module)` (EMA, SWA, a user's snapshot) and pickling a module copy its hook
dictionaries; a bound method or a `partial` there would drag the schedule along (with its
process groups and locks, which cannot be copied). A copy is another model: it gets a hook
that does nothing.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class OwnHook(partial):
    """Calls `fn`; a deep copy or a pickled copy of it calls nothing. A `partial` of `fn`, so a call runs
    no Python frame of its own: it sits on every gradient's path."""

    def __new__(cls, fn: Callable[..., Any]) -> "OwnHook":
        return super().__new__(cls, fn)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _nothing

    def __reduce__(self) -> tuple:
        return _nothing_factory, ()


def _nothing_factory() -> Callable[..., None]:
    return _nothing

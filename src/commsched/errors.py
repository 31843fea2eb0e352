"""Errors commsched raises, and the one form every refusal of a setting takes.

A refusal names the setting as the user wrote it, what is allowed, and how to fix it:

    commsched: invalid CompressionOptions(density=0); allowed: a number in (0, 1].
        Fix: e.g. CompressionOptions(density=0.01) (the default).
    commsched: invalid compression.density=0; allowed: a number in (0, 1].
        Fix: e.g. compression.density=0.01 (the default).

The first is what a Python user sees, the second what ``commsched-train`` prints: the same error is
raised by the same check in both, and rendered when it is read, in the syntax of the entry point
that is running (`use_syntax`, set by the command-line tools). Settings are named by their path in
the Hydra config (``compression.density``); `setting` turns a path into either syntax.
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Literal, Optional

Syntax = Literal["python", "hydra"]
_syntax: list[Syntax] = ["python"]

PYTHON_OWNERS = {
    "fusion": "FusionOptions",
    "tuning": "TuningOptions",
    "profile": "ProfileOptions",
    "links": "LinkOptions",
    "deft": "DeFTOptions",
    "preserver": "PreserverOptions",
    "compression": "CompressionOptions",
    "streams": "StreamOptions",
    "Preserver": "Preserver",
    "dear": "DeAROptions",
}
"""A setting path's first part -> the class a Python user passes it to."""
HYDRA_GROUPS = {"Preserver": "preserver"}
"""A path's first part as the Python API names it -> the Hydra config node."""
_UNSET: Any = object()


def use_syntax(syntax: Syntax) -> None:
    """Render refusals for this process's user: "hydra" in the command-line tools, "python" otherwise."""
    _syntax[0] = syntax


def current_syntax() -> Syntax:
    return _syntax[0]


def setting(field: str, value: Any, owner: Optional[str] = None, syntax: Optional[Syntax] = None) -> str:
    """`field` set to `value`, as the user writes it: ``CompressionOptions(density=0.01)`` in Python,
    ``compression.density=0.01`` on the command line. `owner`: the class a top-level Python argument
    belongs to (``DeARStrategy(bucket_cap_mb=-1)``)."""
    head, _, rest = field.partition(".")
    if (syntax or _syntax[0]) == "hydra":
        return f"{HYDRA_GROUPS.get(head, head)}{'.' + rest if rest else ''}={hydra_value(value)}"
    if rest and head in PYTHON_OWNERS and "." not in rest:
        return f"{PYTHON_OWNERS[head]}({rest}={value!r})"
    if not rest and owner is not None:
        return f"{owner}({field}={value!r})"
    return f"{field}={value!r}"


def hydra_value(value: Any) -> str:
    """A value as a Hydra override spells it (null, true, a bare word, a quoted phrase)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value and all(c.isalnum() or c in "_-./@:~+" for c in value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return repr(value) if isinstance(value, float) else str(value)


class CommSchedConfigError(ValueError):
    """A setting commsched cannot work with. Raised with a free-text message, or with the refused
    `field`, its `value`, what is `allowed` and a `fix`, rendered in the user's syntax when read."""

    def __init__(
        self,
        message: str = "",
        *,
        field: Optional[str] = None,
        value: Any = _UNSET,
        allowed: Optional[str] = None,
        fix: Optional[object] = None,
        owner: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        self.message, self.field, self.value, self.allowed, self.fix, self.owner = (
            message,
            field,
            value,
            allowed,
            fix,
            owner,
        )

    def __reduce__(self) -> Any:
        return _rebuild, (self.message, self.field, self.value, self.allowed, self.fix, self.owner)

    def __str__(self) -> str:
        if self.field is None:
            return self.message
        text = f"commsched: invalid {setting(self.field, self.value, self.owner)}; allowed: {self.allowed}."
        fix = self.fix.render(self.owner) if isinstance(self.fix, _Fix) else self.fix
        return text + (f" Fix: {fix}" if fix else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


@contextmanager
def owned_by(owner: str) -> Iterator[None]:
    """Refusals of top-level arguments raised inside name the class they were passed to
    (``DeARStrategy(streams=17)``)."""
    try:
        yield
    except CommSchedConfigError as error:
        if error.owner is None:
            error.owner = owner
        raise


def _rebuild(
    message: str, field: Optional[str], value: Any, allowed: Optional[str], fix: Optional[object], owner: Optional[str]
) -> CommSchedConfigError:
    return CommSchedConfigError(message, field=field, value=value, allowed=allowed, fix=fix, owner=owner)


class PeerFailureError(RuntimeError):
    """A collective failed: a peer died, hung past the process-group timeout, or the link broke."""


class ScheduleError(RuntimeError):
    """The training step did something the schedule cannot keep exact (e.g. a stale parameter was read)."""


class _Fix:
    """A fix worded when the error is read (so in the syntax of the entry point then running)."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        self.field, self.value, self.why = field, value, why

    def render(self, owner: Optional[str]) -> str:
        return self.why.format(setting=setting(self.field, self.value, owner))

    def __str__(self) -> str:
        return self.render(None)


class Either:
    """Words that differ between the Python API and the command line (a fix naming a strategy or a
    group), chosen when the error is read."""

    def __init__(self, python: str, hydra: str) -> None:
        self.python, self.hydra = python, hydra

    def __str__(self) -> str:
        return self.hydra if _syntax[0] == "hydra" else self.python


def bad_value(
    field: str, value: Any, allowed: str | Iterable[Any], fix: Optional[object] = None, default: Any = _UNSET
) -> CommSchedConfigError:
    """The error for `field=value`. Given choices, a close one is offered as the fix; given the
    field's `default`, the fix names it."""
    if not isinstance(allowed, str):
        choices = list(allowed)
        allowed = "one of " + ", ".join(repr(a) for a in choices)
        if fix is None and isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.5)
            fix = _Fix(field, close[0], "did you mean {setting}?") if close else None  # type: ignore[assignment]
    if fix is None and default is not _UNSET and default is not None and default != value:
        fix = _Fix(field, default, "e.g. {setting} (the default).")  # type: ignore[assignment]
    return CommSchedConfigError(field=field, value=value, allowed=allowed, fix=fix)


def unknown_argument(owner: str, name: str, known: Iterable[str]) -> CommSchedConfigError:
    """`owner(name=...)` where `owner` takes no such argument, with the closest one it does take."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    fix = f"did you mean {owner}({close[0]}=...)?" if close else None
    return CommSchedConfigError(
        f"commsched: {owner}() has no argument {name!r}; allowed: {', '.join(known)}." + (f" Fix: {fix}" if fix else "")
    )

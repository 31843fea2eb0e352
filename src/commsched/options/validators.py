"""Generic checks of option values: each refuses with one wording of what it allows, whatever was
wrong (type, NaN, range), and names the field with its Hydra path (``fusion.bucket_cap_mb``).

`option(default, check)` is a dataclass field with its check; `validated(options, prefix)` runs
every field's check and the class's own `cross_check`.
"""

from __future__ import annotations

import dataclasses
import math
import socket
from dataclasses import field
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from commsched.errors import CommSchedConfigError, bad_value

Check = Callable[[str, Any], Any]
OptionsT = TypeVar("OptionsT")


def is_real(value: Any) -> bool:
    """A finite int or float, and not a bool (True is an int to Python, never a setting's number)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def is_integer(value: Any) -> bool:
    """An int, and not a bool."""
    return not isinstance(value, bool) and isinstance(value, int)


def positive_number(name: str, value: Any) -> float:
    if not (is_real(value) and value > 0):
        raise bad_value(name, value, "a number > 0")
    return float(value)


def positive_int(name: str, value: Any) -> int:
    if not (is_integer(value) and value >= 1):
        raise bad_value(name, value, "an integer >= 1")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if not (is_integer(value) and value >= 0):
        raise bad_value(name, value, "an integer >= 0")
    return value


def non_negative_number(name: str, value: Any) -> float:
    if not (is_real(value) and value >= 0):
        raise bad_value(name, value, "a number >= 0")
    return float(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(name, value, "True or False")
    return value


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise bad_value(name, value, allowed)
    return value


def one_of(*allowed: str) -> Check:
    return lambda name, value: choice(name, value, allowed)


def optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_value(name, value, "a non-empty string")
    return value


def network_interface(name: str, value: Any) -> str:
    """An interface of this machine (found now, before any worker starts, rather than as a gloo error per rank)."""
    present = [ifname for _, ifname in socket.if_nameindex()]
    if value not in present:
        raise bad_value(
            name,
            value,
            f"a network interface of this machine: {', '.join(present)}",
            fix="leave it unset to let the backend choose, or name one of those (`ip -brief link` lists them).",
        )
    return value


def timeout(value: Any) -> Optional[timedelta]:
    if value is not None and not (isinstance(value, timedelta) and value.total_seconds() > 0):
        raise bad_value("timeout", value, "a datetime.timedelta > 0 or None")
    return value


def warmup_value(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if not (is_integer(value) and value >= 0):
        raise bad_value(name, value, 'an integer >= 0 or "auto"')
    return value


def option(default: Any, check: Check) -> Any:
    """A dataclass field with its check."""
    return field(default=default, metadata={"check": check})


def validated(options: OptionsT, prefix: str = "") -> OptionsT:
    """Run every field's check (nested options too) and the class's own `cross_check`; returns `options`."""
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            validated(value, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            try:
                f.metadata["check"](f"{prefix}{f.name}", value)
            except CommSchedConfigError as error:
                if (
                    error.fix is None
                    and f.default is not dataclasses.MISSING
                    and f.default is not None
                    and f.default != value
                ):
                    raise bad_value(f"{prefix}{f.name}", value, error.allowed or "", default=f.default) from None
                raise
    cross_check = getattr(options, "cross_check", None)
    if cross_check is not None:
        cross_check(prefix)
    return options


def typed(name: str, value: Any, cls: type[OptionsT]) -> OptionsT:
    """`value` if it is a `cls`, else the error naming the argument."""
    if not isinstance(value, cls):
        where = "commsched" if cls.__module__.startswith("commsched") else cls.__module__
        raise bad_value(name, value, f"a {where}.{cls.__name__}")
    return value

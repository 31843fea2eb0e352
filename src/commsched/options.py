"""Validation of the strategies' constructor arguments: each bad value gets a message naming the field."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Optional

from commsched.errors import bad_value
from commsched.fusion import FUSION_POLICIES

START_METHODS = ("popen", "spawn", "fork", "forkserver")


def positive_number(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise bad_value(field, value, "a finite number > 0")
    return float(value)


def positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_value(field, value, "an integer >= 1")
    return value


def non_negative_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_value(field, value, "an integer >= 0")
    return value


def flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(field, value, "True or False")
    return value


def choice(field: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise bad_value(field, value, allowed)
    return value


def fusion_policy(value: Any) -> str:
    return choice("fusion", value, FUSION_POLICIES)


def timeout(value: Any) -> Optional[timedelta]:
    if value is not None and not (isinstance(value, timedelta) and value.total_seconds() > 0):
        raise bad_value("timeout", value, "a datetime.timedelta > 0 or None")
    return value

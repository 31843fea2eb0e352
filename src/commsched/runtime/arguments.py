"""The arguments every commsched strategy takes, checked once: the Trainer's strategies and Fabric's
take the same options with the same checks and the same messages."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

from commsched import errors, options
from commsched.options.comm_hook import check_comm_hook, hook_and_wire
from commsched.schedules import SCHEDULES, Schedule


def refuse_unknown_arguments(cls: type, kwargs: dict[str, Any]) -> None:
    """A misspelt argument is refused with the closest one `cls` takes, not with Python's bare TypeError."""
    known = list(inspect.signature(cls.__init__).parameters)[1:]
    for name in kwargs:
        if name not in known:
            raise errors.unknown_argument(cls.__name__, name, known)


@dataclass(frozen=True)
class Configured:
    """What a strategy's arguments come to, every one checked."""

    schedule_class: type[Schedule]
    options: options.StrategyOptions
    hook_read: Optional[str]
    """What a `ddp_comm_hook` was read as, to say once (None: no hook given)."""
    timeout: Optional[timedelta]
    start_method: str
    trace_collectives: bool
    broadcast_buffers: bool


def checked_arguments(
    owner: str,
    schedule: str,
    fusion: Any,
    bucket_cap_mb: Optional[float],
    tuning: Any,
    profile: Any,
    links: Any,
    deft: Any,
    preserver: Any,
    compression: Any,
    streams: Any,
    dear: Any,
    schedule_options: Any,
    comm_dtype: str,
    ddp_comm_hook: Optional[Callable[..., Any]],
    ddp_comm_state: Any,
    ddp_comm_wrapper: Optional[Callable[..., Any]],
    broadcast_buffers: bool,
    trace_collectives: bool,
    timeout: Optional[timedelta],
    start_method: str,
) -> Configured:
    """Every argument checked, each error naming `owner` (the strategy class), the field and what it allows."""
    with errors.owned_by(owner):
        name = options.choice("schedule", schedule, tuple(SCHEDULES))
        wire, hook_read, comm_hook = hook_and_wire(comm_dtype, ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper)
        schedule_class = SCHEDULES[name]
        checked = options.StrategyOptions.from_arguments(
            fusion,
            bucket_cap_mb,
            tuning,
            profile,
            links,
            deft,
            preserver,
            compression,
            streams,
            dear,
            name,
            schedule_class.options_class,
            schedule_options,
            wire,
            comm_hook,
        )
        options.check_schedule_takes(checked, name, schedule_class.compresses, schedule_class.stripes)
        check_comm_hook(checked, name, schedule_class.runs_comm_hooks)
        return Configured(
            schedule_class,
            checked,
            hook_read,
            options.timeout(timeout),
            options.choice("start_method", start_method, options.START_METHODS),
            options.flag("trace_collectives", trace_collectives),
            options.flag("broadcast_buffers", broadcast_buffers),
        )

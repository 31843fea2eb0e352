"""Every concern's options of one strategy, resolved from its constructor arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from commsched.errors import bad_value
from commsched.options.compression import CompressionOptions, compression_from
from commsched.options.dear import DeAROptions
from commsched.options.deft import DeFTOptions, PreserverOptions
from commsched.options.fusion import FusionOptions, ProfileOptions, TuningOptions, fusion_from, profile_from
from commsched.options.links import LinkOptions
from commsched.options.streams import StreamOptions, streams_value
from commsched.options.validators import typed, validated


@dataclass
class StrategyOptions:
    """Every concern's options of one strategy, resolved from its constructor arguments and validated."""

    fusion: FusionOptions
    tuning: TuningOptions
    profile: ProfileOptions
    links: LinkOptions
    deft: DeFTOptions = field(default_factory=DeFTOptions)
    preserver: PreserverOptions = field(default_factory=PreserverOptions)
    compression: CompressionOptions = field(default_factory=CompressionOptions)
    dear: DeAROptions = field(default_factory=DeAROptions)
    streams: int | str = 1
    """1..16 streams, or "auto" (checked by `streams_value`)."""
    stream_options: StreamOptions = field(default_factory=StreamOptions)
    schedule_options: Any = None
    """The running schedule's own options (its `Schedule.options_class`; for dear and deft the same
    object as `dear` and `deft`), None for a schedule that declares none."""

    @classmethod
    def from_arguments(
        cls,
        fusion: Any,
        bucket_cap_mb: Optional[float],
        tuning: Any,
        profile: Any,
        links: Any,
        deft: Any = None,
        preserver: Any = None,
        compression: Any = None,
        streams: Any = 1,
        stream_options: Any = None,
        dear: Any = None,
        schedule: str = "",
        options_class: Optional[type] = None,
        schedule_options: Any = None,
    ) -> "StrategyOptions":
        """`schedule_options`: the options of `schedule`, an instance of its `options_class`; for dear and
        deft another spelling of `dear` and `deft` (giving both is refused)."""
        if options_class is DeAROptions and schedule_options is not None:
            dear = _once("dear", dear, typed("schedule_options", schedule_options, DeAROptions))
        if options_class is DeFTOptions and schedule_options is not None:
            deft = _once("deft", deft, typed("schedule_options", schedule_options, DeFTOptions))
        resolved = cls(
            fusion_from(fusion, bucket_cap_mb),
            validated(typed("tuning", tuning or TuningOptions(), TuningOptions), "tuning."),
            profile_from(profile),
            validated(typed("links", links or LinkOptions(), LinkOptions), "links."),
            validated(typed("deft", deft or DeFTOptions(), DeFTOptions), "deft."),
            validated(typed("preserver", preserver or PreserverOptions(), PreserverOptions), "preserver."),
            compression_from(compression),
            validated(typed("dear", dear or DeAROptions(), DeAROptions), "dear."),
            streams_value("streams", streams),
            validated(typed("stream_options", stream_options or StreamOptions(), StreamOptions), "stream_options."),
        )
        builtin = {DeAROptions: resolved.dear, DeFTOptions: resolved.deft}
        resolved.schedule_options = (
            builtin[options_class]
            if options_class in builtin
            else own_options(schedule, options_class, schedule_options)
        )
        return resolved


def _once(name: str, given: Any, schedule_options: Any) -> Any:
    if given is not None:
        raise bad_value("schedule_options", schedule_options, f"None when {name}= is given (the same options twice)")
    return schedule_options


def own_options(schedule: str, options_class: Optional[type], value: Any) -> Any:
    """A schedule's own options: `value` (its defaults when None) checked against `options_class`."""
    if options_class is None:
        if value is not None:
            raise bad_value(
                "schedule_options",
                value,
                f"None: schedule {schedule} declares no options of its own (Schedule.options_class)",
            )
        return None
    return validated(
        typed("schedule_options", options_class() if value is None else value, options_class), f"{schedule}."
    )

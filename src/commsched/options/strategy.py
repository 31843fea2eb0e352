"""Every concern's options of one strategy, resolved from its constructor arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from commsched.errors import bad_value
from commsched.options.catalogue import COMM_DTYPES
from commsched.options.compression import CompressionOptions, check_compression, compression_from
from commsched.options.dear import DeAROptions
from commsched.options.deft import DeFTOptions, PreserverOptions
from commsched.options.fusion import FusionOptions, ProfileOptions, TuningOptions, fusion_from, profile_from
from commsched.options.links import LinkOptions
from commsched.options.streams import StreamOptions, check_streams, streams_from
from commsched.options.validators import choice, typed, validated


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
    streams: StreamOptions = field(default_factory=StreamOptions)
    comm_dtype: str = "fp32"
    """What gradients travel as (`COMM_DTYPES`): "fp32" as they are; "bf16" or "fp16" cast for every
    collective of gradients (half the bytes), averaged as DDP's compress hooks average them."""
    comm_hook: Any = None
    """A DDP communication hook run on each whole bucket (`commsched.options.comm_hook.CommHook`; Python
    only), or None."""
    schedule_options: Any = None
    """The running schedule's own options (its `Schedule.options_class`): a plugin's as given, for dear
    and deft the same object as `dear` and `deft`; None for a schedule that declares none."""

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
        streams: Any = None,
        dear: Any = None,
        schedule: str = "",
        options_class: Optional[type] = None,
        schedule_options: Any = None,
        comm_dtype: Any = "fp32",
        comm_hook: Any = None,
    ) -> "StrategyOptions":
        """`schedule_options`: a plugin schedule's own options, an instance of its `options_class`
        (the built-in schedules take theirs as `dear` and `deft`, one spelling each)."""
        if options_class in (DeAROptions, DeFTOptions) and schedule_options is not None:
            own = "dear" if options_class is DeAROptions else "deft"
            raise bad_value(
                "schedule_options", schedule_options, f"None for schedule {schedule}: its options are {own}="
            )
        resolved = cls(
            fusion_from(fusion, bucket_cap_mb),
            typed("tuning", tuning or TuningOptions(), TuningOptions),
            profile_from(profile),
            typed("links", links or LinkOptions(), LinkOptions),
            typed("deft", deft or DeFTOptions(), DeFTOptions),
            typed("preserver", preserver or PreserverOptions(), PreserverOptions),
            compression_from(compression),
            typed("dear", dear or DeAROptions(), DeAROptions),
            streams_from(streams),
            comm_dtype=choice("comm_dtype", comm_dtype, COMM_DTYPES),  # the strategy read a DDP hook into it
            comm_hook=comm_hook,
        )
        check_concerns(resolved)
        builtin = {DeAROptions: resolved.dear, DeFTOptions: resolved.deft}
        resolved.schedule_options = (
            builtin[options_class]
            if options_class in builtin
            else own_options(schedule, options_class, schedule_options)
        )
        return resolved


CONCERNS = ("fusion", "tuning", "profile", "links", "deft", "preserver", "compression", "dear", "streams")
"""The options objects every strategy takes, by the one name Python and the command line give each."""


def check_concerns(options: Any) -> None:
    """Every concern's own checks (`validated`), on the strategy's resolved options or on
    `commsched-train`'s typed configuration, which name each concern alike (`CONCERNS`)."""
    for concern in CONCERNS:
        validated(getattr(options, concern), f"{concern}.")


def check_schedule_takes(options: Any, schedule: str, compresses: bool, stripes: bool) -> None:
    """What only some schedules take, refused for the others: sparse or two-level exchanges
    (`compresses`), several streams (`stripes`). Torch-free: `commsched-train` calls it before it
    imports torch, the strategy when it is made."""
    check_compression(options.compression, schedule, compresses)
    check_streams(options.streams, schedule, stripes, options.compression, options.fusion.policy)


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

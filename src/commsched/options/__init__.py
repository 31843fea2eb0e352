"""Typed options, one object per concern, shared by the Python API and the Hydra schema.

Each field carries its own check (`metadata["check"]`), so adding an option is one edit in its concern's module: the
strategy's constructor, `commsched-train`'s schema and its validation all read these classes.
`validated(options, prefix)` runs every check and raises the error that names the field (with the
Hydra path, e.g. ``fusion.bucket_cap_mb``) and what is allowed. A docstring under each field says
what it is for.

One module per concern (`fusion`, `links`, `deft`, `dear`, `compression`, `streams`), the generic
checks (`validators`) and the names they accept (`catalogue`); everything is importable from here.
"""

from commsched.options.catalogue import (
    BACKENDS,
    BUILTIN,
    BUILTIN_SCHEDULES,
    COMM_DTYPES,
    COMPRESSING_SCHEDULES,
    COMPRESSION_METHODS,
    FALLBACKS,
    FUSION_POLICIES,
    MAX_STREAMS,
    MODEL_POLICIES,
    START_METHODS,
    STRIPING_SCHEDULES,
    ScheduleTraits,
)
from commsched.options.compression import (
    SPARSE_REFUSED,
    CompressionOptions,
    check_compression,
    compression_from,
    density_value,
)
from commsched.options.dear import DeAROptions
from commsched.options.deft import (
    DeFTOptions,
    PreserverOptions,
    capacity_value,
    check_preserver_settings,
    eps_value,
    growth_value,
)
from commsched.options.fusion import FusionOptions, ProfileOptions, TuningOptions, fusion_from, profile_from
from commsched.options.links import LinkOptions
from commsched.options.strategy import CONCERNS, StrategyOptions, check_concerns, check_schedule_takes
from commsched.options.streams import StreamOptions, check_streams, streams_from, streams_value
from commsched.options.validators import (
    Check,
    OptionsT,
    choice,
    flag,
    network_interface,
    non_negative_int,
    non_negative_number,
    one_of,
    option,
    optional,
    positive_int,
    positive_number,
    text,
    timeout,
    typed,
    validated,
    warmup_value,
)

__all__ = [
    "CONCERNS",
    "check_concerns",
    "check_schedule_takes",
    "ScheduleTraits",
    "BUILTIN",
    "BUILTIN_SCHEDULES",
    "MODEL_POLICIES",
    "FUSION_POLICIES",
    "START_METHODS",
    "BACKENDS",
    "FALLBACKS",
    "COMPRESSION_METHODS",
    "COMM_DTYPES",
    "COMPRESSING_SCHEDULES",
    "STRIPING_SCHEDULES",
    "MAX_STREAMS",
    "Check",
    "OptionsT",
    "positive_number",
    "positive_int",
    "non_negative_int",
    "non_negative_number",
    "flag",
    "choice",
    "one_of",
    "optional",
    "text",
    "network_interface",
    "timeout",
    "warmup_value",
    "option",
    "validated",
    "typed",
    "TuningOptions",
    "FusionOptions",
    "ProfileOptions",
    "fusion_from",
    "profile_from",
    "LinkOptions",
    "capacity_value",
    "DeFTOptions",
    "eps_value",
    "growth_value",
    "PreserverOptions",
    "check_preserver_settings",
    "DeAROptions",
    "density_value",
    "CompressionOptions",
    "SPARSE_REFUSED",
    "check_compression",
    "compression_from",
    "streams_value",
    "streams_from",
    "StreamOptions",
    "check_streams",
    "StrategyOptions",
]

"""Typed options, one object per concern, shared by the Python API and the Hydra schema.

Each field carries its own check (`metadata["check"]`), so adding an option is one edit in its concern's module: the
strategy's constructor, `commsched-train`'s schema and its validation all read these classes.
`validated(options, prefix)` runs every check and raises the error that names the field (with the
Hydra path, e.g. ``fusion.bucket_cap_mb``) and what is allowed. A docstring under each field says
what it is for.

One module per concern (`fusion`, `links`, `deft`, `dear`, `compression`, `streams`), the generic
checks (`validators`) and the names they accept (`catalogue`); everything is importable from here.
"""

from commsched.options.catalogue import ScheduleTraits, BUILTIN, BUILTIN_SCHEDULES, MODEL_POLICIES, FUSION_POLICIES, START_METHODS, BACKENDS, FALLBACKS, COMPRESSION_METHODS, COMPRESSING_SCHEDULES, STRIPING_SCHEDULES, MAX_STREAMS
from commsched.options.validators import Check, OptionsT, positive_number, positive_int, non_negative_int, non_negative_number, flag, choice, one_of, optional, text, network_interface, timeout, warmup_value, option, validated, typed
from commsched.options.fusion import TuningOptions, FusionOptions, ProfileOptions, fusion_from, profile_from
from commsched.options.links import LinkOptions
from commsched.options.deft import capacity_value, DeFTOptions, eps_value, growth_value, PreserverOptions, check_preserver_settings
from commsched.options.dear import DeAROptions
from commsched.options.compression import density_value, CompressionOptions, SPARSE_REFUSED, check_compression, compression_from
from commsched.options.streams import streams_value, StreamOptions, check_streams
from commsched.options.strategy import StrategyOptions

__all__ = [
    "ScheduleTraits",
    "BUILTIN",
    "BUILTIN_SCHEDULES",
    "MODEL_POLICIES",
    "FUSION_POLICIES",
    "START_METHODS",
    "BACKENDS",
    "FALLBACKS",
    "COMPRESSION_METHODS",
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
    "StreamOptions",
    "check_streams",
    "StrategyOptions",
]

"""Every concern's options of one strategy, resolved from its constructor arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from commsched.options.checks import validated, typed
from commsched.options.compression import CompressionOptions, compression_from
from commsched.options.dear import DeAROptions
from commsched.options.deft import DeFTOptions, PreserverOptions
from commsched.options.fusion import TuningOptions, FusionOptions, ProfileOptions, fusion_from, profile_from
from commsched.options.links import LinkOptions
from commsched.options.streams import streams_value, StreamOptions


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

    @classmethod
    def from_arguments(cls, fusion: Any, bucket_cap_mb: Optional[float], tuning: Any, profile: Any, links: Any,
                       deft: Any = None, preserver: Any = None, compression: Any = None, streams: Any = 1,
                       stream_options: Any = None, dear: Any = None) -> "StrategyOptions":
        return cls(fusion_from(fusion, bucket_cap_mb),
                   validated(typed("tuning", tuning or TuningOptions(), TuningOptions), "tuning."),
                   profile_from(profile),
                   validated(typed("links", links or LinkOptions(), LinkOptions), "links."),
                   validated(typed("deft", deft or DeFTOptions(), DeFTOptions), "deft."),
                   validated(typed("preserver", preserver or PreserverOptions(), PreserverOptions), "preserver."),
                   compression_from(compression), validated(typed("dear", dear or DeAROptions(), DeAROptions), "dear."),
                   streams_value("streams", streams),
                   validated(typed("stream_options", stream_options or StreamOptions(), StreamOptions), "stream_options."))

"""Several modules or optimizers under one Fabric: a GAN's generator and discriminator set up apart, each with
its own optimizer (Fabric's DCGAN example), or one module stepped by two optimizers.

Fabric's ddp wraps each module set up in a `DistributedDataParallel` of its own: a backward averages the
gradients of the modules it reached, and leaves a module it did not reach alone (a discriminator's
backward on a detached fake never touches the generator). Each module here has an engine of its own
(`FabricPart`), all on one set of links, and follows the same rule: the buckets of a module whose hooks
saw a gradient are finished when the backward returns, as DDP's are; the others wait for a backward that
reaches them. A module's optimizer then steps `.grad` as it is.

The schedules that apply an update part by part in the next forward (DeAR, DeFT) cannot serve this: a
discriminator stepped after two backwards, and a generator's backward through the discriminator between
its steps, would overtake a deferred update. Those hand every iteration to WFBP (DDP's schedule, exact
with any number of modules and optimizers), and every part keeps DDP's fixed buckets: a planner times the
steps of one module with one optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from commsched.errors import CommSchedConfigError
from commsched.options import StrategyOptions
from commsched.runtime.buffer_sync import BufferSync
from commsched.runtime.engine import Engine


@dataclasses.dataclass(eq=False)
class FabricPart:
    """One module set up with Fabric: the engine that averages its gradients, and where its loop is."""

    module: nn.Module
    """The user's module (unwrapped)."""
    engine: Engine
    buffers: BufferSync
    optimizers: list[Optimizer] = dataclasses.field(default_factory=list)
    """The optimizers stepping this module's parameters."""
    batch_open: bool = False
    """A forward with gradients ran since the last backward: the batch has started."""
    backward_pending: bool = False
    """A synchronised backward ran; its collectives are not finished yet (one module, one optimizer)."""

    def steps(self, optimizer: Optimizer) -> bool:
        """Whether `optimizer` steps any parameter of this module."""
        mine = {id(p) for p in self.module.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


class PartView:
    """A part as its engine reads a strategy: its own module and schedule, everything else the strategy's."""

    def __init__(self, strategy: Any, part: FabricPart) -> None:
        self._strategy = strategy
        self._part = part

    @property
    def lightning_module(self) -> nn.Module:
        return self._part.module

    @property
    def schedule(self) -> Any:
        return self._part.engine.schedule

    @property
    def bucket_plan(self) -> Any:
        schedule = self._part.engine.schedule
        return schedule.plan if schedule is not None else None

    @property
    def profile(self) -> Optional[dict[str, Any]]:
        return None  # parts are not profiled (`Engine.serve_as_part`)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)


BY_PARTS = (
    "this Fabric loop steps several modules or optimizers by hand, on DDP's fixed buckets; an update applied "
    "bucket by bucket in the next forward would be overtaken by another backward"
)
"""Why a schedule that steps the model part by part hands every iteration to WFBP here."""


def refuse_by_parts(options: StrategyOptions, name: str, what: str) -> None:
    """The options a loop over several modules or optimizers cannot have, each with the way out. `what`: the
    loop's modules and optimizers, in words."""
    refused = [
        (
            "compression",
            options.compression.method != "none",
            "'none'",
            "a sparse exchange keeps residuals "
            "across backwards, and a backward that reaches a module it does not step would send them",
        ),
        ("ddp_comm_hook", options.comm_hook is not None, "None", "a hook's state is kept per bucket of one module"),
        (
            "fusion",
            options.fusion.policy not in ("auto", "fixed"),
            "'auto' or 'fixed'",
            "planners time the steps of one module with one optimizer",
        ),
        ("profile", bool(options.profile.steps), "ProfileOptions() (no profile)", "the profiler times one module"),
        ("streams", options.streams.count == "auto", "a number of streams", "the stream search times one module"),
    ]
    for field, set_, allowed, why in refused:
        if set_:
            raise CommSchedConfigError(
                f"commsched: invalid {field} under strategy='{name}' with {what}: {why}; allowed here: {allowed} "
                "(or one module with one optimizer)"
            )

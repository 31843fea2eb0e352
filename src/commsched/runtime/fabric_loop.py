"""A Fabric loop as the engine reads a Trainer, and the module wrapper that finds its batch boundaries.

The engine, the planners, the profiler and the schedules' settings read a handful of the Trainer's
attributes (world size, the step count, the logger, where files go). A Fabric loop has no Trainer:
the user writes the loop. `FabricLoop` answers those reads with what a Fabric run knows (no logger, no
folder of its own, no clipping configured ahead, the optimizer steps the strategy counted). The Trainer
calls its strategy at each batch start and around `training_step`; in a Fabric loop the only calls
are the forward, `fabric.backward`, `optimizer.step()` and `fabric.clip_gradients`, so the wrapper
`ScheduledModule` marks a batch's start at the first forward with gradients after a backward (or after
setup), as DDP's own wrapper prepares its buckets in forward.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch
from torch import nn


class FabricLoop:
    """The Trainer's attributes the engine reads, answered for a loop the user writes."""

    gradient_clip_val: Optional[float] = None
    """Fabric clips when the user calls `fabric.clip_gradients`: nothing is configured ahead."""
    gradient_clip_algorithm: Optional[str] = None
    num_training_batches: float = math.inf
    """The user's loader is not known to the strategy: no epoch to count in."""
    accumulate_grad_batches: int = 1
    estimated_stepping_batches: float = math.inf
    logger: Any = None
    log_dir: Optional[str] = None
    train_dataloader: Any = None

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        """The `CommSchedFabricStrategy` running the loop."""
        self.global_step = 0
        """Optimizer steps taken (the strategy counts them)."""
        self.callbacks: list[Any] = []
        self.loggers: list[Any] = []
        self.checkpoint_callbacks: list[Any] = []
        self.checkpoint_callback: Any = None

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def num_nodes(self) -> int:
        return self.strategy.num_nodes

    @property
    def num_devices(self) -> int:
        return self.strategy.num_processes

    @property
    def precision_plugin(self) -> Any:
        return self.strategy.precision

    @property
    def default_root_dir(self) -> str:
        return os.getcwd()

    @property
    def optimizers(self) -> list[Any]:
        return self.strategy.optimizers


class ScheduledModule(nn.Module):
    """The user's module, its forward passed through the strategy (as `DistributedDataParallel` wraps it
    under Fabric's ddp): the strategy's checkpoints and `fabric.save` unwrap it, so its state dict is the
    user's module's."""

    def __init__(self, module: nn.Module, strategy: Any) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_strategy", strategy)  # not a submodule: no parameters, no state of its own

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The strategy's steps run eagerly on each side of the module, which `torch.compile` (given to
        `fabric.setup` compiled, Fabric compiles this wrapper) traces alone; tracing tells the strategy."""
        self._strategy.forward_starts(self.module, torch.compiler.is_compiling())
        output = self.module(*args, **kwargs)
        self._strategy.forward_ends(self.module)
        return output

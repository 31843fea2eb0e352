"""What the workers compare of an optimizer: every tensor of its state, flat."""

from __future__ import annotations

import torch


def flat(optimizers: dict) -> dict:
    """Every tensor of the optimizers' states (sparse ones made dense), keyed by optimizer name, parameter
    index and state name."""
    kept = {
        f"{name}.{index}.{key}": torch.as_tensor(value)
        for name, optimizer in optimizers.items()
        for index, state in optimizer.state_dict()["state"].items()
        for key, value in state.items()
    }
    return {key: value.to_dense() if value.is_sparse else value for key, value in kept.items()}

"""Communication state in Lightning checkpoints.

Everything the engine keeps across steps goes into ``checkpoint["commsched"]``:

- ``plan``: the plan policy's state (the decided fusion plan, tuning progress), equal on all ranks;
- ``shared``: the schedule's state that is equal on every rank (saved once);
- ``per_rank``: the schedule's state that differs between ranks (delayed local gradients,
  error-feedback residuals), written by each rank into a file of its own beside the checkpoint
  (`commsched.rank_parts`; the checkpoint names them under ``per_rank_parts``) and handed back to the
  same rank on resume; gathered into the checkpoint itself only where it is saved to a URL.

Schedule state is keyed by parameter name, never by bucket index, so it survives a different
bucket layout (a rebuild, a re-plan, a plan file). State that holds training signal (delayed
gradients, residuals: tensors) is never dropped silently: a checkpoint resumed at another world
size, by another schedule, or by a schedule that does not keep that state is refused with a
message. Plans and decisions are dropped with a log line (a plan is planned for one world size
and one schedule) and decided again.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from commsched import rank_parts
from commsched.errors import CommSchedConfigError
from commsched.say import say

KEY = "commsched"
VERSION = 3
"""3: per-rank state beside the checkpoint (`rank_parts`); 2: gathered into it."""
AFTER_FAILURE_KEY = "commsched_after_failure"
"""In a checkpoint saved after a failed run whose weights do not hold the step its counters count:
what they hold, in a sentence (a resume from it is warned)."""


def warn_if_saved_after_failure(checkpoint: dict[str, Any]) -> None:
    held = checkpoint.get(AFTER_FAILURE_KEY)
    if held:
        say(
            "commsched: this checkpoint was saved after a run failed, and its step count "
            f"({checkpoint.get('global_step')}) includes a step its weights do not hold ({held}): resuming from it "
            "skips that step's update; the last checkpoint saved before the failure resumes exactly"
        )


def to_cpu(state: Any) -> Any:
    """A copy of `state` with every tensor on the CPU (checkpoints load on any machine)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


def has_tensors(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return True
    if isinstance(state, dict):
        return any(has_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(has_tensors(v) for v in state)
    return False


def gather_to_rank0(mine: Any, world_size: int) -> Optional[list[Any]]:
    """Every rank's per-rank state, on rank 0 (None elsewhere); a collective on the default group."""
    everyone: Optional[list[Any]] = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(to_cpu(mine), everyone, dst=0)
    return everyone


def per_rank_saved(mine: Any, world_size: int, checkpoint_path: Any) -> dict[str, Any]:
    """Collective: this rank's state beside the checkpoint (`rank_parts`), or gathered to rank 0 where the
    checkpoint goes to a URL; what the checkpoint's entry holds of it."""
    if checkpoint_path is not None and rank_parts.local(checkpoint_path):
        return {"per_rank": None, rank_parts.PARTS_KEY: rank_parts.write(checkpoint_path, to_cpu(mine), world_size)}
    return {"per_rank": gather_to_rank0(mine, world_size)}


def entry(schedule: str, world_size: int, plan: Any, shared: Any, per_rank: dict[str, Any]) -> dict[str, Any]:
    """`per_rank`: from `per_rank_saved`."""
    return {
        "version": VERSION,
        "schedule": schedule,
        "world_size": world_size,
        "plan": plan,
        "shared": to_cpu(shared),
        **per_rank,
    }


class Restored:
    """What a checkpoint's communication state gives this rank, checked against the current run."""

    def __init__(self, checkpoint: dict[str, Any], schedule: str, rank: int, world_size: int, path: Any = None) -> None:
        """`path`: where the checkpoint was read from (each rank's part lies beside it)."""
        saved = checkpoint.get(KEY)
        saved = saved or {}
        parts = saved.get(rank_parts.PARTS_KEY)
        per_rank = saved.get("per_rank")
        saved_world = saved.get("world_size")
        same_world = saved_world in (None, world_size)
        everyone = lambda: per_rank if parts is None else rank_parts.read_all(path, parts)  # noqa: E731
        held = per_rank is not None or parts is not None
        resharded = summed_residuals(everyone()) if not same_world and held else None
        if not same_world and held and resharded is None and any(has_tensors(state) for state in everyone()):
            raise CommSchedConfigError(
                f"commsched: this checkpoint was written by {saved_world} processes and holds per-rank communication "
                f"state of schedule '{saved.get('schedule')}' (delayed gradients or residuals that differ per rank); "
                f"it cannot be resumed by {world_size} processes without changing the result. Resume it with "
                f"{saved_world} processes, or load only the weights (e.g. LightningModule.load_from_checkpoint)."
            )
        same_schedule = saved.get("schedule") in (None, schedule)
        mine = None
        if same_world and parts is not None:
            rank_parts.refuse_missing(path, parts, rank)
            mine = rank_parts.read(path, parts, rank)
        elif same_world and per_rank is not None:
            mine = per_rank[rank]
        if not same_schedule and (
            has_tensors(saved.get("shared")) or (held and any(has_tensors(state) for state in everyone()))
        ):
            raise CommSchedConfigError(
                f"commsched: this checkpoint holds communication state of schedule '{saved.get('schedule')}' (delayed "
                f"gradients or residuals) that schedule '{schedule}' cannot take: resuming would drop it. Resume with "
                f"schedule '{saved.get('schedule')}', or load only the weights "
                "(e.g. LightningModule.load_from_checkpoint)."
            )
        if not same_schedule and (saved.get("shared") or held):
            say(
                f"commsched: the checkpoint's decisions of schedule '{saved.get('schedule')}' "
                f"are not used by '{schedule}'"
            )
        self.plan: Any = saved.get("plan") if same_world else None
        self.shared: Any = (saved.get("shared") or {}) if same_schedule else {}
        self.mine: Any = (mine or {}) if same_schedule else {}
        if resharded and "powersgd_error" in resharded:
            # PowerSGD's errors are in one rank's undivided units (the hook averages them): the ranks owe their
            # mean, so each new rank takes the old mean (the reducers divide totals by the new world size)
            resharded["powersgd_error"] = {
                name: total * (world_size / saved_world) for name, total in resharded["powersgd_error"].items()
            }
        if resharded and same_schedule:
            kinds = " and ".join(
                {"residual": "error-feedback residuals", "momentum": "velocities", "powersgd_error": "PowerSGD errors"}[
                    kind
                ]
                for kind in resharded
            )
            say(
                f"commsched: the checkpoint's {kinds} of {saved_world} processes are re-sharded over "
                f"{world_size}: their sum is kept, each rank takes its share"
            )
            self.mine = {"reducers": {RESIDUAL_TOTAL: resharded}}


RESIDUAL_TOTAL = "residual_total"
"""Every old rank's residuals (and DGC velocities) summed, by kind and parameter name: what a resume at
another world size hands each rank."""
SUMMABLE = ("residual", "momentum", "powersgd_error")
"""Per-rank kinds whose sum over ranks is all that matters: what the ranks together still owe the model
(error feedback, top-k's and PowerSGD's) and the velocity of their summed gradients (DGC's momentum is linear)."""


def summed_residuals(per_rank: Iterable[Any]) -> Optional[dict[str, dict[str, torch.Tensor]]]:
    """The sum over ranks of the reducers' residuals and velocities, by kind, when they are the only
    tensors of the per-rank state (None otherwise: other state cannot be re-sharded)."""
    total: dict[str, dict[str, torch.Tensor]] = {}
    for state in per_rank:
        state = state or {}
        reducers = state.get("reducers", {})
        if has_tensors({k: v for k, v in state.items() if k != "reducers"}) or set(reducers) - set(SUMMABLE):
            return None
        for kind in SUMMABLE:
            kept = total.setdefault(kind, {})
            for name, tensor in reducers.get(kind, {}).items():
                kept[name] = kept[name] + tensor if name in kept else tensor.clone()
    return {kind: kept for kind, kept in total.items() if kept}


def refuse_unknown(schedule: str, state: dict[str, Any], known: Iterable[str]) -> None:
    """A schedule's `load_state_dict` calls this: state it does not keep, but which holds training signal
    (tensors, e.g. residuals of a compression this run does not use), is refused rather than dropped."""
    unknown = {key: value for key, value in state.items() if key not in set(known)}
    if any(has_tensors(value) for value in unknown.values()):
        raise CommSchedConfigError(
            f"commsched: the checkpoint holds communication state {sorted(unknown)} that schedule '{schedule}' as "
            "configured now does not keep: resuming would drop it. Resume with the options that wrote it, or load "
            "only the weights (e.g. LightningModule.load_from_checkpoint)."
        )
    if unknown:
        say(f"commsched: the checkpoint's {sorted(unknown)} are not used by schedule '{schedule}'")

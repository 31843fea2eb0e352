"""A single-process replay of DeFT's runs (tests/workers/run_deft.py), written apart from the product:
every rank's gradient recomputed in one process, the plan's merges, staleness and steps, each
compensation written out, and the watch's verdicts judged on the replay's own losses."""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from commsched.deft.plan import DeFTPlan
from conftest import WORKERS


def replay(result: dict, compensation: str = "none", watch: Optional[tuple] = None) -> Any:
    """One process, every rank's gradient recomputed: the plan's merges, staleness and steps. With
    compensation "spike", SGD's step is written out here: a generation D optimizer steps late (steps
    taken since its newest gradient) moves the weights by lr (v + a d) with v <- m v + b d, d its gradient
    plus weight decay, a = (1 - m^D) / (1 - m), b = m^D. With "predict", each planned iteration's
    gradients are taken at w + D (w - w_before_last_step), D the optimizer steps until its generation
    steps; "spike+predict": both.

    `watch` = (window, rollback[, steps where it is solved again]): which plan ran each batch is read from the run's
    history (plans solved again after a stop or a re-check); the verdicts are the replay's own: after `window`
    iterations of a stale plan, it is stopped unless the mean loss over them (every rank's batch) is below that of the
    up to `window` iterations before it, since measuring last (re)started. Stopped: back to the state at
    its start (rollback: weights, velocity, optimizer state but not its learning rate; its generations
    dropped) or its generations applied in order, and no stale plan is watched again. A re-check solves
    again (in flight applied) and wins over a verdict due at the same step. Returns (state, verdicts)."""
    sys.path.insert(0, str(WORKERS))
    from run_deft import BATCH, MLP, data, make_optimizer

    world, model = result["world"], MLP(result["optimizer"])
    model.load_state_dict(result["initial"])
    configured = make_optimizer(result["optimizer"], model.parameters())
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    x, y = data().tensors
    params = list(model.parameters())
    plan = DeFTPlan.from_json(result["plan"])

    # Lightning's DistributedSampler for training: shuffled, seeded by seed_everything, epoch 0
    shares = []
    for r in range(world):
        sampler = DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True, seed=result["seed"])
        sampler.set_epoch(0)
        shares.append(list(sampler))

    losses: list[float] = []

    def averaged_gradient(t: int) -> list[torch.Tensor]:
        total, loss = [torch.zeros_like(p) for p in params], 0.0
        for r in range(world):
            idx = shares[r][t * BATCH : (t + 1) * BATCH]
            rank_loss = F.cross_entropy(model(x[idx]), y[idx])
            grads = torch.autograd.grad(rank_loss, params)
            total = [a + g / world for a, g in zip(total, grads)]
            loss += float(rank_loss.detach()) / world
        losses.append(loss)
        return total

    def what_runs(t: int) -> tuple[Optional[DeFTPlan], int]:
        """(the plan and its replay index, or None for a synchronous step) at batch t."""
        if watch is None:
            return (None, 0) if t < result["sync_steps"] else (plan, t - result["sync_steps"])
        _, index, solved = result["history"][t]
        return (None, 0) if index is None else (DeFTPlan.from_json(solved), index)

    velocity: dict[int, torch.Tensor] = {}
    taken = 0  # optimizer steps so far
    joined_at: dict[int, int] = {}
    before_last_step = [p.detach().clone() for p in params]

    def late_by(running: DeFTPlan, i: int) -> int:
        """How late iteration i's gradient lands: its generation's position among the plan's optimizer steps."""
        events = [(j, number) for j in range(i + 2 * running.n + 8) for number in running.at(j).steps]
        applied = next(e for e, (_, number) in enumerate(events) if number == running.at(i).joins)
        return applied - sum(1 for j, _ in events if j < i)

    @torch.no_grad()
    def spike(gradient: list[torch.Tensor], late: int) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        for group in optimizer.param_groups:
            m, decay, lr = group["momentum"], group["weight_decay"], group["lr"]
            for p in group["params"]:
                i = index[id(p)]
                d = gradient[i] + decay * p
                if m == 0:
                    p.sub_(lr * d)
                    continue
                a, b = (1 - m**late) / (1 - m), m**late
                velocity[i] = b * d if i not in velocity else m * velocity[i] + b * d
                p.sub_(lr * (velocity[i] + a * d))

    def step(gradient: list[torch.Tensor], late: int = 0) -> None:
        nonlocal taken, before_last_step
        before_last_step = [p.detach().clone() for p in params]
        if compensation.startswith("spike"):
            spike(gradient, late)
            optimizer._opt_called = True  # the step is written out here: the scheduler must not warn
        else:
            for p, g in zip(params, gradient):
                p.grad = g.clone()
            optimizer.step()
        taken += 1

    def apply_what_is_left() -> None:
        for number in sorted(generations):
            summed, k = generations.pop(number)
            step([g / k for g in summed], taken - joined_at[number])

    generations: dict[int, list] = {}
    watched_from, snapshot, verdicts, judged, refused = None, None, [], False, False
    measured_from = 0  # where measuring (re)started
    for t in range(result["steps"]):
        running, i = what_runs(t)
        rechecked = watch is not None and len(watch) > 2 and t in watch[2]
        if rechecked:  # solved again (the Preserver's re-check): in flight is applied, the plan not judged
            apply_what_is_left()
            watched_from, judged, measured_from = None, False, t
        elif watch is not None and watched_from is not None and t == watched_from + watch[0]:
            before = losses[max(measured_from, watched_from - watch[0]) : watched_from]
            after = sum(losses[watched_from:t]) / watch[0]
            stopped = not after < sum(before) / len(before)
            verdicts.append("stopped" if stopped else "kept")
            watched_from, judged, refused = None, True, refused or stopped
            if stopped and watch[1]:
                generations.clear()
                model.load_state_dict(snapshot[0])
                optimizer.load_state_dict({**optimizer.state_dict(), "state": snapshot[1]})  # its learning rate stays
                velocity.clear()
                velocity.update(snapshot[2])
                taken = snapshot[3]
            elif stopped:
                apply_what_is_left()
            if stopped:
                measured_from = t
        if watch is not None and not judged and not refused and running is not None and running.staleness and i == 0:
            watched_from = t
            snapshot = (
                copy.deepcopy(model.state_dict()),
                copy.deepcopy(optimizer.state_dict()["state"]),
                {k: v.clone() for k, v in velocity.items()},
                taken,
            )
        now = [p.detach().clone() for p in params]
        if compensation.endswith("predict") and running is not None:  # linear weight prediction
            with torch.no_grad():
                for p, w, before in zip(params, now, before_last_step):
                    p.copy_(w + late_by(running, i) * (w - before))
        gradient = averaged_gradient(t)
        with torch.no_grad():
            for p, w in zip(params, now):
                p.copy_(w)
        if running is None:
            step(gradient)
            scheduler.step()
            continue
        it = running.at(i)
        summed, k = generations.get(it.joins, ([torch.zeros_like(p) for p in params], 0))
        generations[it.joins] = ([a + g for a, g in zip(summed, gradient)], k + 1)
        joined_at[it.joins] = taken
        for number in it.steps:
            summed, k = generations.pop(number)
            step([g / k for g in summed], taken - joined_at[number])
            scheduler.step()
    apply_what_is_left()  # the end of training
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return (state, verdicts) if watch is not None else state

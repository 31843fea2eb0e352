"""The user's optimizer under a schedule: its step replaced while Lightning runs its own, its hooks
run once around the whole step, and which optimizers may be stepped on part of their parameters.

**The step replaced.** Lightning runs its whole optimizer step (closure, hooks, clipping) while a
schedule decides what `optimizer.step` does: DeAR defers it to the next forward, DeFT takes it only
when a generation is complete.

**Stepped by part.** DeAR applies a step's update bucket by bucket, as each bucket's all-gather lands in the next
forward. That is the step a single `optimizer.step()` would take only if the optimizer computes
each parameter's update from that parameter's gradient and state and the group's hyper-parameters
alone. torch's element-wise optimizers do. Others do not: Prodigy and D-Adaptation sum over every
parameter of a group inside `step()` (their `d` estimate), schedule-free keeps group-level weights
and counters, LAMB and LARS take norms over the whole step. Those are stepped whole instead, once
every all-gather of the step has landed: still exact, with less of the all-gathers hidden.

The rule is by class, exactly (a subclass may override `step`): the classes below, whose rules were
checked here by `check_splits_exactly`, and the classes a user declares (`DeAROptions.per_parameter`),
checked the same way before their first split step.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from commsched.errors import CommSchedConfigError

RealStep = Callable[..., Any]


def run_with_step_replaced(
    optimizer: Optimizer, run_step: Callable[[], Any], instead: Callable[[RealStep, dict[str, Any]], None]
) -> Any:
    """Run `run_step` with `optimizer.step(closure)` running the closure, then `instead(quiet_step, kwargs)`.

    The step hooks users register (`register_step_pre_hook`, `register_step_post_hook`, torch's global
    ones: EMA, schedule-free and logging libraries hook there) run once per optimizer step, around the
    whole of it (`hooked_step`), with the param groups and hyper-parameters the user set, as under ddp;
    `quiet_step`, the optimizer's own step without them, may be called any number of times, on part of
    the parameters (DeAR steps bucket by bucket) or with other values (DGC's zeroed momentum)."""
    real_step = optimizer.step
    had_instance_step = "step" in optimizer.__dict__

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        def body(quiet_step: RealStep, kwargs: dict[str, Any]) -> Any:
            closure = kwargs.get("closure")
            loss = closure() if closure is not None else None
            instead(quiet_step, {k: v for k, v in kwargs.items() if k != "closure"})
            return loss

        return hooked_step(optimizer, real_step, {"closure": closure, **kwargs}, body)

    optimizer.step = replaced  # type: ignore[method-assign]
    try:
        return run_step()
    finally:
        if had_instance_step:
            optimizer.step = real_step  # type: ignore[method-assign]
        else:
            del optimizer.step


def hooked_step(
    optimizer: Optimizer, real_step: RealStep, kwargs: dict[str, Any], body: Callable[[RealStep, dict[str, Any]], Any]
) -> Any:
    """One optimizer step as torch's own runs it: the pre-hooks (which may give new kwargs), then
    `body(quiet_step, kwargs)` in place of the step, then the post-hooks."""
    args, kwargs = _run_pre_hooks(optimizer, kwargs)

    def quiet_step(**step_kwargs: Any) -> Any:
        with _hooks_silenced(optimizer):
            return real_step(**step_kwargs)

    result = body(quiet_step, kwargs)
    for hook in chain(
        optimizer._optimizer_step_post_hooks.values(), torch_optimizer._global_optimizer_post_hooks.values()
    ):
        hook(optimizer, args, kwargs)
    return result


def _run_pre_hooks(optimizer: Optimizer, kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch's order and contract: global hooks first, each may return new `(args, kwargs)`."""
    args: tuple[Any, ...] = (optimizer,)
    for hook in chain(
        torch_optimizer._global_optimizer_pre_hooks.values(), optimizer._optimizer_step_pre_hooks.values()
    ):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"an optimizer step pre-hook must return None or a tuple (new_args, new_kwargs), got {result!r}"
                )
            args, kwargs = result
    return args, kwargs


@contextlib.contextmanager
def _hooks_silenced(optimizer: Optimizer) -> Iterator[None]:
    """The step hooks (the optimizer's own and torch's global ones) out of the way for one call.

    The dicts are replaced by empty ones, never emptied: a partial step may run from inside a hook
    (a pre-hook that reads a pending weight applies it), while torch or `_run_pre_hooks` iterates
    the very dict the hook came from. A hook registered meanwhile joins the user's dicts after."""
    owned = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    shared = (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    quiet = [OrderedDict() for _ in range(4)]
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = quiet[0], quiet[1]
    torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks = quiet[2], quiet[3]
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = owned
        torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks = shared
        for hooks, added in zip((*owned, *shared), quiet):
            hooks.update(added)


KNOWN_PER_PARAMETER = frozenset(
    {
        *(
            f"torch.optim.{module}.{name}"
            for module, name in (
                ("sgd", "SGD"),
                ("adam", "Adam"),
                ("adamw", "AdamW"),
                ("rmsprop", "RMSprop"),
                ("adagrad", "Adagrad"),
                ("adamax", "Adamax"),
                ("nadam", "NAdam"),
                ("radam", "RAdam"),
                ("asgd", "ASGD"),
                ("adadelta", "Adadelta"),
                ("rprop", "Rprop"),
            )
        ),
        "lion_pytorch.lion_pytorch.Lion",  # lion-pytorch: sign of an interpolated momentum, element-wise
    }
)
"""Qualified class names (`module.Class`) of optimizers whose step is a function of each parameter alone."""


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class StepMode:
    """How DeAR steps one optimizer: `split` (bucket by bucket as the all-gathers land) or whole."""

    split: bool
    why: str

    def describe(self, optimizer: Optimizer) -> str:
        name = type(optimizer).__name__
        if self.split:
            return f"the optimizer ({name}) steps bucket by bucket as the all-gathers land: {self.why}"
        return (
            f"the optimizer ({name}) steps whole once every all-gather of the step has landed: {self.why}; "
            "DeAROptions(per_parameter=[...]) declares a class whose step treats each parameter alone"
        )


def per_parameter_classes(declared: Iterable[Any]) -> list[type]:
    """The classes `DeAROptions.per_parameter` names (classes, or `module.Class` strings imported now)."""
    classes = []
    for entry in declared:
        if isinstance(entry, type):
            classes.append(entry)
            continue
        module, _, name = str(entry).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as error:
            raise CommSchedConfigError(
                f"dear.per_parameter: {entry!r} is not an importable class ({error}); give "
                "'package.module.Class' or the class itself"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
            raise CommSchedConfigError(f"dear.per_parameter: {entry!r} is not a torch.optim.Optimizer subclass")
        classes.append(cls)
    return classes


def step_mode(optimizer: Optimizer, declared: Sequence[type]) -> StepMode:
    """Split only for a class known to step each parameter alone, or declared so and checked here."""
    cls = type(optimizer)
    name = qualified_name(cls)
    if name in KNOWN_PER_PARAMETER:
        return StepMode(True, f"{name} steps each parameter alone")
    if cls in declared:
        check_splits_exactly(cls, optimizer.param_groups)
        return StepMode(
            True,
            f"{name} is declared per-parameter (DeAROptions.per_parameter) and a split step on "
            "random tensors equalled a whole one",
        )
    return StepMode(False, f"{name} is not known to step each parameter alone (its step may read the whole group)")


def check_splits_exactly(cls: type, groups: list[dict[str, Any]], steps: int = 3) -> None:
    """Two copies of `cls` on the same random tensors, with the user's group settings: one stepped
    whole, one in two parts with the group's settings put back in between, as DeAR steps; refused
    unless they agree (values and state, 1e-6) and the split step wrote nothing into its groups."""
    generator = torch.Generator().manual_seed(0)  # the run's own random streams stay untouched
    like = groups[0]["params"][0]  # the test tensors live where the run's do (a fused or CUDA-only step)
    shapes = [(3, 4), (5,), (2, 3), (4,)]
    values = [torch.randn(s, generator=generator).to(like.device, like.dtype) for s in shapes]
    grads = [[torch.randn(s, generator=generator).to(like.device, like.dtype) for s in shapes] for _ in range(steps)]

    def build() -> tuple[Optimizer, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(v.clone()) for v in values]
        accepted = inspect.signature(cls.__init__).parameters
        try:
            optimizer = cls(params, **{k: v for k, v in copy.deepcopy(settings).items() if k in accepted})
        except Exception as error:  # noqa: BLE001 - the user's class: any failure means it cannot be checked
            raise CommSchedConfigError(
                f"dear.per_parameter: {qualified_name(cls)} could not be built on test tensors to "
                f"check that it steps each parameter alone ({error})"
            ) from None
        optimizer.param_groups[0].update(copy.deepcopy(settings))  # the run's own tensors stay untouched
        return optimizer, params

    settings = {k: v for k, v in groups[0].items() if k != "params"}

    whole, whole_params = build()
    split, split_params = build()
    for step_grads in grads:
        for p, q, g in zip(whole_params, split_params, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        try:
            whole.step()
            written = set().union(*(_step_part(split, part, settings) for part in (split_params[:2], split_params[2:])))
        except Exception as error:  # noqa: BLE001 - the user's class
            raise CommSchedConfigError(
                f"dear.per_parameter: {qualified_name(cls)} failed to step on test tensors while "
                f"checking that it steps each parameter alone ({error})"
            ) from None
        if written:
            _refuse(cls, f"its step wrote {sorted(written)} into the param group (group-level state)")
    for p, q in zip(whole_params, split_params):
        if not torch.allclose(p, q, rtol=1e-6, atol=1e-6):
            _refuse(cls, f"a split step moved a parameter {float((p - q).abs().max()):.2e} away from a whole step")
        for key, value in whole.state[p].items():
            other = split.state[q].get(key)
            if isinstance(value, torch.Tensor) and not (
                isinstance(other, torch.Tensor) and torch.allclose(value, other, rtol=1e-6, atol=1e-6)
            ):
                _refuse(cls, f"its state {key!r} differs after a split step")


def _step_part(optimizer: Optimizer, part: list[torch.nn.Parameter], settings: dict[str, Any]) -> set[str]:
    """A step of `part` with the group's settings as they were before the first part, as DeAR steps."""
    group = optimizer.param_groups[0]
    everything = group["params"]
    group["params"] = part
    try:
        return step_with(optimizer, [copy.deepcopy(settings)], optimizer.step)
    finally:
        group["params"] = everything


def _refuse(cls: type, why: str) -> None:
    raise CommSchedConfigError(
        f"dear.per_parameter: {qualified_name(cls)} does not step each parameter alone: {why}. "
        "Remove it from DeAROptions.per_parameter: DeAR then steps it whole, exactly"
    )


HyperParams = list[dict[str, Any]]


def step_with(optimizer: Optimizer, hyper: HyperParams, step: Callable[[], Any]) -> set[str]:
    """Run `step` with each group's hyper-parameters as `hyper` holds them (taken when the step was due;
    a scheduler may have moved them since). Afterwards a key the step left alone gets back its value
    of now; a key the step wrote (group-level state: Prodigy's `d`, schedule-free's `k`) keeps what
    the step wrote. Returns the keys the step wrote."""
    groups = optimizer.param_groups
    now = [{k: g[k] for k in hp} for g, hp in zip(groups, hyper)]
    versions = [{k: v._version for k, v in hp.items() if isinstance(v, torch.Tensor)} for hp in hyper]
    for g, hp in zip(groups, hyper):
        g.update(hp)
    written: set[str] = set()
    try:
        step()
    finally:
        for g, hp, values, version in zip(groups, hyper, now, versions):
            for k, v in values.items():
                if g[k] is hp[k] and (
                    k not in version or hp[k]._version == version[k]
                ):  # not replaced, not changed in place
                    g[k] = v
                else:
                    written.add(k)
    return written

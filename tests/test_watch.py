"""`commsched.schedules.pending_tensors` on its own: every way Python code can read or write a pending tensor is a
touch that brings it up to date first; metadata and tensors that are not pending cost nothing."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from commsched.schedules.pending_tensors import Kind, PendingTensors, watchable


class Recorder:
    """A schedule stand-in: remembers what was touched; bringing a key up to date adds 1 to its tensors."""

    def __init__(self) -> None:
        self.calls: list[tuple[set[int], Kind]] = []
        self.pending = PendingTensors(self.bring_up_to_date)
        self.tensors: dict[int, list[torch.Tensor]] = {}

    def mark(self, key: int, tensors: list[torch.Tensor], kind: Kind = Kind.UPDATE) -> None:
        self.tensors[key] = tensors
        self.pending.mark(key, tensors, kind)

    def bring_up_to_date(self, keys: set[int], kind: Kind) -> None:
        self.calls.append((set(keys), kind))
        for key in keys:
            self.pending.unmark(key)
            if kind is Kind.UPDATE:
                with torch.no_grad():
                    for t in self.tensors[key]:
                        t.add_(1.0)


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return nn.Linear(3, 2)


TOUCHES = {
    "operator": lambda m, opt: m.weight * 2,
    "forward": lambda m, opt: m(torch.ones(1, 3)),
    ".data": lambda m, opt: m.weight.data.clone(),
    ".grad read": lambda m, opt: m.weight.grad,
    ".grad write": lambda m, opt: setattr(m.weight, "grad", None),
    "detach": lambda m, opt: m.weight.detach(),
    "state_dict": lambda m, opt: m.state_dict()["weight"].clone(),
    "deepcopy": lambda m, opt: copy.deepcopy(m),
    "torch.save": lambda m, opt: torch.save(m.state_dict(keep_vars=True), io.BytesIO()),
    "numpy": lambda m, opt: m.weight.detach().numpy(),
    "foreach": lambda m, opt: torch._foreach_mul([m.weight, m.bias], 2.0),
    "copy_ into it": lambda m, opt: m.weight.data.copy_(torch.zeros(2, 3)),
    "item": lambda m, opt: m.weight[0, 0].item(),
    "zero_grad": lambda m, opt: m.zero_grad(),
    "clip_grad_norm_": lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
    "optimizer state": lambda m, opt: opt.state[m.weight]["momentum_buffer"] + 0,
    "nn.Parameter(p)": lambda m, opt: nn.Parameter(m.weight),
}


@pytest.mark.parametrize("how", list(TOUCHES))
def test_every_touch_brings_the_tensor_up_to_date_first(layer, how):
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer.weight.grad = torch.ones_like(layer.weight)
    layer.bias.grad = torch.ones_like(layer.bias)
    optimizer.step()
    before = layer.weight.detach().clone()
    recorder = Recorder()
    recorder.mark(0, [layer.weight, layer.bias, *optimizer.state[layer.weight].values()])
    assert type(layer.weight) is not nn.Parameter and isinstance(layer.weight, nn.Parameter)
    TOUCHES[how](layer, optimizer)
    assert recorder.calls == [({0}, Kind.UPDATE)]
    assert type(layer.weight) is nn.Parameter and type(layer.bias) is nn.Parameter
    if how != "copy_ into it":  # what the touch saw was already up to date
        assert torch.equal(layer.weight.detach(), before + 1)


def test_printing_a_pending_tensor_applies_nothing_and_says_it_is_pending(layer):
    """A debugger prints every local: that must neither run the optimizer nor wait for the network."""
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    before = layer.weight.detach().clone()
    recorder = Recorder()
    recorder.mark(0, [layer.weight, *optimizer.state[layer.weight].values()])
    shown = [
        repr(layer.weight),
        str(layer.weight),
        repr(optimizer.state[layer.weight]["momentum_buffer"]),
    ]
    assert recorder.calls == [] and type(layer.weight) is not nn.Parameter
    assert all("pending; the update of bucket 0" in text for text in shown), shown
    assert shown[0].startswith(repr(nn.Parameter(before))), "the values it holds now, as a parameter prints them"
    layer.weight * 1  # the first use still brings it up to date
    assert recorder.calls == [({0}, Kind.UPDATE)] and torch.equal(layer.weight.detach(), before + 1)
    assert "pending" not in repr(layer.weight)


@pytest.mark.parametrize(
    "how",
    [
        lambda w: w.shape,
        lambda w: w.dtype,
        lambda w: w.device,
        lambda w: w.requires_grad,
        lambda w: w.numel(),
        lambda w: w.size(0),
        lambda w: hash(w),
        lambda w: w.dim(),
    ],
)
def test_metadata_is_not_a_touch(layer, how):
    recorder = Recorder()
    recorder.mark(0, [layer.weight])
    how(layer.weight)
    list(layer.parameters())
    assert recorder.calls == []
    recorder.pending.unmark_all()
    assert type(layer.weight) is nn.Parameter


def test_only_the_touched_key_is_brought_up_to_date(layer):
    recorder = Recorder()
    recorder.mark(0, [layer.weight])
    recorder.mark(1, [layer.bias])
    layer.bias + 1
    assert recorder.calls == [({1}, Kind.UPDATE)]
    torch.cat([layer.weight.flatten(), layer.bias])
    assert recorder.calls == [({1}, Kind.UPDATE), ({0}, Kind.UPDATE)]
    assert recorder.pending.keys == []


def test_pending_gradients_are_touched_by_grad_access_only(layer):
    recorder = Recorder()
    recorder.mark(0, [layer.weight, layer.bias], Kind.GRADIENT)
    layer.weight * 2, layer.weight.detach(), layer(torch.ones(1, 3))  # the values are current
    assert recorder.calls == []
    assert layer.bias.grad is None
    assert recorder.calls == [({0}, Kind.GRADIENT)]


@pytest.mark.parametrize("kind", [Kind.UPDATE, Kind.GRADIENT])
def test_a_parameter_made_of_a_pending_one_is_what_it_would_be_otherwise(layer, kind):
    """`nn.Parameter(p)`, as model surgery and some libraries write it: an alias of p's storage, a
    plain Parameter holding p's up-to-date values (torch refuses a detach() that changes the class)."""
    recorder = Recorder()
    recorder.mark(0, [layer.weight], kind)
    before = layer.weight.detach().clone() if kind is Kind.GRADIENT else None
    made = nn.Parameter(layer.weight)
    assert made.data_ptr() == layer.weight.data_ptr() and made.requires_grad
    assert torch.equal(made * 1, before if before is not None else layer.weight.detach())
    assert type(made) is nn.Parameter
    recorder.pending.unmark_all()
    assert type(layer.weight) is nn.Parameter


def test_a_deep_copy_made_while_pending_is_a_plain_parameter(layer):
    recorder = Recorder()
    recorder.mark(0, [layer.weight])
    clone = copy.deepcopy(layer)
    assert type(clone.weight) is nn.Parameter and type(layer.weight) is nn.Parameter
    assert torch.equal(clone.weight, layer.weight)


def test_touches_from_another_thread_are_brought_up_to_date_once(layer):
    recorder = Recorder()
    recorder.mark(0, [layer.weight])
    threads = [threading.Thread(target=lambda: layer.weight.sum()) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert recorder.calls == [({0}, Kind.UPDATE)]


def test_tensor_subclasses_with_their_own_torch_function_are_not_watched():
    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    class Plain(torch.Tensor):
        pass

    assert watchable(torch.zeros(1)) and watchable(nn.Parameter(torch.zeros(1)))
    assert watchable(torch.zeros(1).as_subclass(Plain))
    assert not watchable(torch.zeros(1).as_subclass(Logged))

"""Tensors a schedule has not brought up to date yet, and the first touch that brings them.

DeAR applies step t's update in step t+1's forward, and between backward and the optimizer step
it holds only shards of the reduced gradients. Any code outside the schedule -- a callback, a
module hook, `training_step` reading a weight before the forward reaches its layer, a second
module using a weight it does not own -- may look at those tensors in between, and must see what
DDP would show it. A static rule (whoever overrides a per-step hook might look, so apply every
step) costs the overlap in most real projects, which carry a callback of their own.

So the rule is lazy and exact: while a tensor is pending, its Python class is swapped for a
subclass whose `__torch_function__` first calls the schedule back to bring the tensor up to date
(which restores its class), then lets the call proceed. Every torch function, Tensor method and
property called from Python reaches it: arithmetic, `.data`, `.grad`, `.detach()` (and so
`state_dict()`), `copy_`, foreach ops, `.numpy()`, `torch.save` (`__reduce_ex__`),
`copy.deepcopy`. Printing is not a touch: `repr` shows the values the tensor holds, saying that
an update is pending (a debugger prints every local). Code that touches no pending tensor never enters Python at all, so
the model's own forward, a callback that reads a clock, Lightning's loop and its logging cost
nothing; reading metadata (shape, dtype, device, requires_grad) does not count as a touch.

Two kinds of pending:
- `UPDATE`: the parameter's value, its `.grad` and its optimizer state lag one update; any touch
  brings the parameter's group (bucket) up to date.
- `GRADIENT`: only `.grad` is pending (reduced shards); reading or writing `.grad` makes every
  gradient whole, a collective issued in the same order on every rank.

What it cannot see: tensors reached from C++ without passing through Python (a C++ extension
reading a raw pointer it obtained earlier, a view or `.data` taken before the tensor became
pending), and a `.grad` read from a thread other than the training thread while gradients are
pending (the gradients are then made whole from that thread, out of order with the training
thread's collectives). Tensor subclasses with a `__torch_function__` of their own are not
watched: the schedule brings them up to date at the end of the step instead (`watchable`).
"""

from __future__ import annotations

import enum
import sys
import threading
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

T = torch.Tensor

_METADATA = frozenset(
    {
        T.shape.__get__,
        T.dtype.__get__,
        T.device.__get__,
        T.requires_grad.__get__,
        T.is_leaf.__get__,
        T.grad_fn.__get__,
        T.ndim.__get__,
        T.layout.__get__,
        T.is_cuda.__get__,
        T.is_sparse.__get__,
        T.is_meta.__get__,
        T.is_quantized.__get__,
        T.size,
        T.dim,
        T.numel,
        T.nelement,
        T.element_size,
        T.stride,
        T.is_floating_point,
        T.is_complex,
        T.is_contiguous,
        T.get_device,
        T.__len__,
        T.requires_grad_,
    }
)
"""Calls that read no values: never a touch (Lightning's summaries and the engine call them freely)."""

_GRAD_ACCESS = frozenset({T.grad.__get__, T.grad.__set__, T.grad.__delete__, T._grad.__get__, T._grad.__set__})


class Kind(enum.Enum):
    UPDATE = "update"
    GRADIENT = "gradient"


class PendingTensors:
    """One schedule's pending tensors, grouped under keys (bucket indices). `bring_up_to_date(keys, kind)`
    is the schedule's callback: it must unmark `keys` (`unmark`) before it reads or writes their tensors."""

    def __init__(self, bring_up_to_date: Callable[[set[int], Kind], None]) -> None:
        self._bring_up_to_date = bring_up_to_date
        self._marked: dict[int, list[torch.Tensor]] = {}
        self.touches = 0
        """Touches that brought something up to date (tests and the debug log read it)."""

    def mark(self, key: int, tensors: Iterable[torch.Tensor], kind: Kind) -> bool:
        """Mark `tensors` pending under `key` (already marked under it: now of `kind`). False if one of
        them cannot be watched (`watchable`): the caller must not leave that key pending."""
        marked = self._marked.setdefault(key, [])
        every = True
        with _lock:
            for tensor in tensors:
                entry = _entries.get(id(tensor))
                if entry is not None:
                    if entry.owner is self and entry.key == key:
                        entry.kind = kind
                    continue
                base = type(tensor)
                pending_class = _classes[base] if base in _classes else _pending_class(base)
                if pending_class is None:
                    every = False
                    continue
                tensor.__class__ = pending_class
                _entries[id(tensor)] = _Entry(tensor, self, key, kind, base)
                marked.append(tensor)
        return every

    def unmark(self, key: int) -> None:
        with _lock:
            for tensor in self._marked.pop(key, []):
                entry = _entries.pop(id(tensor), None)
                if entry is not None:
                    tensor.__class__ = entry.base

    def unmark_all(self) -> None:
        for key in list(self._marked):
            self.unmark(key)

    @property
    def lock(self) -> threading.RLock:
        """Held while a touch brings tensors up to date: a schedule applying updates itself takes it too."""
        return _lock

    def pending(self, key: int) -> bool:
        return key in self._marked

    @property
    def keys(self) -> list[int]:
        return list(self._marked)

    def bring_up_to_date_now(self, keys: set[int], kind: Kind) -> None:
        self.touches += 1
        self._bring_up_to_date(keys, kind)
        for key in keys:  # the callback unmarks; a key it left marked must not be touched forever
            self.unmark(key)


def watchable(tensor: torch.Tensor) -> bool:
    """Plain tensors and parameters (and subclasses that leave `__torch_function__` alone) can be watched."""
    return _pending_class(type(tensor)) is not None


class _Entry:
    __slots__ = ("tensor", "owner", "key", "kind", "base")

    def __init__(self, tensor: torch.Tensor, owner: PendingTensors, key: int, kind: Kind, base: type) -> None:
        self.tensor, self.owner, self.key, self.kind, self.base = tensor, owner, key, kind, base


_entries: dict[int, _Entry] = {}
_lock = threading.RLock()


class _Pending:
    """Mixed into a pending tensor's class for as long as it is pending."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            _touch(func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            if func is T.detach and sys._getframe(1).f_code is _NEW_PARAMETER:
                return _parameter_alias(args[0])
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        _touch(None, (self,), {})
        return self.__deepcopy__(memo)  # the class is restored: the tensor's own

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        """Printing is not a touch: a debugger shows every local's repr, and bringing the tensor up to
        date from there would run the optimizer (or wait for the network) at a breakpoint. The values
        shown are those it holds now, said to be so. (A format spec, `f"{t:.3f}"`, is a use: it touches.)
        A debugger that prints from its own thread while the training thread is bringing tensors up to
        date (stopped inside the optimizer's step) gets a placeholder instead of waiting for it."""
        if not _lock.acquire(timeout=_REPR_WAIT_S):
            return f"<{type(self).__mro__[2].__name__} being brought up to date on another thread>"
        try:  # the tensor's own class for the moment of printing, as it prints when not pending
            entry = _entries.get(id(self))
            pending_class = type(self)
            self.__class__ = entry.base if entry is not None else pending_class.__mro__[2]
            try:
                text = repr(self) if not (args or kwargs) else self.__repr__(*args, **kwargs)
            finally:
                self.__class__ = pending_class
        finally:
            _lock.release()
        if entry is None or entry.kind is Kind.GRADIENT:  # the values are current; only `.grad` is pending
            return text
        return (
            f"{text}\n(commsched: pending; the update of bucket {entry.key} is applied at the first use of this "
            "tensor, and these are its values before that update)"
        )


_REPR_WAIT_S = 1.0
"""How long a print waits for another thread that is bringing tensors up to date."""


_NEW_PARAMETER = nn.Parameter.__new__.__code__


def _parameter_alias(data: torch.Tensor) -> torch.Tensor:
    """`nn.Parameter(p)` of a pending `p`: what it gives for a parameter that is not pending (an alias
    of its storage). `Parameter.__new__` detaches a tensor of a class of its own and requires the
    detached tensor to keep that class; the class is read after the touch above, so it is `p`'s own
    again (or still pending, for pending gradients: the alias then sheds it at its first use)."""
    return torch.Tensor._make_subclass(type(data), data, False)


def _touch(func: Any, args: tuple, kwargs: dict) -> None:
    with _lock:
        touched: dict[PendingTensors, dict[int, Kind]] = {}
        for leaf in tree_leaves((args, kwargs)):
            if not isinstance(leaf, _Pending):
                continue
            entry = _entries.get(id(leaf))
            if entry is None or entry.tensor is not leaf:  # e.g. a deep copy made while pending
                leaf.__class__ = type(leaf).__mro__[2]
                continue
            if entry.kind is Kind.GRADIENT and func is not None and func not in _GRAD_ACCESS:
                continue  # the values are current; only .grad is pending
            touched.setdefault(entry.owner, {})[entry.key] = entry.kind
        for owner, keys in touched.items():
            for kind in (Kind.GRADIENT, Kind.UPDATE):
                chosen = {key for key, k in keys.items() if k is kind}
                if chosen:
                    owner.bring_up_to_date_now(chosen, kind)


_classes: dict[type, Optional[type]] = {}


def _pending_class(base: type) -> Optional[type]:
    """The pending variant of a tensor class (made once per class); None if it cannot be watched."""
    if base not in _classes:
        own = next((k.__dict__["__torch_function__"] for k in base.__mro__ if "__torch_function__" in k.__dict__), None)
        default = (T.__dict__["__torch_function__"], nn.Parameter.__dict__["__torch_function__"])
        plain = issubclass(base, T) and not issubclass(base, _Pending) and own in default
        _classes[base] = type(f"Pending{base.__name__}", (_Pending, base), {"__slots__": ()}) if plain else None
    return _classes[base]

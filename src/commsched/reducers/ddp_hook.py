"""One whole bucket reduced by a DDP communication hook (``ddp_comm_hook``: PowerSGD, a wrapper, the
user's own), as `DistributedDataParallel` runs it.

DDP hands a hook a `GradBucket` holding the bucket's gradients summed by nothing yet (not divided by
the world size: averaging is the hook's job) and copies the tensor the hook's future returns back into
the gradients. `HookBucket` is that bucket over commsched's buffer: the same methods torch's hooks call
(`buffer`, `gradients` as views into it, `parameters`, `index`, `is_last`, `set_buffer`). The hook's
state that holds training signal (PowerSGD's error feedback) is this rank's, kept by parameter name
(`reducers.base`); what is equal on every rank (PowerSGD's Q matrices, its step count and random
state) is the schedule's shared state (`hook_state`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

import torch

from commsched.comm.buckets import Bucket
from commsched.comm.links import Link
from commsched.errors import CommSchedConfigError, PeerFailureError
from commsched.reducers.base import Reducer, ReducerState, by_parameter, into_bucket
from commsched.reducers.hook_state import POWERSGD_ERROR, layout_key, powersgd_state


class HookBucket:
    """What a DDP communication hook is handed (`torch.distributed.GradBucket`'s methods): a copy of the
    bucket, as DDP's own bucket is apart from `.grad` (batched PowerSGD resizes it in place)."""

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._buffer = bucket.buffer.clone()
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """A wrapper's cast copy (``fp16_compress_wrapper``): the hook reads it; the result comes back whole."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, a view into the buffer as it is now (PowerSGD writes its approximation
        there; under a wrapper, into the wrapper's cast copy, as torch's `GradBucket` slices its current buffer)."""
        return [
            self._buffer.narrow(0, start, p.numel()).view_as(p)
            for p, start in zip(self._bucket.params, self._bucket.offsets())
        ]

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last


class HookWork:
    """The hook's future, waited as a collective is: the wait counts on the link's clock, the result is
    copied into the bucket, and a failure names the peer problem."""

    def __init__(self, future: torch.futures.Future, bucket: Bucket, link: Link, what: str) -> None:
        self._future, self._bucket, self._link, self._what = future, bucket, link, what

    def wait(self, exposed: bool = True) -> None:
        started = time.perf_counter()
        try:
            result = self._future.wait()
            if self._link.measuring and self._bucket.buffer.is_cuda:
                torch.cuda.synchronize(self._bucket.buffer.device)  # completion, not enqueue, on the profiler's clock
        except RuntimeError as error:
            raise PeerFailureError(
                f"commsched: {self._what} (a DDP communication hook) failed: a peer died, hung past the "
                f"process-group timeout, or the network link broke. Original error: {error}"
            ) from error
        finally:
            if exposed:
                self._link.clock.seconds += time.perf_counter() - started
        tensor = result[0] if isinstance(result, (list, tuple)) else result
        numel = self._bucket.buffer.numel()
        self._bucket.buffer.copy_(tensor.reshape(-1)[:numel])  # batched PowerSGD's result may be padded


class HookChain:
    """The buckets' hooks run one after another: a hook's collectives (PowerSGD issues its second and third
    from the first's completion, on the backend's threads) would otherwise interleave with the next bucket's
    in an order that differs between ranks (gloo then fails or hangs, as under DDP). A bucket's hook starts
    at once when the one before it is done, else when it completes; backward goes on meanwhile."""

    def __init__(self) -> None:
        self._last: Optional[torch.futures.Future] = None

    def run(self, call: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        before = self._last
        if before is None or before.done():
            self._last = call()
            return self._last
        after: torch.futures.Future = torch.futures.Future()

        def start(done: torch.futures.Future) -> None:
            try:
                done.wait()
                call().add_done_callback(lambda inner: _settle(after, inner))
            except BaseException as error:  # noqa: BLE001 - the earlier hook's failure, or this one's launch
                after.set_exception(error)

        before.add_done_callback(start)
        self._last = after
        return after


def _settle(outer: torch.futures.Future, inner: torch.futures.Future) -> None:
    try:
        outer.set_result(inner.wait())
    except BaseException as error:  # noqa: BLE001 - handed to whoever waits for `outer`
        outer.set_exception(error)


class CommHookReduce(Reducer):
    """A bucket averaged by the user's hook (the capture did not divide it: the hook does)."""

    kinds = (POWERSGD_ERROR,)

    def __init__(
        self, bucket: Bucket, hook: Callable[..., Any], state: Any, link: Link, is_last: bool, chain: HookChain
    ) -> None:
        self.bucket, self.link = bucket, link
        self._hook, self._state, self._is_last, self._chain = hook, state, is_last, chain

    def start(self, tag: str) -> HookWork:
        handed = HookBucket(self.bucket, self._is_last)  # copied now, while the bucket holds this step's gradients
        future = self._chain.run(lambda: self._hook(self._state, handed))
        return HookWork(future, self.bucket, self.link, tag)

    def state_dict(self) -> ReducerState:
        """By parameter name; a padded whole-bucket error (batched PowerSGD) by the bucket's names."""
        errors = _errors(self._state)
        kept = errors.get(self.bucket.index) if errors is not None else None
        if kept is None:
            return {}
        if kept.numel() != self.bucket.buffer.numel():
            return {POWERSGD_ERROR: {layout_key(self.bucket): kept.detach().clone()}}
        return {POWERSGD_ERROR: by_parameter(self.bucket, kept)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        self._load(state.get(POWERSGD_ERROR), 1)

    def load_total(self, totals: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Every old rank's error feedback summed (a resume at another world size): each rank takes 1/P of
        it, so the sum PowerSGD compresses next is the one the old ranks owed."""
        self._load(totals.get(POWERSGD_ERROR), self.link.world_size)

    def _load(self, saved: Optional[Mapping[str, torch.Tensor]], share: int) -> None:
        """This bucket's error feedback from the checkpoint, replacing this run's; refused where it would be
        dropped (a hook that keeps none, or a whole-bucket error saved for another layout)."""
        errors = _errors(self._state)
        if errors is not None:
            errors.pop(self.bucket.index, None)
        mine = [name for name in self.bucket.names if saved and name in saved]
        whole = saved.get(layout_key(self.bucket)) if saved else None
        if errors is None and (mine or whole is not None):
            raise CommSchedConfigError(
                "commsched: the checkpoint holds PowerSGD's error feedback, which this run's hook does not keep "
                "(no PowerSGDState with use_error_feedback=True): resuming would drop it. Resume with the hook and "
                "state that wrote it, or load only the weights (e.g. LightningModule.load_from_checkpoint)."
            )
        if errors is None:
            return
        if whole is not None:
            errors[self.bucket.index] = whole.to(self.bucket.buffer.device, copy=True).div_(share)
        elif mine:
            flat = torch.empty_like(self.bucket.buffer)
            into_bucket(self.bucket, saved, flat)
            errors[self.bucket.index] = flat.div_(share)
        elif saved and any(key.startswith("bucket:") for key in saved):
            raise CommSchedConfigError(
                "commsched: the checkpoint holds a whole-bucket PowerSGD error (batched_powerSGD_hook) for another "
                "bucket layout than this run's: resuming would drop it. Resume with the bucket_cap_mb that wrote "
                "it, or load only the weights."
            )

    def live_state(self) -> list[torch.Tensor]:
        errors = _errors(self._state)
        kept = errors.get(self.bucket.index) if errors is not None else None
        return [kept] if kept is not None else []


def _errors(state: Any) -> Optional[dict[int, torch.Tensor]]:
    """PowerSGD's error feedback by bucket index, where the hook keeps it (None: a hook that keeps none)."""
    powersgd = powersgd_state(state)
    return powersgd.error_dict if powersgd is not None and powersgd.use_error_feedback else None

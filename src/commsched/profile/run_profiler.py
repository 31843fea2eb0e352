"""The profiler a commsched strategy runs for the first N training steps (`profile_steps=N`; on a GPU
the steps after the warm-up are doubled, see `LAYERS_APART_ON`).

While profiling: per-layer forward/backward times (`LayerTimer`), every collective's
launch-to-completion span per link, step time and exposed communication (time the loop waited).
At the start of the step after the last every rank flushes the schedule, times each bucket's collectives in
isolation (and, if asked, probes the link), then rank 0 writes `profile.json` (read by the
simulator and the planners) and `trace.json` (chrome://tracing, Perfetto: per rank one compute lane
and one lane per link), and logs per-step `profile/*` metrics to the Trainer's logger.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from commsched.comm.buckets import BucketPlan
from commsched.comm.device_time import SpanRecorder, synchronize
from commsched.comm.link_groups import Links
from commsched.comm.links import Link
from commsched.profile.collectives import COLLECTIVES, time_buckets
from commsched.profile.layer_times import LayerTimer
from commsched.profile.probe import probe_link
from commsched.run_files import folder_of, write_json
from commsched.say import say
from commsched.trace import Span, write_chrome_trace


def theoretical_best(t_ff: float, t_bp: float, totals: dict[str, float]) -> dict[str, float]:
    """Each registered schedule's best step for the measured times ([DeAR] Eq. 7-8 for wfbp and dear)."""
    from commsched.schedules import SCHEDULES

    return {name: schedule.theoretical_best(t_ff, t_bp, totals) for name, schedule in SCHEDULES.items()}


def collectives_to_time() -> list[str]:
    """The three every profile has, and whatever else a registered schedule issues per step."""
    from commsched.schedules import SCHEDULES

    extra = {c for schedule in SCHEDULES.values() for c in schedule.step_collectives} - set(COLLECTIVES)
    return [*COLLECTIVES, *sorted(extra)]


LAYERS_APART_ON = frozenset({"cuda"})
"""Devices where timing every layer distorts the step it times: each layer's hooks wait for the device
to finish, and a GPU whose step is bound by launching kernels then spends longer waiting than running
them. There the profile alternates steps timed layer by layer (their shares of the step) with steps
timed whole (the forward and backward totals the layers are scaled to), and profiles twice as many
steps after its warm-up. On a CPU the wait costs nothing: every step is timed layer by layer."""


ASKED_FOR_WARMUP = 1
"""Steps a profile the user asked for (`ProfileOptions.steps`) leaves out of its medians; a planner's
own profile leaves out `FusionOptions.profile_warmup_steps`."""


def profile_length(steps: int, warmup: int, apart: bool) -> int:
    """The steps a profile of `steps` (with `warmup` of them left out of its medians) runs: twice the
    timed ones where steps timed layer by layer alternate with steps timed whole."""
    return warmup + 2 * max(1, steps - warmup) if apart else steps


class RunProfiler:
    def __init__(
        self,
        steps: int,
        out_dir: Optional[str | Path],
        probe: bool,
        repeats: int = 5,
        warmup: int = 1,
        announce: bool = True,
        layers_apart: Optional[bool] = None,
    ) -> None:
        """`announce`: say where the profile went (a profile the user asked for; a planner's own is
        reported by the plan it led to). `layers_apart`: alternate layer-timed and whole steps (None:
        where the device is in `LAYERS_APART_ON`; False for a compiled model, whose graphs would be
        recompiled each time the layer hooks come and go)."""
        self._layers_apart = layers_apart
        self.steps = steps
        self.announce = announce
        self.out_dir = Path(out_dir).expanduser() if out_dir is not None else None
        self.probe = probe
        self.repeats = repeats
        self.warmup = warmup  # steps kept in the timeline but left out of the medians
        self.result: Optional[dict[str, Any]] = None
        self._timer: Optional[LayerTimer] = None
        self._links: list[Link] = []
        self._step_starts: list[float] = []
        self._exposed: list[float] = []
        self._wire: list[dict[str, float]] = []  # per step start: bytes sent so far per link
        self._forward: list[float] = []  # per step: its forwards' wall time minus communication waits in them
        self._backward: list[float] = []  # per step, its backwards' likewise (a GAN's step runs several)
        self._mark = (0.0, 0.0)  # (perf_counter, exposed comm) at the start of the current phase
        self._phase_exposed = 0.0
        self._epoch = (time.time(), time.perf_counter())
        self._device = torch.device("cpu")
        self._layered: list[bool] = []  # per step: timed layer by layer (else timed whole)

    @property
    def active(self) -> bool:
        return self._timer is not None

    def start(self, module: Any, links: Optional[Links]) -> None:
        """Time the steps from the next batch start (a profile asked for in the middle of a batch leaves
        that batch out); every link is measured, those a stream search makes later too."""
        self._device = next(module.parameters()).device
        self.steps = profile_length(self.steps, self.warmup, self._apart)
        self._timer = LayerTimer(module, self._device)
        self._links = []
        if links is not None:
            links.when_made(self._measure)

    @property
    def _apart(self) -> bool:
        return self._device.type in LAYERS_APART_ON if self._layers_apart is None else self._layers_apart

    def _measure(self, link: Link) -> None:
        if self._timer is None:  # made after this profile finished
            return
        link.recorder = SpanRecorder(link.device)
        link.measuring = True
        self._links.append(link)

    @property
    def _timing(self) -> bool:
        """A profiled step is under way: from the first batch start after `start` (a profile started
        in the middle of a batch times from the next one, so every record of a step is that step's)."""
        return self._timer is not None and bool(self._layered)

    def phase_started(self, strategy: Any) -> None:
        """Start of training_step's forward or of backward (the strategy calls it at both)."""
        if self._timing:
            self._mark = (self._now(), strategy.exposed_comm_seconds)

    def forward_done(self, strategy: Any) -> None:
        if self._timing:
            self._forward[-1] += self._phase_seconds(strategy)

    def backward_started(self, strategy: Any) -> None:
        if self._timing:
            if self._layered[-1]:
                self._timer.backward_started()
            self.phase_started(strategy)

    def backward_done(self, strategy: Any) -> None:
        if self._timing:
            self._backward[-1] += self._phase_seconds(strategy)

    def _phase_seconds(self, strategy: Any) -> float:
        started, exposed = self._mark
        return self._now() - started - (strategy.exposed_comm_seconds - exposed)

    def _now(self) -> float:
        """The host clock once the device has finished what was enqueued (profiled steps only: on CUDA
        the host runs ahead of the kernels it launched)."""
        synchronize(self._device)
        return time.perf_counter()

    def on_batch_start(self, strategy: Any) -> None:
        """Called by the strategy at every training batch start; finishes after `steps` steps."""
        if self._timer is None:
            return
        now = self._now()
        if self._layered and self._layered[-1]:
            self._timer.end_step()
        self._step_starts.append(now)
        self._exposed.append(strategy.exposed_comm_seconds)
        self._wire.append(dict(strategy.wire_bytes))
        if len(self._step_starts) > self.steps:
            self.finish(strategy)
            return
        # by optimizer step: with accumulation, batch by batch would time every local micro-batch one way
        group = max(1, int(getattr(getattr(strategy, "loop", None), "accumulate_grad_batches", 1) or 1))
        layered = not self._apart or len(self._layered) // group % 2 == 0
        if layered and not self._timer.attached:
            self._timer.attach()
        elif not layered:
            self._timer.detach()
        self._layered.append(layered)
        self._forward.append(0.0)
        self._backward.append(0.0)

    def abandon(self) -> None:
        """Stop timing without a result (the run's state was replaced by a checkpoint's)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.detach()
        for link in self._links:
            link.recorder, link.measuring = None, False

    def finish(self, strategy: Any) -> None:
        timer, self._timer = self._timer, None
        assert timer is not None
        timer.detach()
        if timer.steps < 1 or self._complete_steps() < 1:  # the run ended before a whole step was profiled
            for link in self._links:
                link.recorder, link.measuring = None, False
            say("commsched: the run ended before a step was profiled: no profile written")
            return
        spans = [*timer.spans, *(s for link in self._links if link.recorder is not None for s in link.recorder.spans())]
        for link in self._links:
            link.recorder, link.measuring = None, False
        schedule = strategy.schedule
        schedule.flush()  # DeAR's all-gathers are in flight: let them land before timing alone
        plan: BucketPlan = schedule.plan
        link: Link = schedule.link
        bucket_times = time_buckets(plan, link, collectives_to_time(), self.repeats)
        fitted, probe_medians = probe_link(link) if self.probe else (None, None)
        result = self._summarise(strategy, timer, plan, bucket_times)
        after = self._after_warmup()
        window = (self._step_starts[after.start], self._step_starts[after.stop])
        result["summary"]["busy_s"] = {
            lane.removeprefix("link: "): seconds / max(1, len(after))
            for lane, seconds in busy_per_lane(spans, *window).items()
            if lane.startswith("link: ")
        }
        if fitted is not None:
            result["link"] = fitted.to_dict()
            result["probe"] = probe_medians
        self.result = result
        everyone: Optional[list[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self._to_wall(spans), everyone, dst=0)
        if dist.get_rank() == 0:
            self._write(strategy, result, [s for rank_spans in everyone or [] for s in rank_spans])

    def _complete_steps(self) -> int:
        """Steps that ran from their start to the next step's start."""
        return len(self._step_starts) - 1

    def _after_warmup(self) -> range:
        """The complete steps after the warm-up (the last complete one at least)."""
        steps = self._complete_steps()
        return range(min(self.warmup, steps - 1), steps)

    def _summarised_steps(self) -> list[int]:
        """The steps the summary's medians read: after the warm-up, those timed whole where layer and
        whole steps alternate, else all of them (also a run that ended before a whole one)."""
        after = self._after_warmup()
        return [k for k in after if not (self._apart and self._layered[k])] or list(after)

    def _to_wall(self, spans: list[Span]) -> list[Span]:
        wall, perf = self._epoch
        rank = dist.get_rank()
        return [Span(s.lane, s.name, s.start - perf + wall, s.end - perf + wall, rank) for s in spans]

    def _summarise(
        self, strategy: Any, timer: LayerTimer, plan: BucketPlan, bucket_times: list[dict[str, float]]
    ) -> dict:
        module = strategy.lightning_module
        schedule = strategy.schedule
        schedule_name = schedule.name
        skip = min(sum(self._layered[: self.warmup]), timer.steps - 1)  # layer-timed steps in the warm-up
        summarised = self._summarised_steps()
        t_ff = statistics.median(self._forward[k] for k in summarised)
        t_bp = statistics.median(self._backward[k] for k in summarised)
        wire_as = schedule.link.wire_for(plan.buckets[0].buffer.dtype)
        wire = torch.tensor([], dtype=wire_as).element_size()
        workload = timer.workload(
            type(module).__name__, _batch_size(strategy), skip, totals=(t_ff, t_bp), wire_element_size=wire
        )
        layer_of_param = timer.layer_of_param()
        by_name = {layer.name: layer for layer in workload.layers}
        buckets = []
        for bucket, times in zip(plan.buckets, bucket_times):
            names = list(dict.fromkeys(layer_of_param[id(p)] for p in bucket.params if id(p) in layer_of_param))
            buckets.append(
                {
                    "index": bucket.index,
                    "nbytes": bucket.numel * wire,  # what its collectives send (`comm_dtype`)
                    "layers": names,
                    "forward_s": sum(by_name[n].forward_s for n in names if n in by_name),
                    "backward_s": sum(by_name[n].backward_s for n in names if n in by_name),
                    **{f"{c}_s": t for c, t in times.items()},
                }
            )
        isolated = sum(t[c] for t in bucket_times for c in schedule.step_collectives)
        steps = []
        for k in range(self._complete_steps()):
            exposed = self._exposed[k + 1] - self._exposed[k]
            step_s = self._step_starts[k + 1] - self._step_starts[k]
            wire = {name: self._wire[k + 1].get(name, 0.0) - self._wire[k].get(name, 0.0) for name in self._wire[k + 1]}
            steps.append(
                {
                    "step": k,
                    "step_s": step_s,
                    "forward_s": self._forward[k],
                    "backward_s": self._backward[k],
                    "exposed_comm_s": exposed,
                    "other_s": step_s - self._forward[k] - self._backward[k] - exposed,
                    # the share of the step's communication hidden behind compute; 0 when the loop waited as long as
                    # the collectives take alone, or longer (contention, a slower peer): nothing was hidden
                    "overlap_ratio": min(1.0, max(0.0, 1.0 - exposed / isolated)) if isolated > 0 else 1.0,
                    "wire_bytes": wire,  # sent by this rank, per link
                    "layers_timed": self._layered[k],  # each layer waited for (its time then includes that wait)
                }
            )
        timed = [steps[k] for k in summarised]
        comm_totals = {c: sum(t[c] for t in bucket_times) for c in bucket_times[0]}
        summary = {
            "step_s": statistics.median(s["step_s"] for s in timed),
            "t_ff": t_ff,
            "t_bp": t_bp,
            **{f"t_{_SHORT.get(c, c)}": v for c, v in comm_totals.items()},
            "t_other": statistics.median(s["other_s"] for s in timed),
            "exposed_comm_s": statistics.median(s["exposed_comm_s"] for s in timed),
            "overlap_ratio": statistics.median(s["overlap_ratio"] for s in timed),
            # on a CPU every step is timed layer by layer (the waits cost nothing there)
            "totals_from": "layer-timed steps" if any(s["layers_timed"] for s in timed) else "whole steps",
            "wire_bytes": {
                name: statistics.median(s["wire_bytes"].get(name, 0.0) for s in timed)
                for name in timed[-1]["wire_bytes"]
            },
            "theoretical_best_s": theoretical_best(t_ff, t_bp, comm_totals),
        }
        layer_params: dict[str, list[str]] = {}
        for name, param in module.named_parameters():
            if id(param) in layer_of_param:
                layer_params.setdefault(layer_of_param[id(param)], []).append(name)
        return {
            "version": 1,
            "schedule": schedule_name,
            "wire_dtype": str(wire_as).removeprefix("torch."),
            "layer_params": layer_params,
            "world_size": plan.world_size,
            "backend": dist.get_backend(),
            "profiled_steps": len(steps),
            "warmup_steps": self.warmup,
            "summary": summary,
            "steps": steps,
            "buckets": buckets,
            "workload": workload.to_dict(),
        }

    def _write(self, strategy: Any, result: dict, spans: list[Span]) -> None:
        trainer = strategy.loop
        folder = folder_of(trainer)
        if folder is None and self.out_dir is None and not self.announce:
            return  # a planner's own profile, in a run with no folder: kept in memory only
        out_dir = self.out_dir or (folder or Path(trainer.default_root_dir)) / "commsched_profile"  # asked for: written
        origin = min((s.start for s in spans), default=0.0)
        shifted = [Span(s.lane, s.name, s.start - origin, s.end - origin, s.rank) for s in spans]
        write_json(out_dir / "profile.json", result)
        write_chrome_trace(shifted, out_dir / "trace.json")
        result["files"] = {"profile": str(out_dir / "profile.json"), "trace": str(out_dir / "trace.json")}
        summary = result["summary"]
        if self.announce:
            say(
                f"commsched: profiled {result['profiled_steps']} steps: {summary['step_s'] * 1e3:.1f} ms/step, "
                f"{summary['exposed_comm_s'] * 1e3:.1f} ms of it waiting on communication, overlap ratio "
                f"{summary['overlap_ratio']:.2f}; wrote {out_dir / 'profile.json'} and {out_dir / 'trace.json'} "
                "(chrome://tracing or ui.perfetto.dev)"
            )
        logger = strategy.loop.logger
        if logger is not None:
            for step in result["steps"]:
                logger.log_metrics(
                    {
                        "profile/step_ms": step["step_s"] * 1e3,
                        "profile/forward_ms": step["forward_s"] * 1e3,
                        "profile/backward_ms": step["backward_s"] * 1e3,
                        "profile/exposed_comm_ms": step["exposed_comm_s"] * 1e3,
                        "profile/overlap_ratio": step["overlap_ratio"],
                        "profile/layers_timed": float(step["layers_timed"]),
                        **{f"profile/wire_mb/{name}": sent / 1e6 for name, sent in step["wire_bytes"].items()},
                    },
                    step=step["step"],
                )


_SHORT = {"all_reduce": "ar", "reduce_scatter": "rs", "all_gather": "ag"}


def busy_per_lane(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Seconds each lane had a collective in flight within [start, end] (overlapping spans counted once):
    per link, and so per stream, how busy it was."""
    by_lane: dict[str, list[tuple[float, float]]] = {}
    for span in spans:
        a, z = max(span.start, start), min(span.end, end)
        if a < z:
            by_lane.setdefault(span.lane, []).append((a, z))
    busy = {}
    for lane, intervals in by_lane.items():
        total, reach = 0.0, -float("inf")
        for a, z in sorted(intervals):
            if z > reach:
                total += z - max(a, reach)
                reach = z
        busy[lane] = total
    return busy


def _batch_size(strategy: Any) -> int:
    loader = strategy.loop.train_dataloader
    return int(getattr(loader, "batch_size", 0) or 0)

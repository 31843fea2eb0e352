"""The benchmark's worker: `python -m commsched_cli bench-worker SPEC.json OUT_DIR` (Lightning re-runs it per rank).

For each model: every schedule trains `rounds` times, interleaved (a noisy moment of the machine
hurts all alike), and the best median step time counts. Then one profiled `wfbp` run measures the
components on the same processes and link: per-layer forward/backward, each bucket's all-reduce /
reduce-scatter / all-gather alone, and the rest of the step (optimizer, data, Lightning). From those
come each schedule's theoretical best ([DeAR] Eq. 7-8) and the simulator's prediction.
Rank 0 writes OUT_DIR/results.json.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import commsched
from commsched.bench.models import BENCH_MODELS
from commsched.bench.operator_profile import OperatorProfile
from commsched.cli.quiet import exit_silently_on_interrupt, quiet_lightning
from commsched.comm.local_workers import end_process_group
from commsched.options import CompressionOptions, ProfileOptions, StreamOptions
from commsched.plugins import import_plugins
from commsched.profile.run_profiler import ASKED_FOR_WARMUP, profile_length
from commsched.runtime.compressed_ddp import CompressedDDP
from commsched.sim import Measured, Workload, timelines
from commsched.timing import StepTimer


def _trainer(strategy: Any, spec: dict, steps: int, callbacks: list, out: Path) -> pl.Trainer:
    return pl.Trainer(
        accelerator=spec.get("accelerator", "cpu"),
        devices=spec["devices"],
        num_nodes=spec.get("num_nodes", 1),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out,
    )


class ReadsClock(pl.Callback):
    """A user's callback that only reads a clock after every step (touches no tensor)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.last = time.perf_counter()


class ReadsWeights(pl.Callback):
    """A user's callback that reads a weight after every step (as a weight-norm logger would)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.last = float(next(pl_module.parameters()).detach().norm())


USER_CALLBACKS = {"clock": ReadsClock, "weights": ReadsWeights}


def _strategy(schedule: str, spec: dict, **extra: Any) -> Any:
    """Each entry at its defaults, as a user calls it, unless it names a setting (a tuned row):
    ``name/2mb`` fixed 2 MB buckets, ``name:4`` four streams, ``topk@0.001`` another density;
    `spec["bucket_cap_mb"]`, when set, gives every entry (ddp too) fixed buckets of that size;
    `spec["backend"]`, when set, every entry's process group backend (gloo for ranks sharing a GPU)."""
    if spec.get("backend"):
        extra["process_group_backend"] = spec["backend"]
    schedule, wire = wire_of(schedule)
    schedule, slash, cap = schedule.partition("/")
    bucket_cap_mb = float(cap.removesuffix("mb")) if slash else spec.get("bucket_cap_mb")
    schedule, colon, streams = schedule.partition(":")
    if colon:
        extra["streams"] = StreamOptions(count=int(streams) if streams.isdigit() else streams)
    if bucket_cap_mb is not None:
        extra["bucket_cap_mb"] = bucket_cap_mb
    if schedule == "ddp":
        return CompressedDDP(wire, **extra) if wire != "fp32" else DDPStrategy(**extra)
    extra["comm_dtype"] = wire
    if schedule == "hier":
        extra["compression"] = CompressionOptions(method="none", hierarchical=True)
    if schedule.startswith("topk"):
        density = schedule.partition("@")[2]
        extra["compression"] = CompressionOptions(method="auto", density=float(density) if density else 0.01)
    name = "wfbp" if schedule == "hier" or schedule.startswith("topk") else schedule
    return commsched.STRATEGIES[name](**extra)


DECIDING_AT_MOST = 400
"""Steps a run may spend on its automatic choices before its timed steps (a bound for max_steps;
`StepTimer` stops the fit once its steps are timed)."""


def fit_length(spec: dict) -> int:
    """max_steps of every fit of an entry and of the ddp reference: one length, so that a learning-rate
    schedule over the fit's length takes the same steps in each."""
    return spec["warmup"] + spec["steps"] + DECIDING_AT_MOST


def _loader(make_data: Any, spec: dict, steps: int) -> DataLoader:
    world = spec["devices"] * spec.get("num_nodes", 1)
    return DataLoader(make_data(spec["batch_size"] * world * (steps + 2)), batch_size=spec["batch_size"])


def time_schedule(
    model_name: str, entry: str, spec: dict, out: Path, operators: Optional[Path] = None
) -> tuple[StepTimer, int, dict, dict, dict, Optional[dict]]:
    """One run of `entry` (a schedule, `+callback` for a user's callback in the Trainer): its step
    timer (after its choices and a warm-up), this process's rank, the final weights (every schedule
    starts from the same seed and sees the same batches), for deft or a stream search what it
    decided, what the strategy chose by itself with the steps that took, and the profile a plain
    wfbp run took of its first steps on fixed buckets to plan from (None otherwise). `operators`: where
    torch.profiler's tables of the timed steps go (a run whose times are then not counted)."""
    schedule, _, user = entry.partition("+")
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS[model_name](spec["width"])
    steps = fit_length(spec)
    timer = StepTimer(warmup=spec["warmup"], stop_after=spec["steps"])
    callbacks: list[pl.Callback] = [timer] + ([USER_CALLBACKS[user]()] if user else [])
    if operators is not None:
        callbacks.append(OperatorProfile(timer, operators))
    if wire_of(schedule)[0] == "deft" and spec["preserver"]:
        # stale plans at once (stale_after_steps=0): the bench times them within its few steps
        callbacks.append(commsched.Preserver(max_staleness=spec["max_staleness"], stale_after_steps=0))
    plain_wfbp = (
        wire_of(entry)[0] == "wfbp" and spec.get("bucket_cap_mb") is None
    )  # its planner profiles fixed buckets: the components (of its wire dtype)
    strategy = _strategy(
        schedule, spec, **({"profile": ProfileOptions(dir=str(_profile_dir(out, entry)))} if plain_wfbp else {})
    )  # where they go
    trainer = _trainer(strategy, spec, steps, callbacks, out)
    trainer.fit(model, _loader(make_data, spec, steps))
    state = host_copy(model.state_dict())
    choices = {**_choices(strategy, timer), "steps_run": trainer.global_step}
    profile = getattr(strategy, "profile", None) if plain_wfbp else None
    return (
        timer,
        trainer.global_rank,
        state,
        _deft_report(strategy) or _streams_report(entry, strategy),
        choices,
        profile,
    )


class Snapshots(pl.Callback):
    """The weights after each of `steps` optimizer steps; the fit stops after the last of them."""

    def __init__(self, steps: set[int]) -> None:
        self.steps, self.states = steps, {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step in self.steps:
            self.states[trainer.global_step] = host_copy(pl_module.state_dict())
        if trainer.global_step >= max(self.steps):
            trainer.should_stop = True


def host_copy(state: dict) -> dict:
    """Weights in float64 on the host: entries compared across runs whatever device each trained on."""
    return {k: v.detach().to("cpu", torch.float64, copy=True) for k, v in state.items()}


def ddp_weights(model_name: str, spec: dict, steps: set[int], out: Path) -> dict[int, dict]:
    """Lightning's ddp after each of `steps` steps, on the same data as every entry: a run spends as
    many steps deciding as its choices take, so each is compared with ddp at its own step count."""
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS[model_name](spec["width"])
    snapshots = Snapshots(steps)
    # max_steps as every entry's: a learning-rate schedule over the fit's length (the GPT-2 recipe's
    # cosine) then takes the same steps, and the fit stops once the last snapshot is taken
    trainer = _trainer(_strategy("ddp", spec), spec, fit_length(spec), [snapshots], out)
    trainer.fit(model, _loader(make_data, spec, fit_length(spec)))
    return snapshots.states


def _choices(strategy: Any, timer: StepTimer) -> dict:
    """What a commsched strategy chose by itself, and the steps that took (none for ddp)."""
    schedule = getattr(strategy, "last_schedule", None)
    if schedule is None:
        return {}
    plan = strategy.fusion_plan
    auto = plan.details.get("auto") if plan is not None else None
    fusion = (
        (f"{auto['planner']} plan" if auto["kept"] == "planned" else "fixed")
        if auto
        else (plan.policy if plan else "fixed")
    )
    if auto:
        fusion += f"; planned {_gains(auto.get('predicted_ms'), auto['step_ms'])}"
    chose = [f"{len(schedule.plan.buckets)} buckets ({fusion})"]
    settings = getattr(schedule, "settings", None)
    judge = getattr(settings, "sparse_or_dense", None)
    if judge is not None and judge.verdict is not None:
        v = judge.verdict
        chose.append(f"{'sparse' if v.keep else 'dense'} (sparse {_gains(v.predicted_s, v.medians_s)})")
    fallback = getattr(settings, "fallback", None)
    if fallback is not None and fallback.verdict is not None:
        v = fallback.verdict
        chose.append(f"{'DeAR' if v.keep else 'WFBP ran'} (DeAR {_gains(v.predicted_s, v.medians_s)})")
    if getattr(schedule, "choice", None) is not None and getattr(schedule, "decided", False):
        chose.append(f"ran {schedule.choice.runs}")
    return {"chose": ", ".join(chose), "deciding_steps": timer.deciding_steps}


def _gains(predicted: Optional[list[float]], measured: list[float]) -> str:
    """A choice's candidate (arm 1) against its default (arm 0): how much faster the model predicted
    it and the turns measured it (above 1: faster)."""
    said = f"{predicted[0] / predicted[1]:.2f}x predicted, " if predicted else "no model, "
    return said + f"{measured[0] / measured[1]:.2f}x measured"


def _streams_report(entry: str, strategy: Any) -> dict:
    """What the stream search chose (`name:auto` entries)."""
    control = getattr(getattr(strategy, "last_schedule", None), "streams", None)
    if control is None or not control.auto:
        return {}
    return {
        "entry": entry,
        "chosen": control.chosen.describe() if control.chosen else None,
        "trials": len(control.trials),
        "chosen_ms": control.chosen_s * 1e3,
    }


def _deft_report(strategy: Any) -> dict:
    schedule = getattr(strategy, "last_schedule", None)
    if not hasattr(schedule, "report") or schedule.timings is None:
        return {}
    report = schedule.report()
    report["preserver"] = [
        {k: d[k] for k in ("capacity", "k", "ratio", "staleness", "accepted")} for d in report["preserver"]
    ]
    return report


def profile_components(model_name: str, spec: dict, out: Path, wire: str = "fp32") -> dict:
    """A wfbp run on fixed buckets (the size ddp uses), profiled: the components of one step, its
    collectives in the wire dtype `wire`."""
    pl.seed_everything(0, verbose=False)
    model, make_data = BENCH_MODELS[model_name](spec["width"])
    asked = spec["warmup"] + spec["steps"]
    steps = profile_length(asked, ASKED_FOR_WARMUP, spec.get("accelerator") == "gpu") + 1  # on a GPU: more
    # fixed buckets (the size ddp uses): the components of one step, not a planner's choice
    strategy = _strategy(
        "wfbp" if wire == "fp32" else f"wfbp-{wire}",
        {**spec, "bucket_cap_mb": spec.get("bucket_cap_mb") or 25.0},
        profile=ProfileOptions(steps=asked, dir=str(_profile_dir(out, f"wfbp-{wire}"))),
    )
    trainer = _trainer(strategy, spec, steps + 1, [], out)
    trainer.fit(model, _loader(make_data, spec, steps + 1))
    assert strategy.profile is not None
    return strategy.profile


def predict(profile: dict) -> dict[str, float]:
    """Simulated step of wfbp (= ddp's schedule) and dear for the profiled layers, buckets and link."""
    workload = Workload.from_dict(profile["workload"])
    index = {layer.name: i for i, layer in enumerate(workload.layers)}
    owner: dict[int, int] = {}
    for bucket in profile["buckets"]:
        for name in bucket["layers"]:
            owner[index[name]] = bucket["index"]  # a layer split over buckets completes with the later one
    buckets = [sorted((i for i, b in owner.items() if b == k), reverse=True) for k in range(len(profile["buckets"]))]
    buckets = [b for b in buckets if b]
    # per-bucket times measured alone, interpolated at the simulator's bucket sizes
    points = {
        c: tuple((float(b["nbytes"]), b[f"{c}_s"]) for b in profile["buckets"])
        for c in ("all_reduce", "reduce_scatter", "all_gather")
    }
    network = Measured(profile["world_size"], points)
    other = profile["summary"]["t_other"]
    workers = profile["world_size"]
    wfbp = timelines.wfbp(workload, network, workers, buckets).iteration_s + other
    dear = timelines.dear(workload, network, workers, buckets).iteration_s + other
    return {"ddp": wfbp, "wfbp": wfbp, "dear": dear}


def _max_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max().item() if a[k].numel() else 0.0) for k in a)


def main(argv: Optional[list[str]] = None) -> None:
    """`SPEC.json OUT_DIR` (from the command line unless given)."""
    exit_silently_on_interrupt()
    logging.getLogger("commsched").setLevel(logging.WARNING)  # each run's own lines: the table says what they chose
    spec_file, out_dir = argv if argv is not None else sys.argv[1:3]
    spec = json.loads(Path(spec_file).read_text())
    out = Path(out_dir)
    import_plugins(spec.get("plugins", []))
    quiet_lightning()
    results = []
    rank = 0
    for model_name in spec["models"]:
        rounds: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in spec["schedules"]}
        final: dict[str, tuple[dict, int]] = {}  # the first round's weights and the steps it ran
        deft: dict[str, Any] = {}
        chose: dict[str, dict] = {}
        profiled: dict[str, dict] = {}  # by wire dtype, a plain wfbp run's own profile: the components
        for _ in range(spec["rounds"]):  # interleaved: a noisy moment of the machine hurts every schedule alike
            for schedule in spec["schedules"]:
                timer, rank, state, decided, chose[schedule], profile = time_schedule(
                    model_name, schedule, spec, out / model_name
                )
                if profile is not None:
                    profiled.setdefault(wire_of(schedule)[1], profile)
                rounds[schedule].append(
                    (timer.median, timer.median_cpu, timer.median_wire_bytes, timer.median_local_bytes)
                )
                if rank == 0:  # a long bench shows where it is; a run cut short still leaves its figures
                    print(
                        f"bench: {model_name} {schedule} round {len(rounds[schedule])}: "
                        f"{timer.median * 1e3:.1f} ms a step",
                        flush=True,
                    )
                final.setdefault(schedule, (state, chose[schedule]["steps_run"]))
                if decided:
                    deft.setdefault("streams" if "entry" in decided else "rounds", []).append(decided)
        if spec.get("operator_profile"):  # a run more of each entry, under torch.profiler; its times are not counted
            for schedule in spec["schedules"]:
                operators = out / model_name / "operators" / schedule.replace("/", "_").replace(":", "_")
                time_schedule(model_name, schedule, spec, out / model_name, operators)
        exact = [
            s
            for s in spec["schedules"]
            if not s.startswith(("deft", "topk")) and ":auto" not in s and _base_and_wire(s)[1] == "fp32"
        ]
        reference = ddp_weights(model_name, spec, {final[s][1] for s in exact}, out / model_name) if exact else {}
        measured = {s: min(step for step, *_ in r) for s, r in rounds.items()}
        best = {s: min(r) for s, r in rounds.items()}  # CPU time and bytes of the best round
        wires = {wire_of(s.partition("+")[0])[1] for s in spec["schedules"]}
        profiles = {
            w: profiled.get(w) or profile_components(model_name, spec, out / model_name, w) for w in sorted(wires)
        }
        profile = profiles.get("fp32") or next(iter(profiles.values()))
        summary = profile["summary"]
        theory = {  # each row's bound from the components of its own wire dtype
            w: {k: v + p["summary"]["t_other"] for k, v in p["summary"]["theoretical_best_s"].items()}
            for w, p in profiles.items()
        }
        predicted = {w: predict(p) for w, p in profiles.items()}
        nbytes = sum(layer["nbytes"] for layer in profile["workload"]["layers"])
        results.append(
            {
                "model": model_name,
                "gradient_mb": nbytes / 2**20,
                "buckets": len(profile["buckets"]),
                "components_ms": {k: v * 1e3 for k, v in summary.items() if k.startswith("t_")},
                "deft": deft,
                "rows": [
                    {
                        "schedule": s,
                        "step_ms": measured[s] * 1e3,
                        "cpu_ms": best[s][1] * 1e3,
                        **chose[s],
                        "wire_mb": best[s][2] / 1e6
                        if best[s][2] == best[s][2]
                        else None,  # this rank, per step (ddp: not counted)
                        "local_mb": best[s][3] / 1e6
                        if best[s][3] == best[s][3]
                        else None,  # of which on node-local links
                        "rounds_ms": [step * 1e3 for step, *_ in rounds[s]],
                        # deft's delayed updates are another trajectory by design: not compared
                        "weights_vs_ddp": _max_difference(final[s][0], reference[final[s][1]]) if s in exact else None,
                        "samples_per_s": spec["batch_size"] * spec["devices"] * spec.get("num_nodes", 1) / measured[s],
                        "speedup_vs_ddp": measured[ddp] / measured[s] if ddp in measured else None,
                        # round by round (the schedules ran interleaved): the median ratio, steadier than best
                        # against best
                        "median_speedup_vs_ddp": statistics.median(d[0] / r[0] for d, r in zip(rounds[ddp], rounds[s]))
                        if ddp in rounds
                        else None,
                        # ddp: not ours to bound
                        "theoretical_ms": theory[w][base] * 1e3 if base in theory[w] else None,
                        "measured_over_theoretical": measured[s] / theory[w][base] if base in theory[w] else None,
                        "predicted_ms": predicted[w][base] * 1e3 if base in predicted[w] else None,
                        "prediction_error": predicted[w][base] / measured[s] - 1.0 if base in predicted[w] else None,
                    }
                    for s, base, w, ddp in ((s, *_base_and_wire(s), _ddp_beside(s, rounds)) for s in spec["schedules"])
                ],
            }
        )
    end_process_group()
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


def _profile_dir(out: Path, entry: str) -> Path:
    """Where a plain wfbp run writes its profile: the model's folder, or its wire dtype's folder in it."""
    wire = wire_of(entry)[1]
    return out if wire == "fp32" else out / wire


def _base_and_wire(entry: str) -> tuple[str, str]:
    """The schedule an entry runs (its bound's name) and its wire dtype."""
    name, wire = wire_of(entry.partition("+")[0])
    return name.partition(":")[0], wire


def wire_of(entry: str) -> tuple[str, str]:
    """`name-bf16` / `name-fp16`: the entry with gradients sent as 16-bit floats (`comm_dtype`; ddp with
    torch's compress hook); else fp32."""
    name, dash, wire = entry.rpartition("-")
    return (name, wire) if dash and wire in ("bf16", "fp16") else (entry, "fp32")


def _ddp_beside(schedule: str, rounds: dict) -> str:
    """The ddp run each schedule is compared with: with the same user callback (`ddp+clock` for
    `dear+clock`) where one ran, else plain `ddp`."""
    _, plus, user = schedule.partition("+")
    return f"ddp+{user}" if plus and f"ddp+{user}" in rounds else "ddp"


if __name__ == "__main__":
    main()

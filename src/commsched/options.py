"""Typed options, one object per concern, shared by the Python API and the Hydra schema.

Each field carries its own check (`metadata["check"]`), so adding an option is one edit here: the
strategy's constructor, `commsched-train`'s schema and its validation all read these classes.
`validated(options, prefix)` runs every check and raises the error that names the field (with the
Hydra path, e.g. ``fusion.bucket_cap_mb``) and what is allowed. A docstring under each field says
what it is for.
"""

from __future__ import annotations

import dataclasses
import math
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

from commsched.errors import CommSchedConfigError, Either, bad_value

BUILTIN_SCHEDULES = ("wfbp", "dear", "deft")  # commsched.SCHEDULES before any plugin registers more (tested equal)
MODEL_POLICIES = ("mgwfbp", "mgwfbp-greedy", "dear-model")  # planned from a profile of the first steps
FUSION_POLICIES = ("auto", "fixed", "layers", *MODEL_POLICIES, "bayes")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
BACKENDS = ("gloo", "nccl")
FALLBACKS = ("when_faster", "when_undelayed", "never")
COMPRESSION_METHODS = ("none", "auto", "topk", "sampled", "mstopk")
COMPRESSING_SCHEDULES = ("wfbp",)  # the built-in schedules whose `Schedule.compresses` is True (tested equal)
STRIPING_SCHEDULES = ("wfbp", "dear")  # the built-in schedules whose `Schedule.stripes` is True (tested equal)
MAX_STREAMS = 16

Check = Callable[[str, Any], Any]
OptionsT = TypeVar("OptionsT")


# ------------------------------------------------------------------ checks
# Each check refuses with one wording of what it allows, whatever was wrong (type, NaN, range).
def _real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def positive_number(name: str, value: Any) -> float:
    if not (_real(value) and value > 0):
        raise bad_value(name, value, "a number > 0")
    return float(value)


def positive_int(name: str, value: Any) -> int:
    if not (_integer(value) and value >= 1):
        raise bad_value(name, value, "an integer >= 1")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if not (_integer(value) and value >= 0):
        raise bad_value(name, value, "an integer >= 0")
    return value


def non_negative_number(name: str, value: Any) -> float:
    if not (_real(value) and value >= 0):
        raise bad_value(name, value, "a number >= 0")
    return float(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_value(name, value, "True or False")
    return value


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise bad_value(name, value, allowed)
    return value


def one_of(*allowed: str) -> Check:
    return lambda name, value: choice(name, value, allowed)


def optional(check: Check) -> Check:
    return lambda name, value: None if value is None else check(name, value)


def text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_value(name, value, "a non-empty string")
    return value


def network_interface(name: str, value: Any) -> str:
    """An interface of this machine (found now, before any worker starts, rather than as a gloo error per rank)."""
    present = [ifname for _, ifname in socket.if_nameindex()]
    if value not in present:
        raise bad_value(name, value, f"a network interface of this machine: {', '.join(present)}",
                        fix="leave it unset to let the backend choose, or name one of those (`ip -brief link` lists them).")
    return value


def timeout(value: Any) -> Optional[timedelta]:
    if value is not None and not (isinstance(value, timedelta) and value.total_seconds() > 0):
        raise bad_value("timeout", value, "a datetime.timedelta > 0 or None")
    return value


def warmup_value(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if not (_integer(value) and value >= 0):
        raise bad_value(name, value, 'an integer >= 0 or "auto"')
    return value


def option(default: Any, check: Check) -> Any:
    """A dataclass field with its check."""
    return field(default=default, metadata={"check": check})


def validated(options: OptionsT, prefix: str = "") -> OptionsT:
    """Run every field's check (nested options too) and the class's own `cross_check`; returns `options`."""
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, f.name)
        if dataclasses.is_dataclass(value):
            validated(value, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            try:
                f.metadata["check"](f"{prefix}{f.name}", value)
            except CommSchedConfigError as error:
                if error.fix is None and f.default is not dataclasses.MISSING and f.default is not None and f.default != value:
                    raise bad_value(f"{prefix}{f.name}", value, error.allowed or "", default=f.default) from None
                raise
    cross_check = getattr(options, "cross_check", None)
    if cross_check is not None:
        cross_check(prefix)
    return options


# ------------------------------------------------------------------ concerns
@dataclass
class TuningOptions:
    """Bayesian optimisation of the bucket size (``fusion.policy="bayes"``)."""

    trials: int = option(10, positive_int)
    """Trial budget: bucket sizes measured before the best is kept."""
    warmup_steps: int = option(2, non_negative_int)
    """Steps left out at the start of each trial (the rebuild and first steps are slower)."""
    trial_steps: int = option(10, positive_int)
    """Steps timed per trial; the median counts."""
    min_mb: float = option(1.0, positive_number)
    """Smallest bucket size searched (MB). Lower it for models with only a few MB of gradients."""
    max_mb: float = option(100.0, positive_number)
    """Largest bucket size searched (MB)."""
    first_mb: float = option(25.0, positive_number)
    """The first trial's size (MB); DDP's default."""
    xi: float = option(0.1, positive_number)
    """Expected Improvement's exploration parameter."""

    def cross_check(self, prefix: str) -> None:
        if not self.min_mb <= self.first_mb <= self.max_mb:
            raise bad_value(f"{prefix}first_mb", self.first_mb,
                            f"a size within {prefix}min_mb..{prefix}max_mb ({self.min_mb}..{self.max_mb})")


@dataclass
class FusionOptions:
    """Which gradients share a bucket, and how that is decided."""

    policy: str = option("auto", one_of(*FUSION_POLICIES))
    """auto | fixed | layers | mgwfbp | mgwfbp-greedy | dear-model | bayes (see docs/fusion.md). auto:
    the schedule's own planner plans from the first steps, and its plan is kept only if measured faster
    than fixed buckets on real steps."""
    bucket_cap_mb: float = option(25.0, positive_number)
    """fixed: a bucket closes before the next tensor would pass this many MB (the first at 1 MiB, as DDP);
    the model planners profile on these buckets."""
    bucket_layers: int = option(1, positive_int)
    """layers: consecutive layers (modules owning parameters) per bucket."""
    profile_steps: int = option(5, positive_int)
    """Model planners: steps profiled before rank 0 plans."""
    profile_warmup_steps: int = option(5, non_negative_int)
    """Model planners: steps left out before those (a CPU run's first steps are up to 2x slower)."""
    confirm_steps: int = option(3, positive_int)
    """auto: timed steps per turn when fixed and planned buckets take turns (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """auto: turns each layout takes before the measured steps decide."""
    drift: float = option(0.2, non_negative_number)
    """auto: a median step this much slower than the kept layout measured (0.2: 20%) decides again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """auto: steps per median watched for drift."""
    plan_file: Optional[str] = option(None, optional(text))
    """A saved plan (commsched-plan, or a run's commsched_plan.json): used from the first step, no planning."""


@dataclass
class ProfileOptions:
    """The in-run profiler: per-layer, per-bucket and per-link times of the first steps."""

    steps: int = option(0, non_negative_int)
    """Profile the first N training steps (0: off); writes profile.json and a Chrome trace.json."""
    dir: Optional[str] = option(None, optional(text))
    """Where the profile goes (default: commsched_profile/ in the run's folder: the logger's, else default_root_dir)."""
    probe: bool = option(False, flag)
    """Also fit every link's alpha-beta costs when profiling ends."""


@dataclass
class LinkOptions:
    """The process groups a schedule communicates over, each created on every rank in the same order.

    A schedule names the links it needs (`primary`; DeFT adds `secondary`). An interface name binds
    that link's sockets to one network interface (gloo: GLOO_SOCKET_IFNAME, NCCL: NCCL_SOCKET_IFNAME
    while the group is created), e.g. the second NIC of each node of ``commsched-cluster``.
    """

    primary_backend: Optional[str] = option(None, optional(one_of(*BACKENDS)))
    """Backend of the primary link (default: the Trainer's process group backend, NCCL on GPU, gloo on CPU)."""
    primary_ifname: Optional[str] = option(None, optional(network_interface))
    """Network interface of the primary link (default: the backend's own choice)."""
    secondary_backend: str = option("gloo", one_of(*BACKENDS))
    """Backend of the secondary link, for schedules that use two (DeFT: gloo beside NCCL)."""
    secondary_ifname: Optional[str] = option(None, optional(network_interface))
    """Network interface of the secondary link (default: $COMMSCHED_SECONDARY_IFNAME, set by commsched-cluster;
    without one, a second group on the primary network)."""


def capacity_value(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if not (_real(value) and value > 0):
        raise bad_value(name, value, "a number > 0 (a multiple of the stage times), or unset (None, null) for no delay")
    return float(value)


@dataclass
class DeFTOptions:
    """DeFT ([DeFT] §III-IV): delayed updates over two links, solved from the run's own measurements."""

    warmup_steps: int = option(5, non_negative_int)
    """Steps run without delay and left out before measuring (a CPU run's first steps are slow)."""
    measure_steps: int = option(5, positive_int)
    """Steps without delay whose stage times and gradient statistics are measured before solving."""
    cost_repeats: int = option(3, positive_int)
    """Timed all-reduces of each bucket on each link (the median counts) when measuring ends."""
    capacity: Optional[float] = option(1.0, capacity_value)
    """The knapsacks' capacity as a multiple of the measured stage times; larger sends more per
    iteration (fewer delays); null: everything fits, no delay (DDP's updates). The Preserver may raise it."""
    timings_file: Optional[str] = option(None, optional(text))
    """A JSON file of per-bucket times (``forward``, ``backward``, ``costs``): solve from these instead of
    measuring (a reproducible or forced plan)."""
    fallback: str = option("when_faster", one_of(*FALLBACKS))
    """Which exact schedule may run the iterations instead of the plan, on the same buckets:
    "when_faster": DeAR when it is predicted at least 2% faster (its reduce-scatter and all-gather of
    each bucket are timed too, on each link with a network of its own), else WFBP when the plan is
    DDP's schedule anyway (the same collectives without generations); "when_undelayed": DeAR
    whenever the plan delays nothing; "never": the plan. DeAR never when callbacks read gradients
    or weights every step (it gives up its overlap then); with a timings file, only if the file
    gives DeAR's halves too."""
    compensation: str = option("none", one_of("none", "spike", "predict", "spike+predict"))
    """What a generation applied late gets: "none" (its gradient as it is); "spike": under torch's SGD
    with heavy-ball momentum, the moves its gradient missed while late, lr (1 - m^D) / (1 - m) for D
    optimizer steps, are applied at once and its velocity scaled by m^D, so that each gradient's total
    weight is the synchronous one (Kosson et al. 2021; Nesterov's momentum at D = 1; other optimizers
    are refused with it); "predict": any optimizer; the forward and backward of an iteration whose
    gradient will be applied D steps later run on the weights extrapolated D updates along the last
    one (one more copy of the parameters, kept in checkpoints); "spike+predict": both."""
    confirm_steps: int = option(3, non_negative_int)
    """With fallback "when_faster": timed steps per turn when the predicted choice and its runner-up
    (plan or WFBP against DeAR) take turns, twice each, on real steps (one more step runs first each
    turn, untimed); the simpler of the two is kept unless the other beats it by more than the measured
    noise (`commsched.interleaved`). 0: the prediction alone decides."""


@dataclass
class DeAROptions:
    """DeAR ([DeAR]): each bucket's all-reduce split into a reduce-scatter in backward and an all-gather
    in the next forward."""

    fallback: str = option("when_faster", one_of("when_faster", "never"))
    """"when_faster": once the buckets are decided, DeAR and WFBP (DDP's schedule: the same math, one
    all-reduce per bucket in backward) take turns on real steps, and WFBP runs the iterations when it
    measured faster beyond the noise (a fast link leaves DeAR nothing to hide, and its two collectives
    per bucket cost more CPU than one); compared again when the steps drift. "never": DeAR always.
    With several streams (`streams`), DeAR always."""
    confirm_steps: int = option(3, positive_int)
    """Timed steps per turn (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """Turns each schedule takes before the measured steps decide."""
    drift: float = option(0.2, non_negative_number)
    """A median step this much slower than the kept schedule measured compares them again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """Steps per median watched for drift."""
    rollback: bool = option(True, flag)
    """A bucket's update applied while later all-gathers of the same step are still on the network
    first copies the bucket's parameters and optimizer state: a run that fails part-way (a peer
    died) takes the step back, so what is saved after the failure is the model before that step,
    whole. Costs the memory of the parameters and optimizer state applied early (allocated once,
    reused every step; none where the all-gathers land before the forward needs them) and the copy
    (within noise where measured). False: no copies, and a failure part-way leaves weights that mix
    two steps (said when it happens)."""


def eps_value(name: str, value: Any) -> float:
    if not (_real(value) and 0 < value < 1):
        raise bad_value(name, value, "a number in (0, 1)")
    return float(value)


def growth_value(name: str, value: Any) -> float:
    if not (_real(value) and value > 1):
        raise bad_value(name, value, "a number > 1")
    return float(value)


@dataclass
class PreserverOptions:
    """The guard of DeFT's delayed updates ([DeFT] §IV, `commsched.Preserver`): on by default, so that
    `Trainer(strategy="deft")`, `DeFTStrategy()` and Hydra's `schedule=deft` run the same guarded
    plans. A `commsched.Preserver` in the Trainer's callbacks is used instead of these settings."""

    enabled: bool = option(True, flag)
    """False: plans run unguarded (a warning says what a delayed plan then risks)."""
    eps: float = option(0.01, eps_value)
    """Accept a plan when E(loss) after it over E(loss) after synchronous steps is within [1-eps, 1+eps]."""
    max_tries: int = option(10, positive_int)
    """Plans solved at most (capacity x growth each time); after them, no delay."""
    growth: float = option(1.25, growth_value)
    """Capacity growth between tries: small steps keep as much overlap as the walk allows."""
    max_staleness: int = option(0, non_negative_int)
    """Reject plans whose generations step more iterations than this after their last gradient. 0:
    no stale update (the safe default: one iteration of staleness cost 10-75 points of accuracy in
    most of the 16 digits trainings measured, see docs/deft.md)."""
    curvature_margin: float = option(1.0, non_negative_number)
    """A stale plan allowed by `max_staleness` also needs the optimizer, with that staleness, to stay
    stable on the loss's measured top curvature times this margin (`deft/stability.py`; measured by
    Hessian-vector power iteration on probe steps). 0: no curvature check (`max_staleness` alone)."""
    recheck_every_n_steps: int = option(0, non_negative_int)
    """> 0: measure and solve again every N steps."""


def density_value(name: str, value: Any) -> float:
    if not (_real(value) and 0 < value <= 1):
        raise bad_value(name, value, "a number in (0, 1]")
    return float(value)


@dataclass
class CompressionOptions:
    """Sparse gradient exchanges ([cloud-topk]): each rank sends the `density` share of each bucket's
    elements of largest magnitude; what it did not send is kept and sent later."""

    method: str = option("none", one_of(*COMPRESSION_METHODS))
    """"auto" (``strategy="topk"``): top-k with the selection measured fastest here, kept only while it
    beats the dense all-reduce on real steps; "topk": torch.topk; "sampled": the same elements as
    torch.topk, found from a threshold read in a sample (several times faster on CPUs); "mstopk":
    the paper's threshold search (approximate; no sort, fixed-size outputs); "none": dense all-reduce."""
    density: float = option(0.01, density_value)
    """The share of each bucket's elements a rank sends (0 < density <= 1; at least one element)."""
    hierarchical: Optional[bool] = option(None, optional(flag))
    """Reduce each bucket node first (HiTopKComm; with method "none" the dense two-level all-reduce):
    a reduce-scatter inside each node, the shard combined across nodes among the ranks of the same
    local rank, an all-gather inside the node. None: for sparse methods when the run has more than
    one node (dense runs stay flat unless True)."""
    samplings: int = option(30, positive_int)
    """MSTopK's threshold bisection rounds (the paper's N)."""
    error_feedback: bool = option(True, flag)
    """Keep what a rank did not send (its residual) and add it before the next selection. Without it
    the unsent gradient is lost every step and training converges worse."""
    whole_vectors: bool = option(True, flag)
    """Send every element of one-dimensional parameters (biases, normalisation scales and shifts) in
    each sparse exchange, beside the `density` share selected among the other parameters' elements.
    Ranked with everything else they are starved: on digits ResNet-18 with error feedback scored 1.5
    points lower without this. False: top-k over every element, as the paper does."""
    dense_warmup_steps: int = option(0, non_negative_int)
    """The first optimizer steps exchange dense gradients (early training is the most sensitive)."""
    confirm_steps: int = option(3, positive_int)
    """auto: timed steps per turn when sparse and dense exchanges take turns (one more runs first, untimed)."""
    confirm_rounds: int = option(3, positive_int)
    """auto: turns each exchange takes before the measured steps decide."""
    drift: float = option(0.2, non_negative_number)
    """auto: a median step this much slower than the kept exchange measured compares them again. 0: never."""
    drift_steps: int = option(50, positive_int)
    """auto: steps per median watched for drift."""
    momentum_correction: bool = option(True, flag)
    """Under torch's SGD with momentum (DGC's momentum correction): each rank keeps its own velocity
    u <- m u + g (Nesterov: u <- m (u + g), and u + g is accumulated), adds it to its residual and
    selects from that; the optimizer then steps with momentum 0, since what it receives has already
    moved with momentum. Without it, a coordinate held back for many steps lands as one large
    gradient that momentum keeps applying. Needs `error_feedback`; other optimizers: error feedback alone."""
    momentum_masking: bool = option(False, flag)
    """With momentum correction: where a rank sent a coordinate, its velocity is cleared as well as its
    residual (DGC's momentum factor masking, against stale momentum). Off by default: without it the
    updates sent add up to exactly what SGD with momentum applies, only later; with it a coordinate
    sent often loses most of its momentum. On digits, 4 ranks, against ddp (3 seeds): ResNet-18 at
    density 0.01 lost 23.5 points with it and 6.1 without (4 epochs), 1.3 and 0.9 (12 epochs, 2
    seeds); the small CNN at 0.001 -4.5 and +0.6."""
    decay_before_accumulation: bool = option(True, flag)
    """Under torch's SGD: the weight decay joins each rank's gradient before accumulation and selection,
    and the optimizer steps with weight decay 0 (decay added to the sparse update after the exchange
    cost PaddlePaddle's DGC 2 points of top-1)."""
    local_clipping: bool = option(True, flag)
    """With Trainer(gradient_clip_val=C) by norm and a correction on: each rank clips each parameter's
    gradient to norm C / sqrt(P) before accumulation (DGC), and the exchanged update is not clipped again."""
    sparsity_warmup_steps: Any = option("auto", warmup_value)
    """The density starts at 1 (dense) and falls fourfold per stage to `density` over this many optimizer
    steps (DGC's exponential warm-up; dense stages and those at more than 1/P exchange densely). "auto":
    a quarter of the run, at most four epochs (none after a `dense_warmup_steps` phase); 0: none."""
    dense_final_steps: int = option(0, non_negative_int)
    """The last optimizer steps of the run (`Trainer.estimated_stepping_batches`) are dense again: the
    paper kept its last epochs dense because top-k cost accuracy there. Entering a dense phase, each
    rank's residual joins that step's gradient, so nothing kept back is lost."""


def streams_value(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STREAMS:
        raise bad_value(name, value, f"an integer 1..{MAX_STREAMS} or \"auto\"")
    return value


@dataclass
class StreamOptions:
    """Concurrent collectives on several streams ([AIACC] §IV-VI): each bucket is
    sliced into units, unit i goes on stream i mod S (a process group of its own: on NCCL its own
    communicator and CUDA stream), so S transfers share the network at once. One flow often cannot
    fill a cloud link (per-flow caps, one TCP connection per pair in gloo)."""

    unit_mb: float = option(4.0, positive_number)
    """Unit size (MB) with a fixed number of streams; "auto" tunes it."""
    warmup_steps: int = option(5, non_negative_int)
    """streams="auto": steps run on one stream before the search starts and left out (a run's first
    steps are slow: measured first, one stream would look worse than it is)."""
    budget_steps: int = option(100, positive_int)
    """streams="auto": training steps the search may spend (every one a real training step)."""
    trial_steps: int = option(4, positive_int)
    """Steps run with each configuration the search tries; the first after a switch is left out, the
    median of the others counts."""
    max_streams: int = option(16, positive_int)
    """streams="auto": the most streams searched (links for that many are made at setup)."""
    min_unit_mb: float = option(0.5, positive_number)
    """streams="auto": the smallest unit searched (MB)."""
    max_unit_mb: float = option(32.0, positive_number)
    """streams="auto": the largest unit searched (MB)."""
    confirm_rounds: int = option(3, positive_int)
    """streams="auto": turns the search's best and one stream each take on real steps before the best is
    kept (`trial_steps` steps a turn, the first untimed); kept only if faster beyond the measured noise."""
    window: int = option(25, positive_int)
    """The bandit's sliding window: its last uses of the search techniques."""
    exploration: float = option(0.2, non_negative_number)
    """The bandit's C: weight of exploring a technique used less in the window."""
    drift: float = option(0.2, non_negative_number)
    """After tuning, a median step this much slower than the chosen configuration's measurement (0.2:
    20%) re-opens the search from the best so far. 0: never re-opened."""
    drift_steps: int = option(20, positive_int)
    """Steps per median watched for drift after tuning."""
    retune_steps: int = option(24, positive_int)
    """Budget (steps) of a search re-opened by drift."""
    retune_on_resume: bool = option(False, flag)
    """True: a run resumed from a checkpoint with a decision searches again (default: reuses it)."""
    seed: int = option(0, non_negative_int)
    """The search's random seed (rank 0 decides; every rank follows)."""

    def cross_check(self, prefix: str) -> None:
        if self.max_streams > MAX_STREAMS:
            raise bad_value(f"{prefix}max_streams", self.max_streams, f"an integer 1..{MAX_STREAMS}")
        if self.min_unit_mb > self.max_unit_mb:
            raise bad_value(f"{prefix}min_unit_mb", self.min_unit_mb, f"at most {prefix}max_unit_mb ({self.max_unit_mb})")


def check_streams(streams: Any, schedule: str, stripes: bool, compression: Any, fusion_policy: str = "fixed") -> None:
    """Several streams only where the schedule stripes its buckets, and on dense exchanges (torch-free)."""
    streams_value("streams", streams)
    if streams == 1:
        return
    if streams == "auto" and fusion_policy == "bayes":
        raise bad_value("streams", streams, "a fixed number with fusion policy 'bayes': both searches time the same "
                        "steps and would read each other's changes as their own",
                        fix="tune the bucket size first, then the streams.")
    if not stripes:
        raise bad_value("streams", streams, f"1 with schedule {schedule} (DeFT already splits its buckets between two links)"
                        if schedule == "deft" else f"1 with schedule {schedule}",
                        fix=Either("several streams run on WFBPStrategy and DeARStrategy.", "several streams run on schedule=wfbp and schedule=dear."))
    if compression.method != "none":
        raise bad_value("streams", streams, f"1 with compression method {compression.method!r} (a sparse bucket "
                        "is one small all-gather of its largest elements)")


SPARSE_REFUSED = {
    "dear": "DeAR defers the all-gather half of each bucket's all-reduce; a sparse exchange is one all-gather, with nothing to defer",
    "deft": "DeFT's generations add dense gradients over iterations",
}
"""Why a built-in schedule does not take sparse exchanges (one sentence each)."""


def check_compression(compression: Any, schedule: str, compresses: bool) -> None:
    """Sparse and two-level exchanges only on schedules that build them, refused before anything starts
    (torch-free: `commsched-train` checks its input before importing torch)."""
    if compression.hierarchical and not compresses:
        raise bad_value("compression.hierarchical", compression.hierarchical, f"None or False with schedule {schedule}",
                        fix=Either("the two-level exchange runs on WFBPStrategy.", "the two-level exchange runs on schedule=wfbp."))
    if compression.method != "none" and not compresses:
        why = SPARSE_REFUSED.get(schedule, f"schedule {schedule} builds no sparse exchange")
        raise bad_value("compression.method", compression.method, f"'none' with schedule {schedule} ({why})",
                        fix=Either('sparse exchanges run on wfbp: Trainer(strategy="topk"), or '
                                   f'WFBPStrategy(compression={compression.method!r}).',
                                   f"sparse exchanges run on wfbp: schedule=wfbp compression={compression.method}."))


def compression_from(compression: Any) -> CompressionOptions:
    """The strategy's `compression=`: a method name or options (None: dense)."""
    if compression is None:
        return CompressionOptions()
    if isinstance(compression, str):
        return CompressionOptions(method=choice("compression", compression, COMPRESSION_METHODS))
    return validated(typed("compression", compression, CompressionOptions), "compression.")


def typed(name: str, value: Any, cls: type[OptionsT]) -> OptionsT:
    """`value` if it is a `cls`, else the error naming the argument."""
    if not isinstance(value, cls):
        raise bad_value(name, value, f"a commsched.{cls.__name__}")
    return value


def fusion_from(fusion: Any, bucket_cap_mb: Optional[float]) -> FusionOptions:
    """The strategy's `fusion=` (a policy name or options) with the `bucket_cap_mb=` shorthand applied."""
    options = (FusionOptions(policy=choice("fusion", fusion, FUSION_POLICIES)) if isinstance(fusion, str)
               else typed("fusion", fusion, FusionOptions))
    if bucket_cap_mb is not None:
        options = dataclasses.replace(options, bucket_cap_mb=positive_number("bucket_cap_mb", bucket_cap_mb))
        if fusion == "auto":  # DDP's one knob, set: the user chose their buckets
            options = dataclasses.replace(options, policy="fixed")
    return validated(options, "fusion.")


def profile_from(profile: Any) -> ProfileOptions:
    """The strategy's `profile=`: a number of steps or options."""
    if isinstance(profile, int) and not isinstance(profile, bool):
        return validated(ProfileOptions(steps=profile), "profile.")
    return validated(typed("profile", profile, ProfileOptions), "profile.")


@dataclass
class StrategyOptions:
    """Every concern's options of one strategy, resolved from its constructor arguments and validated."""

    fusion: FusionOptions
    tuning: TuningOptions
    profile: ProfileOptions
    links: LinkOptions
    deft: DeFTOptions = field(default_factory=DeFTOptions)
    preserver: PreserverOptions = field(default_factory=PreserverOptions)
    compression: CompressionOptions = field(default_factory=CompressionOptions)
    dear: DeAROptions = field(default_factory=DeAROptions)
    streams: int | str = 1
    """1..16 streams, or "auto" (checked by `streams_value`)."""
    stream_options: StreamOptions = field(default_factory=StreamOptions)

    @classmethod
    def from_arguments(cls, fusion: Any, bucket_cap_mb: Optional[float], tuning: Any, profile: Any, links: Any,
                       deft: Any = None, preserver: Any = None, compression: Any = None, streams: Any = 1,
                       stream_options: Any = None, dear: Any = None) -> "StrategyOptions":
        return cls(fusion_from(fusion, bucket_cap_mb),
                   validated(typed("tuning", tuning or TuningOptions(), TuningOptions), "tuning."),
                   profile_from(profile),
                   validated(typed("links", links or LinkOptions(), LinkOptions), "links."),
                   validated(typed("deft", deft or DeFTOptions(), DeFTOptions), "deft."),
                   validated(typed("preserver", preserver or PreserverOptions(), PreserverOptions), "preserver."),
                   compression_from(compression), validated(typed("dear", dear or DeAROptions(), DeAROptions), "dear."),
                   streams_value("streams", streams),
                   validated(typed("stream_options", stream_options or StreamOptions(), StreamOptions), "stream_options."))


def check_preserver_settings(eps: float, max_tries: int, growth: float, prefix: str = "Preserver.") -> tuple[float, int, float]:
    """The Preserver's own arguments, checked as `PreserverOptions` checks its fields."""
    return eps_value(f"{prefix}eps", eps), positive_int(f"{prefix}max_tries", max_tries), growth_value(f"{prefix}growth", growth)

"""Plans chosen by a model of the iteration, from a profile of a few real steps (`profile.json`):
per-layer forward/backward times, and collective costs measured on the run's own link."""

from __future__ import annotations

from typing import Optional

from commsched.errors import bad_value
from commsched.fusion import MODEL_POLICIES
from commsched.planning.plan_file import SavedPlan
from commsched.sim import Measured, Workload, timelines
from commsched.sim.cost_models import COLLECTIVES


def network_from_profile(profile: dict) -> Measured:
    """Every size the profile timed a collective at: each bucket alone and, if probed, the probe's sweep.
    Interpolating measurements beats a straight-line fit on gloo, whose small messages are not alpha-beta."""
    points: dict[str, list[tuple[float, float]]] = {c: [] for c in COLLECTIVES}
    for bucket in profile["buckets"]:
        for c in COLLECTIVES:
            points[c].append((float(bucket["nbytes"]), float(bucket[f"{c}_s"])))
    probe = profile.get("probe")
    if probe:
        for c in COLLECTIVES:
            points[c].extend(zip(probe["bytes"], probe[c]))
    return Measured(int(profile["world_size"]), {c: tuple(p) for c, p in points.items()})


def plan_from_profile(profile: dict, policy: str, fixed_cap_bytes: Optional[float] = None) -> SavedPlan:
    """The plan `policy` chooses for the profiled workload. `fixed_cap_bytes`: also predict fixed
    buckets of that size with the same model (`details["fixed_predicted_s"]`), for the choice between them."""
    if policy not in MODEL_POLICIES:
        raise bad_value("fusion", policy, MODEL_POLICIES)
    workload = Workload.from_dict(profile["workload"])
    network = network_from_profile(profile)
    workers = int(profile["world_size"])
    if policy == "dear-model":
        layer_buckets, plan = timelines.dear_model_buckets(workload, network, workers)
        predicted, bound = plan.predicted, plan.lower_bound
    else:
        layer_buckets = timelines.mgwfbp_buckets(workload, network, workers, exact=policy == "mgwfbp")
        predicted = timelines.wfbp(workload, network, workers, layer_buckets).iteration_s
        bound = predicted if policy == "mgwfbp" else None  # the programme is exact for its model
    layer_params = profile["layer_params"]
    buckets = [
        [name for i in bucket for name in reversed(layer_params[workload.layers[i].name])] for bucket in layer_buckets
    ]
    other = float(profile["summary"].get("t_other", 0.0))
    details = {"t_other_s": other, "profiled_schedule": profile.get("schedule")}
    if fixed_cap_bytes is not None:
        replay = timelines.dear if policy == "dear-model" else timelines.wfbp
        details["fixed_predicted_s"] = (
            replay(workload, network, workers, timelines.fixed_size(workload, fixed_cap_bytes)).iteration_s + other
        )
    return SavedPlan(
        policy,
        workers,
        [b for b in buckets if b],
        predicted_s=predicted + other,
        lower_bound_s=bound + other if bound is not None else None,
        details=details,
    )

"""`commsched-plan`: compute a fusion plan from a profile, print it, save it; or print a saved plan.

    commsched-plan --profile outputs/.../profile/profile.json                 # every model policy, compared
    commsched-plan --profile profile.json --fusion dear-model --out plan.json  # choose one and save it
    commsched-plan --show plan.json
    commsched-train fusion.plan_file=plan.json ...                            # use it, no profiling

A profile comes from a run with `profile.steps=N profile.probe=true` (or `profile_steps=N,
profile_probe=True` on the strategy); a run with a model policy or `bayes` saves the plan it chose
as `commsched_plan.json` in its directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.errors import CommSchedConfigError, bad_value
from commsched.fusion import MODEL_POLICIES
from commsched.planning.model_plans import plan_from_profile
from commsched.planning.plan_file import SavedPlan


def param_sizes(profile: dict) -> dict[str, int]:
    """Bytes per parameter name, from the profile's layers (a layer's bytes split over its parameters)."""
    layers = {layer["name"]: layer["nbytes"] for layer in profile["workload"]["layers"]}
    sizes = {}
    for layer, names in profile["layer_params"].items():
        for name in names:
            sizes[name] = layers.get(layer, 0) // max(len(names), 1)
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, help="profile.json written by the profiler")
    parser.add_argument("--fusion", choices=MODEL_POLICIES, help="the policy whose plan to print and save")
    parser.add_argument("--out", type=Path, help="save the plan (with --fusion) as JSON")
    parser.add_argument("--show", type=Path, help="print a saved plan")
    args = parser.parse_args(argv)
    console = Console(width=140)
    try:
        if args.show is not None:
            SavedPlan.load(args.show).print(console)
            return 0
        if args.profile is None or not args.profile.is_file():
            raise bad_value("--profile", str(args.profile), "an existing profile.json (or use --show PLAN)")
        profile = json.loads(args.profile.read_text())
        if "layer_params" not in profile:
            raise bad_value(
                "--profile", str(args.profile), "a profile written by commsched >= 0.4 (it lacks layer_params)"
            )
        if args.out is not None and args.fusion is None:
            raise bad_value("--out", str(args.out), "only together with --fusion (which plan to save)")
    except CommSchedConfigError as error:
        parser.error(str(error))

    plans = {
        policy: plan_from_profile(profile, policy) for policy in ((args.fusion,) if args.fusion else MODEL_POLICIES)
    }
    summary = profile["summary"]
    table = Table(
        title=f"plans for the profiled {profile['schedule']} run on {profile['world_size']} workers "
        f"(measured: {summary['step_s'] * 1e3:.1f} ms/step with {len(profile['buckets'])} buckets)"
    )
    for column in ("policy", "buckets", "predicted ms/step", "lower bound ms"):
        table.add_column(column, justify="right")
    for policy, plan in plans.items():
        bound = f"{plan.lower_bound_s * 1e3:.1f}" if plan.lower_bound_s is not None else "-"
        table.add_row(policy, str(len(plan.buckets)), f"{plan.predicted_s * 1e3:.1f}", bound)
    console.print(table)
    if args.fusion is not None:
        plans[args.fusion].print(console, param_sizes(profile))
        if args.out is not None:
            console.print(f"saved to {plans[args.fusion].save(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

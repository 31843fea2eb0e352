"""A fusion plan as data: which parameters share each bucket, by name, with what predicted it.

Plans are stored by parameter name (not position) so a saved plan reads like the model and loads
into the same model in another run (`fusion.plan_file=...`), skipping profiling and tuning.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rich.console import Console
from rich.table import Table

from commsched.errors import CommSchedConfigError, bad_value
from commsched.fusion import ParamInfo, plan_assigned
from commsched.run_files import write_json


@dataclass
class SavedPlan:
    policy: str
    world_size: int
    buckets: list[list[str]]  # parameter names, buckets in launch (backward) order
    predicted_s: Optional[float] = None  # the model's iteration time for this plan, if a model chose it
    lower_bound_s: Optional[float] = None
    details: dict[str, Any] = field(default_factory=dict)

    def planner(self) -> Callable[[Sequence[ParamInfo]], list[list[int]]]:
        bucket_of = {name: b for b, names in enumerate(self.buckets) for name in names}
        return partial(plan_assigned, bucket_of=bucket_of)

    def save(self, path: str | Path) -> Path:
        return write_json(Path(path), {"version": 1, **asdict(self)})

    @classmethod
    def load(cls, path: str | Path, field: str = "fusion.plan_file") -> "SavedPlan":
        """The plan in the JSON file at `path`, the value of setting `field`; refused in one line, as
        the setting, when the file is missing, is not JSON, is not a plan or holds impossible numbers."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise bad_value(
                field, str(path), "a plan JSON written by commsched-plan or a previous run (file not found)"
            )
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise bad_value(
                field,
                str(path),
                "a plan JSON written by commsched-plan or a previous run's "
                f"commsched_plan.json (this is not a JSON plan: {error})",
            ) from None
        return cls.from_dict(data, field=field, path=str(path))

    @classmethod
    def from_dict(cls, data: Any, field: str = "plan", path: Optional[str] = None) -> "SavedPlan":
        """A plan from its JSON form (`path`: the file it was read from, the value of setting `field`).
        Its numbers are checked first: Python's json reads a bare NaN or Infinity, which are not JSON,
        and 1e999 as infinity, and a plan is no use with a NaN, infinite or negative prediction."""

        def refused(allowed: str) -> CommSchedConfigError:
            if path is not None:
                return bad_value(field, path, allowed)
            return CommSchedConfigError(f"commsched: invalid {field}; allowed: {allowed}.")

        problem = number_problem(data) if isinstance(data, dict) else None
        if problem is not None:
            raise refused(problem)
        try:
            plan = cls(
                str(data["policy"]),
                int(data["world_size"]),
                [[str(n) for n in b] for b in data["buckets"]],
                data.get("predicted_s"),
                data.get("lower_bound_s"),
                dict(data.get("details", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise refused(
                "a fusion plan: 'policy', 'world_size' and 'buckets' (lists of parameter names), as "
                f"commsched-plan writes it (this is not a fusion plan: missing or malformed {error})"
            ) from None
        if not plan.buckets or not all(plan.buckets):
            raise refused("a plan with at least one bucket and no empty one")
        return plan

    def check_matches(self, parameter_names: Sequence[str], field: str = "fusion.plan_file") -> None:
        """Refuse a plan made for another model: every parameter it names must be one of this model's."""
        known = set(parameter_names)
        unknown = [n for bucket in self.buckets for n in bucket if n not in known]
        if unknown:
            raise CommSchedConfigError(
                f"commsched: invalid {field}: the plan names {len(unknown)} parameter(s) this model does not have "
                f"(e.g. {', '.join(unknown[:3])}); it was made for another model. Make one for this model with "
                "commsched-plan, or let a run with fusion=mgwfbp, dear-model or bayes save one."
            )

    def print(self, console: Optional[Console] = None, sizes: Optional[dict[str, int]] = None) -> None:
        console = console or Console(width=140)
        head = f"plan '{self.policy}' for {self.world_size} workers: {len(self.buckets)} buckets"
        if self.predicted_s is not None:
            head += f", predicted iteration {self.predicted_s * 1e3:.1f} ms"
        if self.lower_bound_s is not None:
            head += f" (no plan below {self.lower_bound_s * 1e3:.1f} ms)"
        table = Table(title=head)
        for column in ("bucket", "parameters", *(["MB"] if sizes else []), "first", "last"):
            table.add_column(column, justify="right" if column in ("bucket", "parameters", "MB") else "left")
        for index, names in enumerate(self.buckets):
            mb = [f"{sum(sizes.get(n, 0) for n in names) / 2**20:.2f}"] if sizes else []
            table.add_row(str(index), str(len(names)), *mb, names[0], names[-1])
        console.print(table)


def number_problem(data: dict) -> Optional[str]:
    """What is wrong with a plan's numbers, worded as what is allowed (None: nothing): a world size
    that is not a whole number of workers, a prediction that is NaN, infinite or negative, or a
    NaN or infinity anywhere else (the details), which strict JSON readers of the file reject."""
    size = data.get("world_size")
    if "world_size" in data and (
        isinstance(size, bool)
        or not isinstance(size, (int, float))
        or not math.isfinite(size)
        or size != int(size)
        or size < 1
    ):
        return f"a plan whose world_size is a whole number of workers >= 1, not {json_spelling(size)}"
    for key, null in (("predicted_s", "no prediction"), ("lower_bound_s", "no bound")):
        value = data.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
        ):
            return (
                f"a plan whose {key} is a finite number of seconds >= 0, or null ({null}), not {json_spelling(value)}"
            )
    found = first_non_finite(data)
    if found is not None:
        return (
            f"a plan whose {found[0]} is a finite number or null (NaN and Infinity are not JSON), "
            f"not {json_spelling(found[1])}"
        )
    return None


def first_non_finite(value: Any, key: str = "") -> Optional[tuple[str, float]]:
    """The first NaN or infinity in a JSON document and where it is (``details.trials[2].step_ms``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for name, item in items:
        found = first_non_finite(
            item, f"{key}[{name}]" if isinstance(name, int) else f"{key}.{name}" if key else str(name)
        )
        if found is not None:
            return found
    return None


def json_spelling(value: Any) -> str:
    """A value as the file spells it (NaN, Infinity, "two"), not as Python does (nan, inf, 'two')."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)

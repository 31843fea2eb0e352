"""A fusion plan as data: which parameters share each bucket, by name, with what predicted it.

Plans are stored by parameter name (not position) so a saved plan reads like the model and loads
into the same model in another run (`fusion.plan_file=...`), skipping profiling and tuning.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rich.console import Console
from rich.table import Table

from commsched.errors import CommSchedConfigError
from commsched.run_files import write_json
from commsched.fusion import ParamInfo, plan_assigned


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
        path = Path(path).expanduser()
        if not path.is_file():
            raise CommSchedConfigError(f"commsched: invalid {field}={str(path)!r}; allowed: a plan JSON written by "
                                       "commsched-plan or a previous run (file not found).")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CommSchedConfigError(f"commsched: invalid {field}={str(path)!r}: not a JSON plan ({error}); allowed: a plan "
                                       "written by commsched-plan or a previous run's commsched_plan.json.") from None
        return cls.from_dict(data, field=f"{field}={str(path)!r}")

    @classmethod
    def from_dict(cls, data: Any, field: str = "plan") -> "SavedPlan":
        try:
            plan = cls(str(data["policy"]), int(data["world_size"]), [[str(n) for n in b] for b in data["buckets"]],
                       data.get("predicted_s"), data.get("lower_bound_s"), dict(data.get("details", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CommSchedConfigError(
                f"commsched: invalid {field}: not a fusion plan (missing or malformed {error}); a plan has 'policy', "
                "'world_size' and 'buckets' (lists of parameter names), as commsched-plan writes it.") from None
        if not plan.buckets or not all(plan.buckets):
            raise CommSchedConfigError(f"commsched: invalid {field}: the plan has no buckets, or an empty one.")
        return plan

    def check_matches(self, parameter_names: Sequence[str], field: str = "fusion.plan_file") -> None:
        """Refuse a plan made for another model: every parameter it names must be one of this model's."""
        known = set(parameter_names)
        unknown = [n for bucket in self.buckets for n in bucket if n not in known]
        if unknown:
            raise CommSchedConfigError(
                f"commsched: invalid {field}: the plan names {len(unknown)} parameter(s) this model does not have "
                f"(e.g. {', '.join(unknown[:3])}); it was made for another model. Make one for this model with "
                "commsched-plan, or let a run with fusion=mgwfbp, dear-model or bayes save one.")

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

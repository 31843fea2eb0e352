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
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"version": 1, **asdict(self)}, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, field: str = "fusion.plan_file") -> "SavedPlan":
        path = Path(path).expanduser()
        if not path.is_file():
            raise CommSchedConfigError(f"commsched: invalid {field}={str(path)!r}; allowed: a plan JSON written by "
                                       "commsched-plan or a previous run (file not found).")
        data = json.loads(path.read_text())
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "SavedPlan":
        return cls(data["policy"], int(data["world_size"]), [list(b) for b in data["buckets"]],
                   data.get("predicted_s"), data.get("lower_bound_s"), dict(data.get("details", {})))

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

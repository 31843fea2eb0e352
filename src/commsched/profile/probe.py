"""The link probe: fit t(m) = a + b m to each collective over a sweep of message sizes.

Rank 0 decides the sizes and repetitions and broadcasts them, every rank times every collective,
rank 0 fits the slowest rank's medians and broadcasts the fit, so all ranks hold the same numbers
(a planner that reads them then makes the same decision everywhere). The fit minimises relative
error (rows weighted by 1/t): plain least squares would let the largest message decide alpha.
"""

from __future__ import annotations

import torch

from commsched.comm.device_time import median_seconds
from commsched.comm.links import Link
from commsched.profile import DEFAULT_SIZES
from commsched.profile.collectives import COLLECTIVES, time_collective
from commsched.sim.cost_models import Fitted, Line


def fit_line(sizes: list[float], seconds: list[float]) -> Line:
    """Weighted least squares of seconds = a + b * bytes; residual: RMS relative error."""
    if len(sizes) < 2:
        raise ValueError("fitting a line needs at least two message sizes")
    x = torch.tensor(sizes, dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    weight = 1.0 / y.clamp_min(1e-9)
    design = torch.stack([torch.ones_like(x), x], dim=1) * weight[:, None]
    solution = torch.linalg.lstsq(design, (y * weight)[:, None], driver="gelsd").solution[:, 0]
    a, b = float(solution[0]), float(solution[1])
    relative = (a + b * x - y) / y.clamp_min(1e-9)
    return Line(a, b, float(relative.pow(2).mean().sqrt()))


def probe_link(
    link: Link, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5, collectives: tuple[str, ...] = COLLECTIVES
) -> tuple[Fitted, dict[str, list[float]]]:
    """Returns the fit and the measured medians (seconds per size, per collective), same on all ranks."""
    decision = link.tensor([repeats, len(sizes), *sizes], torch.int64)
    header = torch.zeros(2, dtype=torch.int64, device=link.device)
    if link.rank == 0:
        header.copy_(decision[:2])
    link.broadcast(header, 0, "probe-plan").wait()
    plan = decision if link.rank == 0 else torch.zeros(2 + int(header[1]), dtype=torch.int64, device=link.device)
    link.broadcast(plan, 0, "probe-plan").wait()
    repeats, sizes = int(plan[0]), [int(s) for s in plan[2:]]

    measured = link.tensor(
        [[time_collective(link, c, max(1, size // 4), repeats) for size in sizes] for c in collectives], torch.float64
    )
    link.all_reduce(measured, "probe-times", torch.distributed.ReduceOp.MAX).wait()
    fits = torch.zeros(len(collectives), 3, dtype=torch.float64, device=link.device)
    if link.rank == 0:
        for row, _ in enumerate(collectives):
            line = fit_line([float(s) for s in sizes], measured[row].tolist())
            fits[row] = link.tensor([line.a, line.b, line.residual], torch.float64)
    link.broadcast(fits, 0, "probe-fit").wait()
    lines = {c: Line(*fits[row].tolist()) for row, c in enumerate(collectives)}
    medians = {c: measured[row].tolist() for row, c in enumerate(collectives)}
    return Fitted(link.world_size, lines), {"bytes": [float(s) for s in sizes], **medians}


def probe_concurrent(links: list[Link], nbytes: int, repeats: int = 5) -> dict[str, float]:
    """All-gathers of `nbytes` on every link at once (each link its own process group, so its own TCP
    flows): the median time until all are done, and the bus bandwidth they reach together."""
    world = links[0].world_size
    numel = -(-max(1, nbytes // 4) // world) * world
    buffers = [
        (torch.zeros(numel, device=link.device), torch.zeros(numel // world, device=link.device)) for link in links
    ]

    def once() -> None:
        for pending in [link.all_gather(full, shard, "probe") for link, (full, shard) in zip(links, buffers)]:
            pending.wait()

    seconds = median_seconds(once, repeats, device=links[0].device)
    moved = len(links) * (world - 1) / world * numel * 4  # bytes each rank sends over its link
    return {"groups": len(links), "bytes": numel * 4, "seconds": seconds, "bus_gbit_s": moved * 8 / seconds / 1e9}

"""Can a short measured trial tell harmful staleness from harmless? From the same weights (after
WARM synchronous steps), T steps one iteration stale against T synchronous steps on the same
batches: the mean training loss over the trial's last T/2 steps, and the loss on the trial's
batches at its end in eval mode (BatchNorm's running statistics included) and in train mode.
docs/deft.md ("Staleness, measured") quotes it. About 2 minutes per model on 2 cores:

    .venv/bin/python recipes/staleness_trial.py bn_net|resnet18 T WARM      # e.g. bn_net 20 10
"""

from __future__ import annotations

import copy
import statistics
import sys
from collections import deque
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from stale_reference import MODELS, digits  # noqa: E402

SETTINGS = ((0.05, 0.9), (0.02, 0.9), (0.01, 0.9), (0.2, 0.5), (0.1, 0.5), (0.05, 0.5), (0.3, 0.0), (0.1, 0.0))
WIDTHS = {"bn_net": 16, "resnet18": 8}


def trial(name: str, lr: float, momentum: float, warm: int, steps: int, seed: int = 0, batch: int = 64) -> dict:
    torch.manual_seed(seed)
    (x, y), _ = digits(8)
    model = MODELS[name](WIDTHS[name])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=5e-4)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    batches = [
        order[(i * batch) % (len(y) - batch) : (i * batch) % (len(y) - batch) + batch] for i in range(warm + steps)
    ]

    def step(net, opt, b, late, staleness) -> float:
        net.train()
        loss = F.cross_entropy(net(x[b]), y[b])
        opt.zero_grad()
        loss.backward()
        late.append([p.grad.clone() for p in net.parameters()])
        if len(late) > staleness:
            for p, g in zip(net.parameters(), late.popleft()):
                p.grad = g
            opt.step()
        return float(loss.detach())

    for i in range(warm):
        step(model, optimizer, batches[i], deque(), 0)
    out = {}
    for staleness in (0, 1):
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=5e-4)
        opt.load_state_dict(optimizer.state_dict())
        late: deque = deque()
        losses = [step(net, opt, batches[warm + i], late, staleness) for i in range(steps)]
        seen = torch.cat(batches[warm : warm + steps])
        with torch.no_grad():
            net.eval()
            evaluated = float(F.cross_entropy(net(x[seen]), y[seen]))
            net.train()
            trained = float(F.cross_entropy(net(x[seen]), y[seen]))
        out[staleness] = (statistics.mean(losses[-steps // 2 :]), evaluated, trained)
    return out


def main() -> None:
    torch.set_num_threads(1)
    name, steps, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(
        "| model | lr | momentum | trial loss stale / sync | eval-mode loss stale / sync "
        "| train-mode loss stale / sync |"
    )
    print("|---|---|---|---|---|---|")
    for lr, momentum in SETTINGS:
        r = trial(name, lr, momentum, warm, steps)
        print(
            f"| {name} | {lr:g} | {momentum:g} | {r[1][0] / r[0][0]:.2f} | {r[1][1] / r[0][1]:.2f} "
            f"| {r[1][2] / r[0][2]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

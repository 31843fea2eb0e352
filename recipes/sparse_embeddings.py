"""A recommender's sparse tables at the defaults: Lightning's `ddp` against `dear` with nothing set, and the
same model with dense tables (what `dear` needed before it took sparse gradients).

The model: an item table of 200 000 rows x 32 (25.6 MB) and a tag bag of 20 000 rows x 32, both
`sparse=True`, into an MLP; SGD; batches of 256 touching a few thousand rows. Two processes on this
machine's loopback, or two nodes of `commsched-cluster`. Each run prints its median step over the second
half of its steps (its own timing callback, after warm-up and every choice), the bytes this rank sent a
step (commsched's count; ddp's is not known to it) and a checksum of the weights.

    .venv/bin/python recipes/sparse_embeddings.py                  # ddp, dear; sparse, then dense tables
    .venv/bin/python recipes/sparse_embeddings.py --run dear sparse   # one run (what the table runs)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings

ROWS, TAGS, WIDTH, BATCH, STEPS = 200_000, 20_000, 32, 256, 60


def run(strategy: str, tables: str) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import commsched  # noqa: F401  (registers "dear")

    warnings.filterwarnings("ignore")
    sparse = tables == "sparse"

    class Recommender(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.items = nn.Embedding(ROWS, WIDTH, sparse=sparse)
            self.tags = nn.EmbeddingBag(TAGS, WIDTH, mode="mean", sparse=sparse)
            self.mlp = nn.Sequential(nn.Linear(2 * WIDTH, 256), nn.ReLU(), nn.Linear(256, 1))

        def training_step(self, batch, index):
            items, tags, clicked = batch
            logits = self.mlp(torch.cat([self.items(items).mean(1), self.tags(tags)], 1)).squeeze(1)
            return F.binary_cross_entropy_with_logits(logits, clicked)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

            self.sent: list[float] = []

        def on_train_batch_start(self, trainer, *args) -> None:
            self.times.append(time.perf_counter())
            self.sent.append(sum(getattr(trainer.strategy, "wire_bytes", {}).values()))

    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH * 2
    data = TensorDataset(
        torch.randint(0, ROWS, (n, 8), generator=g),
        torch.randint(0, TAGS, (n, 6), generator=g),
        torch.randint(0, 2, (n,), generator=g).float(),
    )
    timer, model = StepTimer(), Recommender()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=BATCH))
    if trainer.global_rank == 0:
        half = STEPS // 2
        steps = [b - a for a, b in zip(timer.times, timer.times[1:])][half:]
        sent = (timer.sent[-1] - timer.sent[half]) / (len(timer.sent) - 1 - half)
        per_step = f"{sent / 2**20:.2f}MB" if strategy != "ddp" else "-"
        checksum = sum(p.double().sum().item() for p in model.parameters())
        print(f"ROW {strategy} {tables} {statistics.median(steps) * 1e3:.1f} {per_step} {checksum:.6f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs=2, metavar=("STRATEGY", "TABLES"), help="one run: ddp|dear sparse|dense")
    args = parser.parse_args()
    if args.run:
        run(*args.run)
        return
    print("| strategy | tables | ms a step | sent a step | weights checksum |\n|---|---|---|---|---|")
    for tables in ("sparse", "dense"):
        for strategy in ("ddp", "dear"):
            proc = subprocess.run(
                [sys.executable, __file__, "--run", strategy, tables], capture_output=True, text=True, check=True
            )
            row = next(line for line in proc.stdout.splitlines() if line.startswith("ROW ")).split()[1:]
            print(f"| {' | '.join(row)} |", flush=True)


if __name__ == "__main__":
    main()

"""Rank 0's host memory while a checkpoint is saved, at 2, 4 and 8 processes: each rank writing its own
communication state beside the checkpoint (the default) against all of it gathered to rank 0 into the
checkpoint (what a checkpoint saved to a URL still does, and what every save did before).

The state is top-k's error-feedback residuals (one gradient-sized tensor per rank) of a 2.1 M-parameter
MLP (8.4 MB per rank), after 3 steps on CPU processes. A thread on rank 0 samples its resident memory
every millisecond during `trainer.save_checkpoint`; the row gives the peak above what it held before,
the checkpoint's size and the size of the folder of parts beside it.

    .venv/bin/python recipes/checkpoint_memory.py            # 2, 4, 8 processes, both ways: a Markdown table
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

WORLDS = (2, 4, 8)
MODES = ("parts", "gathered")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakDuring:
    """The most resident memory above the start, sampled every millisecond on a thread."""

    def __enter__(self) -> "PeakDuring":
        self.before = self.peak = resident_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def one_run(world: int, mode: str, folder: Path) -> None:
    """Runs in each of `world` processes (Lightning's launcher starts the others with the same arguments)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import commsched
    from commsched import rank_parts

    warnings.filterwarnings("ignore")
    if mode == "gathered":
        rank_parts.local = lambda path: False  # the checkpoint's own form for URLs: everything through rank 0

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    topk = commsched.CompressionOptions(method="topk", density=0.01, sparsity_warmup_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=commsched.WFBPStrategy(compression=topk),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(3 * 4 * world, 1024), torch.randint(0, 8, (3 * 4 * world,)))
    trainer.fit(MLP(), DataLoader(data, batch_size=4))
    path = folder / f"{mode}-{world}.ckpt"
    with PeakDuring() as measured:
        trainer.save_checkpoint(path)
    if trainer.global_rank == 0:
        parts = rank_parts.parts_folder(path)
        parts_mb = sum(f.stat().st_size for f in parts.glob("*.pt")) / 1e6 if parts.is_dir() else 0.0
        print(
            f"ROW | {world} | {mode} | {(measured.peak - measured.before) / 1e6:.1f} | "
            f"{path.stat().st_size / 1e6:.1f} | {parts_mb:.1f} |",
            flush=True,
        )


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for world in WORLDS:
            for mode in MODES:
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", str(world), mode, folder],
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
                found = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
                if proc.returncode != 0 or not found:
                    sys.exit(f"{world} processes, {mode}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                rows.append(found[0].removeprefix("ROW "))
                time.sleep(1)
    print(
        "| processes | per-rank state | rank 0's peak during the save (MB) | checkpoint (MB) | parts beside it (MB) |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one_run(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        main()

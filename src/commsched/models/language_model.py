"""LanguageModel: GPT-2 as a causal-LM LightningModule with a perplexity metric."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from commsched.errors import bad_value
from commsched.model_names import GPT2_SIZES
from commsched.models import optim
from commsched.models.gpt2 import GPT2, GPT2Config


class LanguageModel(optim.HparamsOptimizer, pl.LightningModule):
    """`size` picks GPT2Config.tiny() or .small(); the other arguments override its fields."""

    def __init__(
        self,
        size: str = "tiny",
        vocab_size: int | None = None,
        block_size: int | None = None,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.9,
        lr_schedule: str = "cosine",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if size not in GPT2_SIZES:
            raise bad_value("model.size", size, GPT2_SIZES)
        base = GPT2Config.tiny() if size == "tiny" else GPT2Config.small()
        overrides = {
            k: v
            for k, v in dict(
                vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
            ).items()
            if v is not None
        }
        self.config = dataclasses.replace(base, **overrides)
        self.gpt = GPT2(self.config)
        self.example_input_array = torch.zeros(1, self.config.block_size, dtype=torch.long)  # FLOPs in the summary
        self.val_ppl = Perplexity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)

    def _loss(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits = self._loss(batch)
        self.val_ppl(logits.float(), batch[1])
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

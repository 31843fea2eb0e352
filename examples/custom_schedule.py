"""custom_schedule.py: a schedule in one file. Every bucket is all-reduced once backward is over (no
overlap, the simplest exact schedule); `python examples/custom_schedule.py` trains it next to Lightning's ddp."""

from typing_extensions import override

import commsched
from commsched.reducers import AllReduce


@commsched.register_schedule
class AfterBackward(commsched.Schedule):
    name = "after_backward"  # Trainer(strategy="after_backward"), commsched-train schedule=after_backward
    description = "all-reduce every bucket after backward"
    step_collectives = ("all_reduce",)  # what the profiler times for it

    def __init__(self, plan, links, settings=None):
        super().__init__(plan, links, settings)
        self.reducers = [AllReduce(bucket.buffer, self.link) for bucket in plan.buckets]

    @override
    def on_bucket_ready(self, b):
        pass  # buckets fill during backward; nothing leaves before it ends

    @override
    def on_backward_end(self):
        works = [reducer.start(f"bucket{b}") for b, reducer in enumerate(self.reducers)]
        for work in works:
            work.wait()
        self.hand_back_gradients(range(len(self.plan.buckets)))  # .grad = the averaged bucket views, as DDP


if __name__ == "__main__":
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from commsched.data import SyntheticImages
    from commsched.models import SmallCNN

    final = {}
    for strategy in ("ddp", "after_backward"):
        pl.seed_everything(0)
        model = SmallCNN(width=8)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(model, DataLoader(SyntheticImages(64), batch_size=8))
        final[strategy] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.is_global_zero:
        difference = max((final["ddp"][k] - v).abs().max().item() for k, v in final["after_backward"].items())
        print(f"largest difference from ddp: {difference:.1e}")

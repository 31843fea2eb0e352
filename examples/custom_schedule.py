"""custom_schedule.py: a schedule in one file. Every bucket is all-reduced once backward is over (no
overlap, the simplest exact schedule), with an option of its own; `python examples/custom_schedule.py`
trains it next to Lightning's ddp."""

from dataclasses import dataclass

from typing_extensions import override

import commsched
from commsched.options import non_negative_int, option
from commsched.reducers import AllReduce


@dataclass
class AfterBackwardOptions:
    """The schedule's own options: ``schedule_options=AfterBackwardOptions(...)`` in Python,
    ``after_backward.in_flight=2`` on commsched-train's command line."""

    in_flight: int = option(0, non_negative_int)
    """Bucket all-reduces in flight at once (0: every bucket's at once); fewer holds less memory in flight."""


@commsched.register_schedule
class AfterBackward(commsched.Schedule[AfterBackwardOptions]):
    name = "after_backward"  # Trainer(strategy="after_backward"), commsched-train schedule=after_backward
    description = "all-reduce every bucket after backward"
    step_collectives = ("all_reduce",)  # what the profiler times for it
    options_class = AfterBackwardOptions  # self.settings is the validated instance

    def __init__(self, plan, links, settings=None):
        super().__init__(plan, links, settings)
        self.reducers = [AllReduce(bucket.buffer, self.link) for bucket in plan.buckets]

    @override
    def on_bucket_ready(self, b):
        pass  # buckets fill during backward; nothing leaves before it ends

    @override
    def on_backward_end(self):
        window = self.settings.in_flight or len(self.reducers)
        for first in range(0, len(self.reducers), window):
            works = [
                self.reducers[b].start(f"bucket{b}") for b in range(first, min(first + window, len(self.reducers)))
            ]
            for work in works:
                work.wait()
        self.hand_back_gradients(range(len(self.plan.buckets)))  # .grad = the averaged bucket views, as DDP

    @override
    def summary(self):
        return [f"{self.settings.in_flight or 'every'} bucket all-reduce(s) in flight at once"]


if __name__ == "__main__":
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from commsched.data import SyntheticImages
    from commsched.models import SmallCNN

    final = {}
    two_in_flight = commsched.STRATEGIES["after_backward"](schedule_options=AfterBackwardOptions(in_flight=2))
    for label, strategy in (("ddp", "ddp"), ("by name", "after_backward"), ("in_flight=2", two_in_flight)):
        pl.seed_everything(0)
        model = SmallCNN(width=8)
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=2,
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        trainer.fit(model, DataLoader(SyntheticImages(64), batch_size=8))
        final[label] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.is_global_zero:
        for label in ("by name", "in_flight=2"):
            difference = max((final["ddp"][k] - v).abs().max().item() for k, v in final[label].items())
            print(f"{label}: largest difference from ddp: {difference:.1e}")

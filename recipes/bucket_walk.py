"""The files one gradient bucket's path passes through under `dear`, counted by tracing a real run
(docs/architecture.md's walk; a measure of how many files a reader follows, not a test).

Usage: python recipes/bucket_walk.py [STEP [CLIP|none [BUCKET_CAP_MB]]] [-v]
  Runs a tiny 2-process gloo training (Lightning Trainer, cpu, devices=2, strategy DeAR with
  fallback="never", fixed small buckets). On rank 0 only, from the first gradient hook of backward
  number STEP (0-based; default 5) until the return of the DeferredStep.apply / DeARSchedule._apply
  call that applied bucket 0's update in the next forward, every Python call into a file under the
  imported commsched package is recorded, on every Python thread (main thread, the links' issuer
  threads, point_to_point's completion threads, torch future callbacks).

  (a) every commsched file entered in that window, any thread;
  (b) files with a frame on a call stack that contains a "bucket-0 frame" (as ancestor, itself or
      descendant): a commsched function called with an argument that names bucket 0
      (b/c/key == 0, buckets/ready/keys containing 0, a tag/what string "bucket0" or "bucket0@N",
      a Bucket with index 0, a Pending/_Request/Together/StripedShards of bucket 0).
Prints both lists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
from collections import defaultdict

VERBOSE = "-v" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "-v"]
STEP = int(ARGS[0]) if len(ARGS) > 0 else 5
CLIP = float(ARGS[1]) if len(ARGS) > 1 and ARGS[1] != "none" else None  # gradient_clip_val, None: none
CAP = float(ARGS[2]) if len(ARGS) > 2 else 0.01  # bucket_cap_mb (0.01: 7 buckets here)
B = 0
RANK0 = os.environ.get("LOCAL_RANK", "0") == "0"

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import commsched  # noqa: E402

SRC = os.path.dirname(os.path.abspath(commsched.__file__)) + os.sep
TAG = re.compile(rf"(^|\W)bucket{B}(@\d+)?($|\W)")


def _named_b(v) -> bool:
    return type(v) is int and v == B


def _is_b(name: str, v) -> bool:
    try:
        if name in ("b", "c", "key", "bucket_index") and _named_b(v):
            return True
        if name in ("buckets", "ready", "keys") and isinstance(v, (list, tuple, set, frozenset)):
            return any(_named_b(x) for x in v)
        if isinstance(v, str):
            return bool(TAG.search(v))
        what = getattr(v, "_what", None) if "_what" in getattr(type(v), "__slots__", ()) else None
        if isinstance(what, str):
            return bool(TAG.search(what))
        tn = type(v).__name__
        if tn == "_Request":
            return bool(TAG.search(v.pending._what))
        if tn == "Together":
            return any(TAG.search(p._what) for p in v.pending)
        if tn == "StripedShards":
            return v.units[0].bucket == B
        if tn == "Bucket":
            return v.index == B
    except Exception:  # noqa: BLE001
        return False
    return False


class Tracer:
    def __init__(self) -> None:
        self.backwards = 0
        self.active = False
        self.done = False
        self.applied = False
        self.why = None
        self.a: dict[str, set] = defaultdict(set)  # file -> {(qualname, thread)}
        self.b: dict[str, dict] = defaultdict(lambda: defaultdict(set))  # file -> qualname -> roles
        self.bframes: set = set()

    def rel(self, filename: str) -> str:
        return filename[len(SRC) :]

    def __call__(self, frame, event, arg):
        if self.done:
            return
        if event not in ("call", "return"):
            return
        code = frame.f_code
        fn = code.co_filename
        if not fn.startswith(SRC):
            return
        if event == "return":  # "_apply": DeAR's own method before DeferredStep (the "before" count)
            if self.active:
                self.bframes.discard(frame)
                if self.applied and code.co_name in ("apply", "_apply") and not self._has_ancestor(frame, code.co_name):
                    self.why = frame.f_locals.get("why")
                    self.active, self.done = False, True
                    sys.setprofile(None)
            return
        name = code.co_name
        if not self.active:
            if name == "_grad_ready" and fn.endswith("schedules/capture.py"):
                capture = frame.f_locals.get("self")
                if capture is not None and getattr(capture.phase, "value", None) != "collecting":
                    if self.backwards == STEP:
                        self.active = True
                    self.backwards += 1
            if not self.active:
                return
        rel = self.rel(fn)
        qual = getattr(code, "co_qualname", name)
        self.a[rel].add((qual, threading.current_thread().name))
        # is this frame about bucket B?
        loc = frame.f_locals
        nargs = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:nargs] + code.co_freevars
        mine = any(_is_b(n, loc.get(n)) for n in names if n in loc)
        if name == "step_buckets" and any(_named_b(x) for x in (loc.get("buckets") or [])):
            self.applied = True
        if mine:
            self.bframes.add(frame)
        # walk the stack: is a bucket-B frame on it?
        stack = []
        f = frame
        on_path = False
        while f is not None:
            if f.f_code.co_filename.startswith(SRC):
                stack.append(f)
            if f in self.bframes:
                on_path = True
            f = f.f_back
        if on_path:
            seen_b = False
            for f in reversed(stack):  # outermost first
                is_b = f in self.bframes
                role = "bucket" if is_b else ("descendant" if seen_b else "ancestor")
                seen_b = seen_b or is_b
                c = f.f_code
                self.b[self.rel(c.co_filename)][getattr(c, "co_qualname", c.co_name)].add(role)

    @staticmethod
    def _has_ancestor(frame, name):
        f = frame.f_back
        while f is not None:
            if f.f_code.co_name == name and f.f_code.co_filename.startswith(SRC):
                return True
            f = f.f_back
        return False

    def report(self) -> dict:
        return {
            "src": SRC,
            "step": STEP,
            "bucket": B,
            "completed": self.done,
            "applied_by": self.why,
            "a": {f: sorted(f"{q} [{t}]" for q, t in v) for f, v in sorted(self.a.items())},
            "b": {f: {q: sorted(r) for q, r in sorted(v.items())} for f, v in sorted(self.b.items())},
        }


TRACER = Tracer()


def _wrap_then():
    """Torch futures' callbacks may run on a thread started before the profiler (or by C++):
    profile them too (instrumentation only; commsched's code is untouched)."""
    original = torch.futures.Future.then

    def then(self, callback):
        def profiled(fut):
            previous = sys.getprofile()
            if previous is None and TRACER.active:
                sys.setprofile(TRACER)
            try:
                return callback(fut)
            finally:
                if previous is None:
                    sys.setprofile(None)

        return original(self, profiled)

    torch.futures.Future.then = then


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(32, 64),
            *(m for _ in range(6) for m in (nn.ReLU(), nn.Linear(64, 64))),
            nn.ReLU(),
            nn.Linear(64, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layers(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 32, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1)), batch_size=16)


def main() -> None:
    pl.seed_everything(1, verbose=False)
    strategy = commsched.DeARStrategy(dear=commsched.DeAROptions(fallback="never"), bucket_cap_mb=CAP)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEP + 3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="bucket_walk_"),
        gradient_clip_val=CLIP,
    )
    if RANK0:
        _wrap_then()
        threading.setprofile(TRACER)
        sys.setprofile(TRACER)
    trainer.fit(Net())
    sys.setprofile(None)
    threading.setprofile(None)
    if trainer.global_rank == 0:
        out = TRACER.report()
        print(f"traced: completed={out['completed']} applied_by={out['applied_by']}")
        print(f"(a) every file entered, {len(out['a'])}:", *out["a"], sep="\n  ")
        print(f"(b) files on the bucket's path, {len(out['b'])}:", *out["b"], sep="\n  ")
        if VERBOSE:
            print(json.dumps(out["b"], indent=1))
    shutil.rmtree(trainer.default_root_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""DDP's communication hooks on wfbp's buckets (workers/run_comm_hooks.py, 2 processes, 20 steps): torch's
PowerSGD and a wrapped hook give the model Lightning's DDPStrategy gives with the same hook and buckets;
PowerSGD's state is in the checkpoint by parameter name and a resume continues exactly, or re-shards its
error feedback at another world size; the hooks run during backward, bucket by bucket."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import commsched
from commsched.errors import CommSchedConfigError
from conftest import max_abs_diff, run_worker

HOOKS = ["powersgd", "powersgd4k", "powersgd164k", "fp16wrap", "fp16wrap4k"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_hooks")
    for world, cases in (
        ("2", [*(f"{s}-{h}" for h in HOOKS for s in ("ddp", "wfbp")), "wfbp-powersgd4k-first"]),
        ("2", ["wfbp-powersgd4k-resumed"]),  # new processes: the first run has ended
        ("1", ["wfbp-powersgd4k-resharded"]),
    ):
        proc = run_worker("run_comm_hooks.py", str(out), world, *cases, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        if world == "1":
            out.joinpath("resharded.log").write_text(proc.stdout + proc.stderr)
    load = lambda case, rank=0: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    load.out = out
    return load


@pytest.mark.parametrize("hook", HOOKS)
def test_the_hook_on_wfbps_buckets_trains_the_model_ddp_trains_with_it(runs, hook):
    for rank in (0, 1):
        reference, got = runs(f"ddp-{hook}", rank), runs(f"wfbp-{hook}", rank)
        assert got["layouts"] == reference["layouts"], "the hook was handed other buckets than under DDP"
        diff, where = max_abs_diff(got["state"], reference["state"])
        assert diff <= 1e-5, f"{hook}, rank {rank}: {diff:.2e} from DDPStrategy with the hook at {where}"


def test_powersgd_compresses_and_the_4k_cases_have_several_buckets(runs):
    """A test that compared a hook which sent everything, or one bucket only, could not fail where it should."""
    diff, _ = max_abs_diff(runs("ddp-powersgd")["state"], runs("ddp-fp16wrap")["state"])
    assert diff > 1e-3, "PowerSGD changed nothing: it never compressed"
    assert len(runs("wfbp-powersgd4k")["layouts"]) > 1


def test_the_hooks_run_during_backward(runs):
    """Each bucket's hook starts as backward fills it: the last layers' bucket before the first layer's
    gradient exists (the overlap DDP has)."""
    events = runs("wfbp-powersgd4k")["events"]
    assert events.index("hook 0") < events.index("first layer's gradient") < events.index("hook 1"), events


def test_powersgd_resumes_exactly_with_its_state_by_parameter_name(runs):
    for rank in (0, 1):
        diff, where = max_abs_diff(
            runs("wfbp-powersgd4k-resumed", rank)["state"], runs("wfbp-powersgd4k", rank)["state"]
        )
        assert diff <= 1e-6, f"rank {rank}: resumed {diff:.2e} from the uninterrupted run at {where}"
    folder = runs.out / "wfbp-powersgd4k-ckpt"
    saved = torch.load(folder / "last.ckpt", weights_only=False)["commsched"]
    where = folder / saved["per_rank_parts"]["folder"]
    parts = [torch.load(where / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    errors = [rank["reducers"]["powersgd_error"] for rank in parts]
    assert set(errors[0]) == {f"net.{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias")}
    assert errors[0]["net.2.weight"].shape == (48, 64) and errors[0]["net.2.weight"].abs().sum() > 0
    low_rank = saved["shared"]["comm_hook"]["low_rank"]  # Q (and P) of each bucket, named by its parameters
    named = [key.removeprefix("bucket:").split("|") for key in low_rank]
    assert len(named) == 2 and sorted(n for names in named for n in names) == sorted(errors[0])


def test_each_ranks_part_goes_with_its_checkpoint(runs):
    """ModelCheckpoint keeps one epoch's checkpoint (and last.ckpt, saved twice): the parts of the one it
    removed go with it, and of last.ckpt's two saves only the parts of the second remain, the ones it names."""
    folder = runs.out / "wfbp-powersgd4k-unused"
    checkpoints = {p.name for p in folder.glob("*.ckpt")}
    assert len(checkpoints) == 2 and "last.ckpt" in checkpoints, checkpoints
    assert {p.name.removesuffix(".commsched") for p in folder.glob("*.commsched")} == checkpoints
    for name in checkpoints:
        named = torch.load(folder / name, weights_only=True)["commsched"]["per_rank_parts"]["folder"]
        saves = [p.relative_to(folder).as_posix() for p in (folder / f"{name}.commsched").iterdir()]
        assert saves == [named], f"{name}: {saves}, naming {named}"
        assert sorted(p.name for p in (folder / named).iterdir()) == ["rank0.pt", "rank1.pt"]


def test_another_world_size_re_shards_powersgds_error_feedback(runs):
    log = (runs.out / "resharded.log").read_text()
    assert "PowerSGD errors of 2 processes are re-sharded over 1" in log, log[-3000:]
    assert runs("wfbp-powersgd4k-resharded")["steps"] == 20


@pytest.mark.parametrize("cls", [commsched.DeARStrategy, commsched.DeFTStrategy, commsched.DeARFabricStrategy])
def test_a_hook_under_a_schedule_without_whole_buckets_names_the_ones_that_take_it(cls):
    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=3)
    with pytest.raises(CommSchedConfigError) as error:
        cls(ddp_comm_hook=powerSGD_hook.powerSGD_hook, ddp_comm_state=state)
    message = str(error.value)
    assert message.startswith(f"commsched: invalid {cls.__name__}(ddp_comm_hook='powerSGD_hook'); allowed: None"), (
        message
    )
    assert "schedules that run it: wfbp" in message


@pytest.mark.parametrize(
    "kwargs, spelled, allowed",
    [
        ({"compression": "topk"}, "compression='topk'", "'none' with ddp_comm_hook"),
        ({"streams": commsched.StreamOptions(count=2)}, "StreamOptions(count=2)", "1 with ddp_comm_hook"),
        ({"comm_dtype": "bf16"}, "comm_dtype='bf16'", "'fp32' with ddp_comm_hook"),
    ],
)
def test_what_a_hook_cannot_run_with_is_refused(kwargs, spelled, allowed):
    with pytest.raises(CommSchedConfigError) as error:
        commsched.WFBPStrategy(
            ddp_comm_hook=default_hooks.allreduce_hook, ddp_comm_wrapper=default_hooks.fp16_compress_wrapper, **kwargs
        )
    assert allowed in str(error.value), str(error.value)


def test_powersgds_error_feedback_re_shards_to_the_old_ranks_mean(tmp_path):
    """PowerSGD's errors are in one rank's undivided units and the hook averages them: at another world size
    each new rank takes the old ranks' mean (top-k's residuals, in averaged units, are shared as a sum)."""
    from commsched.state import RESIDUAL_TOTAL, Restored

    folder = tmp_path / "last.ckpt.commsched" / "save-0000001"
    folder.mkdir(parents=True)
    errors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    for rank, error in enumerate(errors):
        torch.save({"reducers": {"powersgd_error": {"fc.weight": error}}}, folder / f"rank{rank}.pt")
    entry = {"schedule": "wfbp", "world_size": 2, "per_rank": None}
    entry["per_rank_parts"] = {"folder": "last.ckpt.commsched/save-0000001", "world_size": 2}
    for world in (1, 4):
        restored = Restored({"commsched": entry}, "wfbp", rank=0, world_size=world, path=tmp_path / "last.ckpt")
        total = restored.mine["reducers"][RESIDUAL_TOTAL]["powersgd_error"]["fc.weight"]
        assert torch.equal(total / world, (errors[0] + errors[1]) / 2)  # each new rank's share: the old mean


def test_powersgd_that_keeps_state_is_refused_under_fp16s_scaler():
    from commsched.runtime.refusals import refuse_under_scaler

    state = powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=3)
    strategy = commsched.WFBPStrategy(ddp_comm_hook=powerSGD_hook.powerSGD_hook, ddp_comm_state=state)
    optimizers = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)]
    with pytest.raises(CommSchedConfigError, match="puts inf into that state for good"):
        refuse_under_scaler(torch.amp.GradScaler("cpu"), optimizers, "wfbp", True, strategy.options)


def test_a_hooks_state_without_the_hook_is_refused():
    with pytest.raises(CommSchedConfigError, match=r"ddp_comm_state.*None without ddp_comm_hook"):
        commsched.WFBPStrategy(ddp_comm_state=powerSGD_hook.PowerSGDState(process_group=None))

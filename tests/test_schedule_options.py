"""A schedule's own options (`Schedule.options_class`): checked where the user gives them, in Python
(``schedule_options=``) and on commsched-train's command line (a node named after the schedule), and
handed to the schedule as ``self.settings``. No worker process: the end-to-end runs are in
test_extension.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from lightning.pytorch.strategies import StrategyRegistry

import commsched
from commsched import CommSchedConfigError
from commsched.cli.config import own_nodes, register_configs, train_config, train_schedule_names, train_schema, validate
from commsched.options import DeAROptions, DeFTOptions, non_negative_int, option

EXAMPLE = Path(__file__).parent.parent / "examples" / "custom_schedule.py"


@pytest.fixture(scope="module")
def example():
    """The example schedule, imported as a plugin module would be (registered by the import)."""
    spec = importlib.util.spec_from_file_location("after_backward", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["after_backward"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("after_backward", None)


def test_python_gives_the_schedule_its_validated_options(example):
    strategy = commsched.STRATEGIES["after_backward"](schedule_options=example.AfterBackwardOptions(in_flight=3))
    assert strategy.options.schedule_options == example.AfterBackwardOptions(in_flight=3)
    assert commsched.STRATEGIES["after_backward"]().options.schedule_options == example.AfterBackwardOptions()
    settings = example.AfterBackward.settings_for(strategy.options, trainer=None, advance_schedulers=lambda: None)
    assert settings is strategy.options.schedule_options  # what the schedule reads as self.settings
    with pytest.raises(CommSchedConfigError, match=r"after_backward\.in_flight=-1; allowed: an integer >= 0"):
        commsched.STRATEGIES["after_backward"](schedule_options=example.AfterBackwardOptions(in_flight=-1))
    with pytest.raises(
        CommSchedConfigError,
        match=r"schedule_options=\{'in_flight': 2\}\); allowed: a after_backward.AfterBackwardOptions",
    ):
        commsched.STRATEGIES["after_backward"](schedule_options={"in_flight": 2})


def test_a_schedule_without_options_of_its_own_refuses_them():
    with pytest.raises(
        CommSchedConfigError, match="schedule_options=.*allowed: None: schedule wfbp declares no options of its own"
    ):
        commsched.WFBPStrategy(schedule_options=DeAROptions())


def test_dear_and_deft_take_their_options_under_one_name_each():
    dear = commsched.DeARStrategy(dear=DeAROptions(fallback="never")).options
    assert dear.dear.fallback == "never" and dear.schedule_options is dear.dear
    deft = commsched.DeFTStrategy(deft=DeFTOptions(compensation="none")).options
    assert deft.deft.compensation == "none" and deft.schedule_options is deft.deft
    assert commsched.DeARStrategy().options.schedule_options == DeAROptions()
    with pytest.raises(CommSchedConfigError, match=r"allowed: None for schedule dear: its options are dear="):
        commsched.DeARStrategy(schedule_options=DeAROptions(fallback="never"))
    with pytest.raises(CommSchedConfigError, match=r"allowed: None for schedule deft: its options are deft="):
        commsched.DeFTStrategy(schedule_options=DeFTOptions())


def test_profile_takes_its_options_only():
    assert commsched.WFBPStrategy(profile=commsched.ProfileOptions(steps=3)).options.profile.steps == 3
    assert commsched.WFBPStrategy().options.profile == commsched.ProfileOptions()
    with pytest.raises(CommSchedConfigError, match=r"profile=3\); allowed: a commsched.ProfileOptions"):
        commsched.WFBPStrategy(profile=3)


def test_registering_refuses_options_that_cannot_be_built():
    class NotADataclass(commsched.Schedule):
        name = "options_not_a_dataclass"
        options_class = dict

        def on_bucket_ready(self, b):
            pass

        def on_backward_end(self):
            pass

    @dataclasses.dataclass
    class Required:
        size: int

    class NoDefault(NotADataclass):
        name = "options_without_default"
        options_class = Required

    with pytest.raises(CommSchedConfigError, match=r"NotADataclass.options_class = <class 'dict'>: a dataclass"):
        commsched.register_schedule(NotADataclass)
    with pytest.raises(CommSchedConfigError, match=r"options_class Required has fields without a default \(size\)"):
        commsched.register_schedule(NoDefault)
    assert "options_not_a_dataclass" not in commsched.SCHEDULES and "options_without_default" not in commsched.SCHEDULES


def test_registering_refuses_options_an_inherited_settings_for_would_drop():
    """A wfbp subclass with options of its own: wfbp's settings_for builds WFBPSettings, so the options
    would be validated and never seen; registering says to override settings_for."""

    @dataclasses.dataclass
    class Extra:
        every: int = option(1, non_negative_int)

    class WFBPWithOptions(commsched.SCHEDULES["wfbp"]):
        name = "wfbp_with_options"
        options_class = Extra

    with pytest.raises(
        CommSchedConfigError,
        match=r"options_class Extra would never reach the schedule: the settings_for it "
        r"inherits from WFBPSchedule builds WFBPSchedule's own settings",
    ):
        commsched.register_schedule(WFBPWithOptions)

    class WFBPHandingThemOver(WFBPWithOptions):
        name = "wfbp_handing_options_over"

        @classmethod
        def settings_for(cls, options, trainer, advance_schedulers):
            return options.schedule_options

    try:
        commsched.register_schedule(WFBPHandingThemOver)
        assert own_nodes(True)["wfbp_handing_options_over"] is Extra
    finally:
        commsched.SCHEDULES.pop("wfbp_handing_options_over")
        commsched.STRATEGIES.pop("wfbp_handing_options_over")
        StrategyRegistry.remove("wfbp_handing_options_over")


def composed(*overrides: str):
    GlobalHydra.instance().clear()
    register_configs(train_schedule_names(True), train_schema(True))
    with initialize_config_module(config_module="commsched.conf", version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def test_the_command_line_has_a_node_named_after_the_schedule(example):
    assert own_nodes(True)["after_backward"] is example.AfterBackwardOptions
    assert "dear" not in own_nodes(True) and own_nodes(False) == {}  # dear's options have their node, dear.
    train = train_config(composed("plugins=[after_backward]", "schedule=after_backward", "after_backward.in_flight=2"))
    validate(train)
    assert train.after_backward == example.AfterBackwardOptions(in_flight=2)
    for schedule in ("after_backward", "wfbp"):  # checked whichever schedule runs, as dear.* and deft.* are
        with pytest.raises(CommSchedConfigError, match=r"after_backward\.in_flight=-1; allowed: an integer >= 0"):
            validate(
                train_config(
                    composed("plugins=[after_backward]", f"schedule={schedule}", "after_backward.in_flight=-1")
                )
            )


def test_a_schedule_named_like_a_node_of_the_configuration_is_refused():
    @dataclasses.dataclass
    class SeedOptions:
        every: int = option(1, non_negative_int)

    @commsched.register_schedule
    class Seed(commsched.Schedule[SeedOptions]):
        name = "seed"
        options_class = SeedOptions

        def on_bucket_ready(self, b):
            pass

        def on_backward_end(self):
            pass

    try:
        with pytest.raises(
            CommSchedConfigError,
            match=r"schedule 'seed' \(registered by a plugin\) has options of its own, "
            r"and its name is a node of the configuration already \(.*seed",
        ):
            own_nodes(True)
    finally:
        commsched.SCHEDULES.pop("seed")
        commsched.STRATEGIES.pop("seed")
        StrategyRegistry.remove("seed")

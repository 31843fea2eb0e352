"""The stream configuration during training: fixed, or searched on the run's own steps ("auto").

`StreamControl` lives as long as the fit's schedule settings (bucket rebuilds keep it). At every
iteration start the schedule asks it whether the configuration changes (`at_boundary`). With
"auto" it times every step; after `trial_steps` steps of a configuration, rank 0 records the median
(the first step after a switch left out), asks the search for the next configuration and
broadcasts it on the control link, so every rank switches at the same iteration. When the budget
is spent the best measured configuration is kept. Every step of the search is a training step:
nothing is run twice, nothing is thrown away.

After the search the step time is watched: a median over `drift_steps` steps slower than the
chosen configuration's by more than `drift` re-opens the search (budget `retune_steps`), which
first measures the chosen configuration again and one stream: a choice slower than one stream
is dropped for it. The decision and the trials are communication state: a resumed run reuses the
decision (unless `retune_on_resume`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from commsched.options import StreamOptions
from commsched.run_files import folder_of
from commsched.say import say
from commsched.streams.search import StreamSearch
from commsched.streams.space import Space
from commsched.streams.units import Striping

TRIALS_FILE = "commsched_streams.json"
MIN_GAIN = 0.02
"""Several streams are kept only when measured at least this much faster than one (as DeFT's confirmation)."""


class StreamControl:
    def __init__(self, streams: int | str, options: StreamOptions, two_level: Optional[bool] = False,
                 out_dir: Optional[Callable[[], Optional[Path]]] = None, log_metrics: Optional[Callable[[dict[str, float]], None]] = None) -> None:
        """`two_level`: the exchange's algorithm, fixed (True / False) or searched (None: wfbp on several nodes);
        `out_dir`: where this rank writes the trials (None from it: this rank writes nothing)."""
        self.options = options
        self.auto = streams == "auto"
        self.links_needed = options.max_streams if self.auto else int(streams)
        self._two_level = two_level
        self._out_dir = out_dir
        self._log_metrics = log_metrics
        self.space = Space.of(options.max_streams, options.min_unit_mb, options.max_unit_mb, two_level is None)
        self.striping = self._baseline(bool(two_level)) if self.auto else Striping(int(streams), options.unit_mb, bool(two_level))
        self.chosen: Optional[Striping] = None
        self.chosen_s = 0.0
        self.trials: list[dict[str, Any]] = []
        self.searching = self.auto
        self._search: Optional[StreamSearch] = None
        self._technique = "start"
        self._budget = options.budget_steps
        self._spent = 0
        self._last: Optional[float] = None
        self._durations: list[float] = []
        self._search_began = 0  # the first trial of the search under way (drift re-opens a search)
        self._warming = 0  # steps run before the search (`warmup_steps`)
        if self.auto:
            self._open(list(self._firsts()))

    @classmethod
    def of(cls, streams: int | str, options: StreamOptions, trainer: Any, two_level: Optional[bool]) -> "StreamControl":
        def log_metrics(metrics: dict[str, float]) -> None:
            if trainer.logger is not None and trainer.global_rank == 0:
                trainer.logger.log_metrics(metrics, step=trainer.global_step)

        return cls(streams, options, two_level, lambda: folder_of(trainer) if trainer.global_rank == 0 else None, log_metrics)

    @property
    def may_use_two_level(self) -> bool:
        """The intra- and inter-node links are needed: the exchange is node first, or may become so."""
        return self._two_level is None or bool(self._two_level)

    def _baseline(self, two_level: bool) -> Striping:
        return self.space.canonical(Striping(1, self.options.unit_mb, two_level))

    def _firsts(self) -> list[Striping]:
        """One stream (each algorithm searched) before the bandit: the baseline every choice must beat."""
        return [self._baseline(h) for h in self.space.hierarchical]

    def _open(self, first: list[Striping]) -> None:
        self._search = StreamSearch(self.space, first, self.options.exploration, self.options.window, self.options.seed + len(self.trials))
        self._technique, proposed = self._search.propose()
        assert proposed is not None
        self.striping = proposed

    # ------------------------------------------------------------ at a boundary
    def at_boundary(self, control: Any) -> Optional[Striping]:
        """Called at every iteration start on every rank; a configuration to switch to now, or None."""
        now = time.perf_counter()
        if self._last is not None:
            self._durations.append(now - self._last)
        self._last = now
        if not self.auto:
            return None
        if self._warming < self.options.warmup_steps:
            self._warming += 1
            self._durations = []
            return None
        if self.searching:
            if len(self._durations) < self.options.trial_steps:
                return None
            decision = self._decide() if control.rank == 0 else None
            return self._follow(control.broadcast_object(decision, 0, "streams-decision"))
        if not self.options.drift or len(self._durations) < self.options.drift_steps + 1:
            return None
        decision = self._drifted() if control.rank == 0 else None
        return self._follow(control.broadcast_object(decision, 0, "streams-drift"))

    def _measured(self) -> float:
        timed = self._durations[1:] if len(self._durations) > 1 else self._durations
        return statistics.median(timed)

    def _decide(self) -> dict[str, Any]:
        """Rank 0: record the trial just run, then the next configuration, or the choice."""
        assert self._search is not None
        seconds = self._measured()
        trial = self._search.record(self._technique, self.striping, seconds)
        self._spent += len(self._durations)
        technique, proposed = self._search.propose()
        if proposed is None or self._spent + self.options.trial_steps > self._budget:
            best, best_s = self._kept()
            return {"trial": trial.to_json(), "chosen": best.to_json(), "chosen_s": best_s}
        return {"trial": trial.to_json(), "next": proposed.to_json(), "technique": technique}

    def _kept(self) -> tuple[Striping, float]:
        """The best measured configuration, unless one stream was measured within `MIN_GAIN` of it:
        a gain inside the noise of a few timed steps is not worth more groups (and may not be one)."""
        assert self._search is not None
        best, best_s = self._search.best()  # type: ignore[misc]
        single = {s: t for s, t in self._search.measured.items() if s.streams == 1}
        if best.streams > 1 and single:
            one = min(single, key=single.__getitem__)
            if best_s > single[one] * (1 - MIN_GAIN):
                return one, single[one]
        return best, best_s

    def _drifted(self) -> Optional[dict[str, Any]]:
        """Rank 0: the step time watched after the search; re-open it past the drift threshold."""
        median = self._measured()
        if median <= self.chosen_s * (1 + self.options.drift):
            return {"watch": median}
        return {"reopen": median}

    def _follow(self, decision: Optional[dict[str, Any]]) -> Optional[Striping]:
        """Every rank: apply rank 0's decision."""
        assert decision is not None
        if "watch" in decision:
            self._durations = []  # a new window (its first step is no switch: it counts, see `_measured`)
            return None
        if "reopen" in decision:
            say(f"commsched streams: median step {decision['reopen'] * 1e3:.1f} ms, more than {self.options.drift:.0%} "
                f"over the {self.chosen_s * 1e3:.1f} ms measured for {self.striping.describe()}: searching again "
                f"({self.options.retune_steps} steps), one stream measured again first")
            self.searching, self._spent, self._budget = True, 0, self.options.retune_steps
            self._search_began = len(self.trials)
            self._durations, self._last = [], time.perf_counter()
            current = self.striping
            self._open([current, *self._firsts()])  # rank 0's search; the others only follow
            self.striping = current
            return None
        trial = decision["trial"]
        self.trials.append(trial)
        self._report(trial)
        self._durations = []
        if "next" in decision:
            self._technique = decision["technique"]
            return self._switch(Striping.from_json(decision["next"]))
        self.chosen, self.chosen_s, self.searching = Striping.from_json(decision["chosen"]), decision["chosen_s"], False
        one = min((t["step_s"] for t in self.trials[self._search_began:] if t["streams"] == 1), default=None)
        say(f"commsched streams: chose {self.chosen.describe()} ({self.chosen_s * 1e3:.1f} ms/step"
            + (f"; one stream {one * 1e3:.1f} ms/step, {one / self.chosen_s:.2f}x" if one else "")
            + f") after {len(self.trials) - self._search_began} trials")
        self._save()
        return self._switch(self.chosen)

    def _switch(self, striping: Striping) -> Optional[Striping]:
        if striping == self.striping:
            return None
        self.striping = striping
        return striping

    def _report(self, trial: dict[str, Any]) -> None:
        s = Striping.from_json(trial)
        say(f"commsched streams: trial {len(self.trials) - 1} ({trial['technique']}): {s.describe()}: "
            f"{trial['step_s'] * 1e3:.1f} ms/step" + (" (best so far)" if trial["new_best"] else ""))
        if self._log_metrics is not None:
            self._log_metrics({"streams/trial": len(self.trials) - 1, "streams/streams": s.streams,
                               "streams/unit_mb": s.unit_mb, "streams/step_ms": trial["step_s"] * 1e3})

    def _save(self) -> None:
        """The trials as a table (JSON) and a plot beside the run's outputs (rank 0)."""
        from commsched.streams.report import save_trials

        out_dir = self._out_dir() if self._out_dir is not None else None
        if out_dir is not None and self.trials:
            save_trials(out_dir, self.trials, self.chosen, TRIALS_FILE)

    # ---------------------------------------------------- communication state
    def state_dict(self) -> dict[str, Any]:
        if not self.auto:
            return {}
        return {"chosen": self.chosen.to_json() if self.chosen else None, "chosen_s": self.chosen_s, "trials": list(self.trials)}

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> bool:
        """A decision from a checkpoint, taken unless searching again was asked for; True: the
        configuration changed (the schedule rebuilds its reducers)."""
        if not self.auto or not saved or saved.get("chosen") is None or self.chosen is not None:
            return False
        if self.options.retune_on_resume:
            say("commsched streams: the checkpoint's choice is set aside (retune_on_resume): searching again")
            return False
        self.trials = list(saved.get("trials", []))
        self.chosen, self.chosen_s, self.searching = Striping.from_json(saved["chosen"]), float(saved["chosen_s"]), False
        self._search = None
        self._durations, self._last = [], None
        say(f"commsched streams: the checkpoint's choice is kept: {self.chosen.describe()} "
            f"({self.chosen_s * 1e3:.1f} ms/step when measured)")
        return self._switch(self.chosen) is not None


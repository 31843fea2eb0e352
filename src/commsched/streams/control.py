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
is dropped for it. The decision, the trials and a search's progress are communication state: a
resumed run reuses the decision, or goes on with a search the checkpoint caught half-way (its
trials replayed into a fresh search, its budget as it was), unless `retune_on_resume`.

Trials are counted from 1 in everything a person reads (the lines, the table, the plot), and each
search counts its own: a re-opened search starts again at trial 1.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from commsched.interleaved import Turns, verdict_from_samples
from commsched.options import StreamOptions
from commsched.reducers.units import Striping
from commsched.run_files import folder_of
from commsched.say import say
from commsched.streams.search import StreamSearch
from commsched.streams.space import Space

TRIALS_FILE = "commsched_streams.json"


class StreamControl:
    def __init__(
        self,
        streams: int | str,
        options: StreamOptions,
        two_level: Optional[bool] = False,
        out_dir: Optional[Callable[[], Optional[Path]]] = None,
        log_metrics: Optional[Callable[[dict[str, float]], None]] = None,
    ) -> None:
        """`two_level`: the exchange's algorithm, fixed (True / False) or searched (None: wfbp on several nodes);
        `out_dir`: where this rank writes the trials (None from it: this rank writes nothing)."""
        self.options = options
        self.auto = streams == "auto"
        self.streams_at_setup = 1 if self.auto else int(streams)
        """Groups of each link made at setup: a search makes more as it tries them (`Links.streams`)."""
        self._two_level = two_level
        self._out_dir = out_dir
        self._log_metrics = log_metrics
        self.space = Space.of(options.max_streams, options.min_unit_mb, options.max_unit_mb, two_level is None)
        self.striping = (
            self._baseline(bool(two_level)) if self.auto else Striping(int(streams), options.unit_mb, bool(two_level))
        )
        self.chosen: Optional[Striping] = None
        self.chosen_s = 0.0
        self.trials: list[dict[str, Any]] = []
        self.searching = self.auto
        self._confirming: Optional[tuple[list[Striping], Turns, Optional[list[float]]]] = None
        """The search's best and one stream taking turns before the choice."""
        self._search: Optional[StreamSearch] = None
        self._first: list[Striping] = []  # what the search under way measures first (rebuilt from it on resume)
        self._technique = "start"
        self._budget = options.budget_steps
        self._spent = 0  # steps of the search under way's budget spent on finished trials (every rank counts)
        self._last: Optional[float] = None
        self._durations: list[float] = []
        self._search_began = 0  # the first trial of the search under way (drift re-opens a search)
        self._warming = 0  # steps run before the search (`warmup_steps`)
        self._kept_from_checkpoint = False
        self._written: list[Path] = []
        self._written_trials = -1  # trials in the files written last (-1: none written by this fit)
        if self.auto:
            self._open(list(self._firsts()))

    @classmethod
    def of(cls, options: StreamOptions, trainer: Any, two_level: Optional[bool]) -> "StreamControl":
        def log_metrics(metrics: dict[str, float]) -> None:
            if trainer.logger is not None and trainer.global_rank == 0:
                trainer.logger.log_metrics(metrics, step=trainer.global_step)

        return cls(
            options.count,
            options,
            two_level,
            lambda: folder_of(trainer) if trainer.global_rank == 0 else None,
            log_metrics,
        )

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
        self._first = list(first)
        self._search = self._fresh_search()
        self._technique, proposed = self._search.propose()
        assert proposed is not None
        self.striping = proposed

    def _fresh_search(self) -> StreamSearch:
        """The search under way as it was when opened: seeded by where it began, so a re-opened search
        draws differently from the first, and a resumed one as the interrupted one did."""
        return StreamSearch(
            self.space,
            self._first,
            self.options.exploration,
            self.options.window,
            self.options.seed + self._search_began,
        )

    def _expected_trials(self) -> int:
        """About how many trials the search under way runs: its budget over `trial_steps` (fewer when
        the space is smaller; the bandit may also run out of proposals first)."""
        return max(1, min(self._budget // self.options.trial_steps, len(self.space.all())))

    # ------------------------------------------------------------ at a boundary
    def at_boundary(self, control: Any, hold: bool = False) -> Optional[Striping]:
        """Called at every iteration start on every rank; a configuration to switch to now, or None.
        `hold`: another choice is timing these steps (the buckets are being decided): wait, count nothing."""
        now = time.perf_counter()
        if self._last is not None:
            self._durations.append(now - self._last)
        self._last = now
        if not self.auto:
            return None
        if hold:
            self._durations = []
            return None
        if self._warming < self.options.warmup_steps:
            self._warming += 1
            self._durations = []
            return None
        if self._confirming is not None:
            return self._confirm(control)
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
        spent = self._spent + len(self._durations)  # every rank adds it when it follows
        technique, proposed = self._search.propose()
        if proposed is None or spent + self.options.trial_steps > self._budget:
            best, best_s = self._search.best()  # type: ignore[misc]
            plain = self._plain()
            return {
                "trial": trial.to_json(),
                "chosen": best.to_json(),
                "chosen_s": best_s,
                "baseline": plain.to_json() if plain != best else None,
                "baseline_s": self._search.measured.get(plain),
            }
        return {"trial": trial.to_json(), "next": proposed.to_json(), "technique": technique}

    def _plain(self) -> Striping:
        """What the schedule does without streams (one stream, each bucket whole, the run's own algorithm):
        a search's best must beat it on alternating steps before it is kept. Not the fastest one-stream
        trial: a trial of a few steps can flatter one (a two-level exchange on a quiet moment)."""
        return self._baseline(bool(self._two_level))

    def _confirm(self, control: Any) -> Optional[Striping]:
        """Every rank: the search's best and one stream take turns on real steps (the same steps on every
        rank: the turns count iterations); the best is kept only
        when it beats one stream by more than the noise measured in those steps (a trial of a few
        steps each, one after the other, found 3-9% 'gains' on an uncapped link that were not there)."""
        assert self._confirming is not None
        arms, turns, searched = self._confirming
        arm = turns.at_boundary()
        if arm is not None:
            return self._switch(arms[arm])
        if not turns.done:
            return None
        # rank 0's clock decides, as it does every trial of the search
        verdict = control.broadcast_object(
            verdict_from_samples(turns.samples(), turns.steps, searched) if control.rank == 0 else None,
            0,
            "streams-confirm",
        )
        self._confirming = None
        self.chosen, self.chosen_s, self.searching = arms[verdict.keep], verdict.medians_s[verdict.keep], False
        say(
            "commsched streams: on alternating steps, "
            f"{verdict.describe(['one stream', 'the search' + chr(39) + 's best'])}: "
            + (f"{self.chosen.describe()} kept ({verdict.gain:.2f}x)" if verdict.keep else "one stream kept")
        )
        self._save()
        self._durations = []
        return self._switch(self.chosen)

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
            say(
                f"commsched streams: median step {decision['reopen'] * 1e3:.1f} ms, more than {self.options.drift:.0%} "
                f"over the {self.chosen_s * 1e3:.1f} ms measured for {self.striping.describe()}: searching again "
                f"({self.options.retune_steps} steps), one stream measured again first"
            )
            self.searching, self._spent, self._budget = True, 0, self.options.retune_steps
            self._search_began, self._kept_from_checkpoint = len(self.trials), False
            self._durations, self._last = [], time.perf_counter()
            current = self.striping
            self._open([current, *self._firsts()])  # rank 0's search; the others only follow
            self.striping = current
            return None
        trial = decision["trial"]
        self.trials.append(trial)
        self._spent += len(self._durations)
        self._report(trial, last="chosen" in decision)
        self._durations = []
        if "next" in decision:
            self._technique = decision["technique"]
            return self._switch(Striping.from_json(decision["next"]))
        if decision.get("baseline") is not None:
            arms = [Striping.from_json(decision["baseline"]), Striping.from_json(decision["chosen"])]
            say(
                f"commsched streams: the search's best, {arms[1].describe()}, now takes turns with "
                f"{arms[0].describe()} before it is kept"
            )
            searched = [
                decision.get("baseline_s"),
                decision["chosen_s"],
            ]  # what the search's trials measured: the prior
            self._confirming = (
                arms,
                Turns(arms=2, steps_per_turn=max(1, self.options.trial_steps - 1), rounds=self.options.confirm_rounds),
                searched if None not in searched else None,
            )
            return None
        self.chosen, self.chosen_s, self.searching = Striping.from_json(decision["chosen"]), decision["chosen_s"], False
        one = self._one_stream_s()
        say(
            f"commsched streams: chose {self.chosen.describe()} ({self.chosen_s * 1e3:.1f} ms/step"
            + (
                f"; one stream {one * 1e3:.1f} ms/step, {one / self.chosen_s:.2f}x"
                if one and self.chosen.streams > 1
                else ""
            )
            + f") after {len(self.trials) - self._search_began} trials"
        )
        self._save()
        return self._switch(self.chosen)

    def _switch(self, striping: Striping) -> Optional[Striping]:
        if striping == self.striping:
            return None
        self.striping = striping
        return striping

    def _report(self, trial: dict[str, Any], last: bool) -> None:
        """One line a trial, with the search's progress: its number in the search under way of about
        how many, and the steps of the budget left (the search's length, not the run's, is the budget)."""
        s = Striping.from_json(trial)
        number = len(self.trials) - self._search_began
        progress = "the search's last" if last else f"about {self._budget - self._spent} steps of the search left"
        say(
            f"commsched streams: trial {number}/~{self._expected_trials()} ({trial['technique']}): {s.describe()}: "
            f"{trial['step_s'] * 1e3:.1f} ms/step (" + ("best so far; " if trial["new_best"] else "") + f"{progress})"
        )
        if self._log_metrics is not None:
            self._log_metrics(
                {
                    "streams/trial": len(self.trials),
                    "streams/streams": s.streams,
                    "streams/unit_mb": s.unit_mb,
                    "streams/step_ms": trial["step_s"] * 1e3,
                }
            )

    def _searched(self) -> list[dict[str, Any]]:
        """The trials of the search under way (or of the last one)."""
        return self.trials[self._search_began :]

    def _one_stream_s(self) -> Optional[float]:
        """The fastest one-stream step the search under way measured (None: none measured)."""
        return min((t["step_s"] for t in self._searched() if t["streams"] == 1), default=None)

    def _save(self) -> None:
        """The trials as a table (JSON) and a plot beside the run's outputs (rank 0)."""
        from commsched.streams.trial_report import save_trials

        out_dir = self._out_dir() if self._out_dir is not None else None
        if out_dir is not None and self.trials:
            for path in save_trials(out_dir, self.trials, self.chosen, TRIALS_FILE):
                if path not in self._written:
                    self._written.append(path)
        self._written_trials = len(self.trials)

    # ------------------------------------------------------------ end of fit
    def finish(self) -> Optional[str]:
        """End of fit (every rank, once; again is harmless): one line for the closing summary saying
        which configuration this run used, None for one fixed stream (nothing to say). The trials
        file is brought up to date (rank 0): a run that ends before its search does, or that kept a
        checkpoint's choice, still leaves the trials behind its configuration in its folder."""
        if not self.auto:
            return None if self.striping.streams == 1 else f"streams: {self.striping.describe()} (fixed)"
        if self.trials and self._written_trials != len(self.trials):
            self._save()
        return self._unfinished() if self.searching else self._finished()

    def _finished(self) -> str:
        assert self.chosen is not None
        trials = len(self._searched())
        line = f"streams: {self.chosen.describe()}, chosen after {trials} trials"
        if self._search_began:
            line += " of a search re-opened after a slow-down"
        one = self._one_stream_s()
        if self.chosen.streams > 1 and one:
            line += f", {one / self.chosen_s:.2f}x one stream"
        elif self.chosen.streams == 1:
            line += " (nothing measured faster than one stream by more than the noise)"
        return line + (" (the checkpoint's choice)" if self._kept_from_checkpoint else "")

    def _unfinished(self) -> str:
        """Which configuration ran last and the best one measured: a short run's step times are those
        of whatever the search was measuring, not of its choice, and the user should know which."""
        trials = self._searched()
        again = " (re-opened after a slow-down)" if self._search_began else ""
        line = (
            f"streams search{again} unfinished after {len(trials)} of ~{self._expected_trials()} trials: "
            f"ran {self.striping.describe()}; "
        )
        if not trials:
            return line + "nothing measured yet; resume or run longer to finish it"
        best = min(trials, key=lambda t: t["step_s"])
        one = self._one_stream_s()
        against = f" against {one * 1e3:.1f} for one stream" if one is not None and best["streams"] > 1 else ""
        return (
            line
            + f"best measured {Striping.from_json(best).describe()} ({best['step_s'] * 1e3:.1f} ms/step{against}); "
            "resume or run longer to finish it"
        )

    def files(self) -> list[Path]:
        """The files this rank wrote in this fit (rank 0's trials table, JSON and plot; none elsewhere)."""
        return list(self._written)

    # ---------------------------------------------------- communication state
    def state_dict(self) -> dict[str, Any]:
        """Equal on every rank: each follows rank 0's decisions and counts the same steps."""
        if not self.auto:
            return {}
        saved: dict[str, Any] = {
            "chosen": self.chosen.to_json() if self.chosen else None,
            "chosen_s": self.chosen_s,
            "trials": list(self.trials),
            "began": self._search_began,
        }
        if self.searching:
            saved["search"] = {
                "spent": self._spent,
                "budget": self._budget,
                "first": [s.to_json() for s in self._first],
                "running": self.striping.to_json(),
                "technique": self._technique,
            }
        return saved

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> bool:
        """A checkpoint's decision, or its search half-way, taken unless searching again was asked
        for; True: the configuration changed (the schedule rebuilds its reducers). Only a control
        that has not run a step takes state: a bucket rebuild hands back what it just took."""
        if not self.auto or not saved or self._last is not None or saved == self.state_dict():
            return False
        search: Optional[dict[str, Any]] = saved.get("search")
        if saved.get("chosen") is None and search is None and not saved.get("trials"):
            return False
        if self.options.retune_on_resume:
            said = (
                "choice"
                if search is None and saved.get("chosen") is not None
                else f"{len(saved.get('trials', []))} trials"
            )
            say(f"commsched streams: the checkpoint's {said} set aside (retune_on_resume): searching again")
            return False
        self.trials = list(saved.get("trials", []))
        self._search_began = int(saved.get("began", 0))
        self.chosen = Striping.from_json(saved["chosen"]) if saved.get("chosen") is not None else None
        self.chosen_s = float(saved.get("chosen_s", 0.0))
        self._durations, self._last, self._warming = [], None, 0
        if search is None and self.chosen is not None:
            return self._keep_choice()
        return self._resume_search(search or {})

    def _keep_choice(self) -> bool:
        assert self.chosen is not None
        self.searching, self._search, self._kept_from_checkpoint = False, None, True
        say(
            f"commsched streams: the checkpoint's choice is kept: {self.chosen.describe()} "
            f"({self.chosen_s * 1e3:.1f} ms/step when measured)"
        )
        return self._switch(self.chosen) is not None

    def _resume_search(self, search: dict[str, Any]) -> bool:
        """Go on with the checkpoint's search: its trials replayed, its budget as it was, the
        configuration it was measuring measured again from its first step (after `warmup_steps`:
        a new process's first steps are slow). Every rank takes the same saved state, so every rank
        runs the same configuration; rank 0's search decides from here as before."""
        trials = self._searched()
        self._budget = int(search.get("budget", self.options.budget_steps))
        self._spent = int(search.get("spent", len(trials) * self.options.trial_steps))  # older checkpoints: full trials
        self._first = [Striping.from_json(s) for s in search["first"]] if "first" in search else self._firsts()
        self._search = self._replayed(trials)
        self._technique, proposed = self._search.propose()  # as the interrupted run did after its last trial
        self._technique = search.get("technique", self._technique)
        running = Striping.from_json(search["running"]) if "running" in search else proposed or self.striping
        self.searching = True
        say(
            f"commsched streams: resuming the search at trial {len(trials) + 1} of about {self._expected_trials()} "
            f"({max(0, self._budget - self._spent)} steps of its budget left)"
        )
        return self._switch(running) is not None

    def _replayed(self, trials: list[dict[str, Any]]) -> StreamSearch:
        """A fresh search told the recorded trials in order, each after the proposal it answered: its
        techniques, bandit and random draws end where the interrupted run's did, and it proposes
        nothing measured already (no configuration is measured twice)."""
        search = self._fresh_search()
        for t in trials:
            search.propose()
            search.record(t["technique"], Striping.from_json(t), float(t["step_s"]))
        return search

"""The job's watch over its train/generation mismatch (``precision.mismatch_slo``): the SLO over
the window ending at each step (:mod:`rljob.mismatch_slo`), the per-layer attribution
(:mod:`workers.rl.attribution`) every ``attribution_interval`` steps and in the step where the SLO
is breached, and with ``action: respond`` the precision actions (:mod:`rljob.precision_actions`)
a breach takes and a window within the SLO undoes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rljob import metrics as m
from rljob.metrics import mismatch_layer_key
from rljob.mismatch_slo import evaluate
from rljob.precision_actions import Actions, take, undo
from rljob.run_dir import RunDir
from rljob.spec import JobSpec
from workers.rl.attribution import Probe, attribute, worst_layers
from workers.rl.protocol import StepActors


class MismatchWatch:
    """What one driver knows of the job's mismatch between steps."""

    def __init__(self, spec: JobSpec, out: Path, log: Callable[[str], None]) -> None:
        self.spec, self.out, self.log = spec, out, log
        self.met: bool | None = None  # the SLO at the last step (None: not yet evaluated)
        self.breached_now = False  # the last step is the one where the SLO broke
        self.probes: tuple[Probe, ...] = ()  # the last trained step's tokens to trace
        self.actions = Actions()  # the precision actions in effect (the checkpoint's, on a resume)
        self.worst: list[int] = []  # the newest attribution's layers, worst first
        self.spent = False  # the ladder had nothing left at a breach (said once)
        self.judged = False  # the last step was judged on steps after the last action

    def observe(
        self, step: int, row: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]
    ) -> dict[str, float]:
        """The SLO over the window ending at ``step`` (``row``, after the ``earlier`` lines of the
        job, a resumed one's too), as the line's ``mismatch_slo/*`` keys; a change between met and
        breached is logged once."""
        slo = self.spec.precision.mismatch_slo
        key = f"mismatch/{slo.metric}"
        values = [float(row[key])] if key in row else []
        for line in reversed(earlier):
            if len(values) >= slo.window or int(line.get(m.STEP, 0)) <= self.actions.since:
                break  # the window starts again after a precision action
            if key in line:
                values.append(float(line[key]))
        state = evaluate(values[::-1], slo, self.spec.precision.recipe)
        self.breached_now = False
        self.judged = state is not None and step > self.actions.since
        if state is None:
            return {}
        if state.met != self.met:
            what = "met again" if state.met else "breached"
            if not (state.met and self.met is None):  # a job that starts within it says nothing
                self.log(f"step {step}: mismatch SLO {what}: {state.message(slo.metric)}")
            self.breached_now = not state.met
            self.met = state.met
        return state.as_row()

    def attribution(self, step: int, actors: StepActors | None) -> dict[str, float]:
        """Each decoder layer's contribution to the mismatch, when due (every
        ``attribution_interval`` steps, and in the step the SLO broke): appended to
        ``mismatch_layers.jsonl`` and returned as the line's ``mismatch/layer/<i>`` keys."""
        interval = self.spec.precision.mismatch_slo.attribution_interval
        due = self.breached_now or (interval > 0 and step % interval == 0)
        if actors is None or not self.probes or not due:
            return {}
        contributions = attribute(actors, self.probes)
        worst = worst_layers(contributions, len(contributions))
        self.worst = worst
        worst = worst[:3]
        record = {
            "step": step,
            "breached": self.breached_now,
            "layers": contributions,
            "worst": worst,
            "tokens_logprob_diff": [p.logprob_diff for p in self.probes],
        }
        with RunDir(self.out).mismatch_layers.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.breached_now and contributions:
            shares = ", ".join(f"{i} ({contributions[i]:+.3g})" for i in worst)
            self.log(f"step {step}: the decoder layers that add most to the mismatch: {shares}")
        return {mismatch_layer_key(i): c for i, c in enumerate(contributions)}

    def respond(self, step: int) -> bool:
        """With ``action: respond``, after step ``step``'s :meth:`observe` and :meth:`attribution`:
        the next precision action when the SLO is breached over the steps since the last one, or
        (``relax``) the last one undone when the SLO has held for a whole window since. A change
        is said in the log once and is a line of ``precision_actions.jsonl``; returns whether
        the actions changed (the engines must be built again)."""
        decided = self.decide(step)
        if decided is None:
            return False
        self.actions, what = decided
        self.log(f"step {step}: mismatch SLO response: {what} (from step {step + 1})")
        entry = {"time": time.time(), "step": step, "what": what, **self.actions.to_json()}
        with RunDir(self.out).precision_actions.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return True

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint's ``state.json`` keeps of the watch: the precision actions in effect."""
        return {PRECISION_STATE: self.actions.to_json()}

    def adopt(self, ckpt: Path | None) -> Actions:
        """The precision actions ``ckpt`` kept (none without one), now in effect; the lines of
        ``precision_actions.jsonl`` from after it go, as the metrics lines do (those steps run
        again)."""
        state = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else {}
        self.actions = Actions.from_json(state.get(PRECISION_STATE))
        path = RunDir(self.out).precision_actions
        if path.exists():
            kept = [x for x in path.read_text().splitlines() if json.loads(x)["step"] <= state.get("step", 0)]
            path.write_text("".join(x + "\n" for x in kept))
        if self.actions.taken:
            self.log(f"precision actions in effect from {ckpt}: {', '.join(self.actions.taken)}")
        return self.actions

    def decide(self, step: int) -> tuple[Actions, str] | None:
        """:meth:`respond`'s decision, without acting on it: the new actions and what they do, or
        None."""
        slo = self.spec.precision.mismatch_slo
        if slo.action != "respond" or self.met is None or not self.judged:
            return None
        if not self.met:
            taken = take(self.spec, self.actions, step, self.worst)
            if taken is None and not self.spent:
                self.spent = True
                self.log(f"step {step}: mismatch SLO breached and every precision action is taken")
            return taken
        if slo.relax and self.actions.taken and step - self.actions.since >= slo.window:
            return undo(self.spec, self.actions, step)
        return None


PRECISION_STATE = "precision_actions"  # the state.json key of the precision actions in effect

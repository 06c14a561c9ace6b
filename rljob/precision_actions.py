"""The job's response to a breached mismatch SLO (``precision.mismatch_slo.action: respond``).

Each breach takes the next action of a fixed ladder that applies to the job, cheapest first:

1. ``tighten-is``: the importance-sampling truncation halves its distance to 1 (``high`` 2 -> 1.5,
   ``low`` 0.5 -> 0.75); a job without IS (``mode: none``) gets truncated IS (``tis``) at its
   ``high``.
2. ``bf16-layers``: the ``action_layers`` decoder layers (default: half of the model's, rounded
   up) that add most to the mismatch (the per-layer attribution of the breach) among those still
   FP8 join ``precision.bf16_layers`` in both engines, through the path that builds the engines
   from the spec, so the precision contract still holds. Layers already BF16
   (``keep_bf16_layers``' ends, the spec's ``bf16_layers``) are passed over, so the action moves
   as many layers as it says. It needs the attribution (native engines), an FP8 recipe and a
   layer still FP8; else it is passed over.
3. ``bf16-kv-cache``: ``precision.fp8_kv_cache`` off (only when it is on).
4. ``bf16-generation``: recipe ``bf16`` (for ``fp8-gen`` the generator; ``fp8-e2e`` has no recipe
   with a BF16 generator beside an FP8 trainer, so both engines go to BF16).

``tighten-is`` changes no engine, so it cannot lower the mismatch the SLO judges: a breach takes it
together with the next action (:func:`take`). A breach takes ``actions_per_breach`` (1 by default)
of the engine actions 2-4, in that order.

A breach judges the steps since the last action only (the window starts again there), so one bad
window does not climb the whole ladder. With ``relax``, the last action is undone once the SLO has
held for a whole window since it was taken. :class:`Actions` is what the checkpoint keeps and a
resumed job continues with; :func:`effective` is the spec the engines are built from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rljob import metrics as m
from rljob.mismatch_slo import MismatchSloSpec
from rljob.spec import JobSpec
from rljob.status import Reason

LADDER = ("tighten-is", "bf16-layers", "bf16-kv-cache", "bf16-generation")
ENGINE_FREE = frozenset({"tighten-is"})  # actions that change no engine: never taken alone (:func:`take`)


@dataclass(frozen=True)
class Actions:
    """The actions in effect, in the order taken; ``layers``: those ``bf16-layers`` chose;
    ``since``: the step the last one (or its undoing) was taken after (0: none yet)."""

    taken: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()
    since: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"taken": list(self.taken), "layers": list(self.layers), "since": self.since}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Actions:
        """What :meth:`to_json` wrote (a checkpoint's); refuses what no ladder could have made."""
        if not data:
            return cls()
        taken = tuple(str(a) for a in data.get("taken", ()))
        if any(a not in LADDER for a in taken) or len(set(taken)) != len(taken):
            raise ValueError(f"precision actions {taken}: not a subset of {LADDER}, each once")
        layers = tuple(int(i) for i in data.get("layers", ()))
        return cls(taken, layers if "bf16-layers" in taken else (), int(data.get("since", 0)))


def _applies(action: str, spec: JobSpec, layers: Sequence[int]) -> bool:
    p = spec.precision
    if action == "tighten-is":
        return True
    if action == "bf16-layers":
        return p.recipe != "bf16" and bool(movable(spec, layers))
    if action == "bf16-kv-cache":
        return p.fp8_kv_cache
    return p.recipe != "bf16"


def next_action(spec: JobSpec, actions: Actions, worst: Sequence[int]) -> str | None:
    """The first action of :data:`LADDER` not taken that applies to ``spec`` (the job's own spec,
    with the actions taken applied); ``worst``: the attribution's layers, worst first (empty when
    there is none). None: the ladder is spent."""
    now = effective(spec, actions)
    for action in LADDER:
        if action not in actions.taken and _applies(action, now, worst):
            return action
    return None


def movable(spec: JobSpec, worst: Sequence[int]) -> list[int]:
    """``worst`` (the attribution's ranking of all of the model's decoder layers, worst first)
    without the layers ``spec`` already keeps in BF16, in the same order."""
    bf16 = spec.precision.bf16_decoder_layers(len(worst))
    return [i for i in worst if i not in bf16]


def layer_count(spec: JobSpec, worst: Sequence[int]) -> int:
    """How many decoder layers ``bf16-layers`` moves: ``mismatch_slo.action_layers``, or half of
    the model's layers rounded up (``worst`` ranks them all) when it is not set."""
    count = spec.precision.mismatch_slo.action_layers
    return count if count is not None else math.ceil(len(worst) / 2)


def take(spec: JobSpec, actions: Actions, step: int, worst: Sequence[int]) -> tuple[Actions, str] | None:
    """``actions`` with the breach after ``step`` answered, and what that does, in one line; None
    when the ladder is spent. A breach takes ``mismatch_slo.actions_per_breach`` engine actions, in
    the ladder's order, as far as the ladder goes. ``tighten-is`` changes no engine, so it cannot
    bring the metric back under its bound (the SLO judges the engines' log-probabilities, not the
    update): it is taken together with the next action that does, and does not count."""
    done = _take_one(spec, actions, step, worst)
    if done is None:
        return None
    for _ in range(spec.precision.mismatch_slo.actions_per_breach - 1):
        more = _take_one(spec, done[0], step, worst)
        if more is None:
            break
        done = more[0], f"{done[1]}; {more[1]}"
    return done


def _take_one(spec: JobSpec, actions: Actions, step: int, worst: Sequence[int]) -> tuple[Actions, str] | None:
    """:func:`take` of one engine action (with ``tighten-is`` before it when that is next)."""
    action = next_action(spec, actions, worst)
    if action is None:
        return None
    if action == "bf16-layers":
        layers = tuple(movable(effective(spec, actions), worst)[: layer_count(spec, worst)])
    else:
        layers = actions.layers
    after = Actions((*actions.taken, action), layers, step)
    what = describe(spec, actions, after, action)
    if action in ENGINE_FREE:
        more = _take_one(spec, after, step, worst)
        if more is not None:
            return more[0], f"{what}; {more[1]}"
    return after, what


def undo(spec: JobSpec, actions: Actions, step: int) -> tuple[Actions, str] | None:
    """``actions`` without the last one (after ``step``), and what that does; None when none."""
    if not actions.taken:
        return None
    last = actions.taken[-1]
    after = Actions(actions.taken[:-1], () if last == "bf16-layers" else actions.layers, step)
    return after, f"undone: {describe(spec, after, actions, last)}"


def describe(spec: JobSpec, before: Actions, after: Actions, action: str) -> str:
    """What ``action`` changes, from ``before``'s settings to ``after``'s."""
    old, new = effective(spec, before), effective(spec, after)
    if action == "tighten-is":
        a, b = old.algorithm.importance_sampling, new.algorithm.importance_sampling
        was, now = f"{a.mode} [{a.low:g}, {a.high:g}]", f"{b.mode} [{b.low:g}, {b.high:g}]"
        return f"tighten-is: importance sampling {was} -> {now}"
    if action == "bf16-layers":
        return f"bf16-layers: decoder layers {sorted(after.layers or before.layers)} to BF16 in both engines"
    if action == "bf16-kv-cache":
        return "bf16-kv-cache: the generators' KV cache from FP8 (E4M3) to BF16"
    return f"bf16-generation: recipe {old.precision.recipe} -> {new.precision.recipe}"


def effective(spec: JobSpec, actions: Actions) -> JobSpec:
    """``spec`` with ``actions`` applied: what the engines are built from."""
    if not actions.taken:
        return spec
    algo, precision = spec.algorithm, spec.precision
    isc = algo.importance_sampling
    if "tighten-is" in actions.taken:
        mode = "tis" if isc.mode == "none" else isc.mode
        high = isc.high if isc.mode == "none" else 1 + (isc.high - 1) / 2
        low = 1 - (1 - isc.low) / 2 if isc.low < 1 else isc.low
        isc = isc.model_copy(update={"mode": mode, "high": max(high, low), "low": min(low, high)})
    changes: dict[str, Any] = {}
    if "bf16-layers" in actions.taken:
        changes["bf16_layers"] = tuple(sorted(set(precision.bf16_layers) | set(actions.layers)))
    if "bf16-kv-cache" in actions.taken:
        changes["fp8_kv_cache"] = False
    if "bf16-generation" in actions.taken:
        changes.update(recipe="bf16", fp8_kv_cache=False)
    return spec.model_copy(
        update={
            "algorithm": algo.model_copy(update={"importance_sampling": isc}),
            "precision": precision.model_copy(update=changes),
        }
    )


def condition_of(row: Mapping[str, float], slo: MismatchSloSpec) -> tuple[bool, Reason, str] | None:
    """The job's ``PrecisionActions`` condition from a step's line (or the driver's gauges read
    back as one); None without ``action: respond`` or before the first line."""
    if slo.action != "respond" or m.PRECISION_ACTIONS not in row:
        return None
    count = int(row[m.PRECISION_ACTIONS])
    if count == 0:
        return False, Reason.PRECISION_AS_SPECIFIED, "the job runs at the precision its spec asks for"
    message = (
        f"the mismatch SLO's response has {count} precision action(s) in effect (of {', '.join(LADDER)}, "
        "in that order, each where it applies); the job's log and precision_actions.jsonl name them"
    )
    return True, Reason.PRECISION_RAISED, message

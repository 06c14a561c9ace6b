"""The driver's watch over the mismatch SLO with ``action: respond``, on hand-made series: a breach
takes the next action, the window starts again after it (one bad window does not climb the whole
ladder), a step without the metric judges nothing, and ``relax`` undoes the last action after a
whole window within the SLO."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rljob import parse_spec
from rljob.precision_actions import Actions
from tests import helpers
from workers.job.mismatch_watch import MismatchWatch

KEY = "mismatch/token_mult_prob_error"


def watch(tmp_path: Path, **slo: Any) -> tuple[MismatchWatch, list[str]]:
    bounds = {"median": 1.2, "tail_bound": 1.5, "tail_fraction": 0.34, "window": 3, "action": "respond"}
    precision = {"recipe": "fp8-gen", "fp8_kv_cache": True, "mismatch_slo": {**bounds, **slo}}
    spec = parse_spec(helpers.tiny_spec(precision=precision))
    said: list[str] = []
    return MismatchWatch(spec, tmp_path, said.append), said


def feed(w: MismatchWatch, values: list[float | None]) -> list[tuple[int, tuple[str, ...]]]:
    """Each value as a step's line (None: a line without the metric); the actions after each step."""
    rows: list[dict[str, Any]] = []
    seen = []
    for step, value in enumerate(values, start=1):
        row: dict[str, Any] = {"step": step} if value is None else {"step": step, KEY: value}
        w.observe(step, row, rows)
        rows.append(row)
        w.respond(step)
        seen.append((step, w.actions.taken))
    return seen


def test_a_breach_takes_one_action_and_the_window_starts_again(tmp_path: Path) -> None:
    w, said = watch(tmp_path)
    # window 3, one step above 1.5 allowed (floor(0.34 x 3) = 1), median <= 1.2
    seen = feed(w, [1.1, 1.1, 1.6, 1.7, 1.1, 1.15, 1.3])
    assert seen[:3] == [(1, ()), (2, ()), (3, ())]  # [1.1, 1.1, 1.6]: one spike in the window is allowed
    # [1.1, 1.6, 1.7]: two above 1.5, median 1.6; tighten-is changes no engine, so the next action
    # comes with it (no attribution here: no layers to choose)
    taken = ("tighten-is", "bf16-kv-cache")
    assert seen[3] == (4, taken)
    # step 5 is judged alone: [1.1] holds, though the window of 3 would still hold 1.6 and 1.7
    assert seen[4] == (5, taken) and seen[5] == (6, taken)
    # [1.1, 1.15, 1.3]: median 1.15, none above 1.5: held
    assert seen[6] == (7, taken)
    assert any("breached" in x for x in said) and any("met again" in x for x in said)


def test_a_breach_after_an_action_takes_the_next(tmp_path: Path) -> None:
    w, said = watch(tmp_path)
    seen = feed(w, [1.3, None, 1.25, 1.1])
    assert seen[0] == (1, ("tighten-is", "bf16-kv-cache"))  # median 1.3 > 1.2; no attribution: no layers
    assert seen[1] == (2, ("tighten-is", "bf16-kv-cache"))  # no metric: nothing judged
    assert seen[2] == (3, ("tighten-is", "bf16-kv-cache", "bf16-generation"))  # [1.25] alone
    assert seen[3][1] == ("tighten-is", "bf16-kv-cache", "bf16-generation")
    w.met, w.judged = False, True
    assert not w.respond(6)  # the ladder is spent: said once
    assert not w.respond(7)
    assert [x for x in said if "every precision action is taken" in x] == [
        "step 6: mismatch SLO breached and every precision action is taken"
    ]


def test_the_attribution_s_worst_layers_go_to_bf16(tmp_path: Path) -> None:
    w, _ = watch(tmp_path, action_layers=1)
    w.actions = Actions(("tighten-is",), (), 0)
    w.worst = [1, 0]
    assert feed(w, [1.3])[0] == (1, ("tighten-is", "bf16-layers"))
    assert w.actions.layers == (1,)


def test_relax_undoes_the_last_action_after_a_whole_window_within(tmp_path: Path) -> None:
    w, _ = watch(tmp_path, relax=True)
    seen = feed(w, [1.3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert seen[0] == (1, ("tighten-is", "bf16-kv-cache"))
    # 2 steps since: not yet a window
    assert [t for _, t in seen[1:3]] == [("tighten-is", "bf16-kv-cache")] * 2
    assert seen[3] == (4, ("tighten-is",))  # steps 2-4 held: the last action undone after step 4
    assert [t for _, t in seen[4:6]] == [("tighten-is",)] * 2
    assert seen[6] == (7, ())  # steps 5-7 held: the first one undone too
    assert [t for _, t in seen[7:]] == [()] * 2  # nothing left to undo
    alert = watch(tmp_path, relax=False)[0]
    assert feed(alert, [1.3, 1.0, 1.0, 1.0, 1.0])[-1] == (5, ("tighten-is", "bf16-kv-cache"))


def test_alert_only_takes_no_action(tmp_path: Path) -> None:
    w, said = watch(tmp_path, action="alert-only")
    assert all(t == () for _, t in feed(w, [2.0, 2.0, 2.0, 2.0]))
    assert any("breached" in x for x in said)


def test_each_change_is_a_line_and_a_checkpoint_brings_back_its_own(tmp_path: Path) -> None:
    """Each action is a line of precision_actions.jsonl; a checkpoint keeps the actions in
    effect, and adopting it (a resume) restores them and drops the lines of later steps."""
    w, said = watch(tmp_path)
    feed(w, [1.3, 1.3])  # tighten-is and bf16-kv-cache after step 1, bf16-generation after step 2
    assert w.checkpoint_state() == {"precision_actions": w.actions.to_json()}
    lines = [json.loads(x) for x in (tmp_path / "precision_actions.jsonl").read_text().splitlines()]
    assert [(x["step"], x["taken"]) for x in lines] == [
        (1, ["tighten-is", "bf16-kv-cache"]),
        (2, ["tighten-is", "bf16-kv-cache", "bf16-generation"]),
    ]
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    step_1 = Actions(("tighten-is", "bf16-kv-cache"), (), 1)
    (ckpt / "state.json").write_text(json.dumps({"step": 1, "precision_actions": step_1.to_json()}))
    fresh, said_again = watch(tmp_path)
    assert fresh.adopt(ckpt) == step_1 == fresh.actions
    lines = [json.loads(x) for x in (tmp_path / "precision_actions.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1]
    assert said_again == [f"precision actions in effect from {ckpt}: tighten-is, bf16-kv-cache"]
    assert [x for x in said if "response" in x] == [
        "step 1: mismatch SLO response: tighten-is: importance sampling tis [0.5, 2] -> tis [0.75, 1.5]; "
        "bf16-kv-cache: the generators' KV cache from FP8 (E4M3) to BF16 (from step 2)",
        "step 2: mismatch SLO response: bf16-generation: recipe fp8-gen -> bf16 (from step 3)",
    ]
    assert watch(tmp_path)[0].adopt(None) == Actions()

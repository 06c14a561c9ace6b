"""The mismatch SLO's precision actions (rljob.precision_actions): the ladder's order, what each
action makes of the spec (hand-worked numbers), what is passed over, undoing, and the state a
checkpoint keeps."""

from __future__ import annotations

from typing import Any

import pytest

from rljob import parse_spec
from rljob.precision_actions import LADDER, Actions, effective, next_action, take, undo
from rljob.spec import JobSpec
from tests import helpers


def spec_of(recipe: str = "fp8-gen", kv: bool = True, **precision: Any) -> JobSpec:
    slo = {"action": "respond", "action_layers": 2}
    return parse_spec(
        helpers.tiny_spec(precision={"recipe": recipe, "fp8_kv_cache": kv, "mismatch_slo": slo, **precision})
    )


def climb(spec: JobSpec, worst: list[int]) -> list[list[str]]:
    """The actions each breach takes (a breach after every step) until the ladder is spent."""
    actions, seen = Actions(), list[list[str]]()
    for step in range(1, 10):
        taken = take(spec, actions, step, worst)
        if taken is None:
            return seen
        seen.append(list(taken[0].taken[len(actions.taken) :]))
        actions = taken[0]
        assert actions.since == step
    raise AssertionError("the ladder never ended")


def test_the_ladder_runs_in_its_order_and_passes_over_what_does_not_apply() -> None:
    # tighten-is changes no engine: the first breach takes it with the next action
    ladder = [["tighten-is", "bf16-layers"], ["bf16-kv-cache"], ["bf16-generation"]]
    assert climb(spec_of(), [3, 1, 0]) == ladder
    assert climb(spec_of(kv=False), [3, 1, 0]) == [["tighten-is", "bf16-layers"], ["bf16-generation"]]
    # no attribution (vLLM or Megatron engines): no layers to choose
    assert climb(spec_of(), []) == [["tighten-is", "bf16-kv-cache"], ["bf16-generation"]]
    # nothing after it applies: tightening alone
    assert climb(spec_of("bf16", kv=False), [3]) == [["tighten-is"]]
    assert [a for breach in climb(spec_of(), [3]) for a in breach] == list(LADDER)


def test_a_breach_takes_actions_per_breach_engine_actions_in_the_ladders_order() -> None:
    """With 2, the first breach takes tighten-is (uncounted) and two engine actions; the next
    takes what is left; the ladder's end stops it early."""

    def with_n(n: int, **kw: Any) -> JobSpec:
        slo = {"action": "respond", "action_layers": 2, "actions_per_breach": n}
        return parse_spec(helpers.tiny_spec(precision={"recipe": "fp8-gen", "mismatch_slo": slo, **kw}))

    two = with_n(2, fp8_kv_cache=True)
    assert climb(two, [3, 1, 0]) == [["tighten-is", "bf16-layers", "bf16-kv-cache"], ["bf16-generation"]]
    assert climb(with_n(3, fp8_kv_cache=True), [3, 1, 0]) == [list(LADDER)]
    assert climb(with_n(2, fp8_kv_cache=False), [3]) == [["tighten-is", "bf16-layers", "bf16-generation"]]
    after, what = take(two, Actions(), 1, [7, 4, 1]) or (None, "")
    assert after == Actions(("tighten-is", "bf16-layers", "bf16-kv-cache"), (7, 4), 1)
    assert what.endswith("; bf16-kv-cache: the generators' KV cache from FP8 (E4M3) to BF16")
    with pytest.raises(ValueError, match=r"mismatch_slo\.actions_per_breach"):
        with_n(4)


def test_the_first_breach_says_both_of_its_actions() -> None:
    after, what = take(spec_of(), Actions(), 2, [7, 4, 1]) or (None, "")
    assert after == Actions(("tighten-is", "bf16-layers"), (7, 4), 2)
    assert what == (
        "tighten-is: importance sampling tis [0.5, 2] -> tis [0.75, 1.5]; "
        "bf16-layers: decoder layers [4, 7] to BF16 in both engines"
    )


def test_each_action_changes_the_spec_as_worked_by_hand() -> None:
    spec = spec_of(keep_bf16_layers=(0, 0), bf16_layers=(5,))
    isc = spec.algorithm.importance_sampling
    assert (isc.mode, isc.low, isc.high) == ("tis", 0.5, 2.0)  # the defaults
    tightened = effective(spec, Actions(("tighten-is",)))
    isc = tightened.algorithm.importance_sampling
    assert (isc.mode, isc.low, isc.high) == ("tis", 0.75, 1.5)  # half the distance to 1
    assert tightened.precision == spec.precision

    layers = effective(spec, Actions(("tighten-is", "bf16-layers"), (3, 1)))
    assert layers.precision.bf16_layers == (1, 3, 5)  # the job's own layer stays
    assert layers.precision.fp8_kv_cache and layers.precision.recipe == "fp8-gen"

    kv = effective(spec, Actions(("tighten-is", "bf16-kv-cache")))
    assert not kv.precision.fp8_kv_cache and kv.precision.recipe == "fp8-gen"
    gen = effective(spec, Actions(("tighten-is", "bf16-kv-cache", "bf16-generation")))
    assert gen.precision.recipe == "bf16" and not gen.precision.fp8_kv_cache
    assert effective(spec, Actions()) is spec


def test_tightening_gives_truncated_is_to_a_job_without_it() -> None:
    spec = parse_spec(helpers.tiny_spec(algorithm={"importance_sampling": {"mode": "none", "high": 3.0}}))
    isc = effective(spec, Actions(("tighten-is",))).algorithm.importance_sampling
    assert (isc.mode, isc.high) == ("tis", 3.0)
    icepop = {"importance_sampling": {"mode": "icepop", "low": 0.2, "high": 5.0}}
    mask = parse_spec(helpers.tiny_spec(algorithm=icepop))
    isc = effective(mask, Actions(("tighten-is",))).algorithm.importance_sampling
    assert (isc.mode, isc.low, isc.high) == ("icepop", 0.6, 3.0)


def test_the_worst_layers_are_taken_up_to_action_layers() -> None:
    spec = spec_of()
    after, what = take(spec, Actions(("tighten-is",), (), 4), 7, [6, 2, 9, 0]) or (None, "")
    assert after == Actions(("tighten-is", "bf16-layers"), (6, 2), 7)
    assert what == "bf16-layers: decoder layers [2, 6] to BF16 in both engines"
    assert next_action(spec, after, [6, 2]) == "bf16-kv-cache"


def test_without_action_layers_half_of_the_layers_are_taken() -> None:
    """Unset, ``action_layers`` is half of the model's decoder layers, rounded up: the attribution
    ranks all of them, so 5 ranked layers give the worst 3, 30 give the worst 15."""
    spec = parse_spec(
        helpers.tiny_spec(precision={"recipe": "fp8-gen", "mismatch_slo": {"action": "respond"}})
    )
    assert spec.precision.mismatch_slo.action_layers is None
    after, _ = take(spec, Actions(("tighten-is",), (), 4), 7, [4, 1, 3, 0, 2]) or (None, "")
    assert after is not None and after.layers == (4, 1, 3)
    worst = list(range(29, -1, -1))  # 30 layers, the last worst
    after, what = take(spec, Actions(("tighten-is",), (), 4), 7, worst) or (None, "")
    assert after is not None and after.layers == tuple(range(29, 14, -1))
    assert what == f"bf16-layers: decoder layers {list(range(15, 30))} to BF16 in both engines"


def test_layers_already_in_bf16_are_passed_over() -> None:
    """The attribution ranks every decoder layer, the BF16 ones too (the divergence they pass on
    grows there); the action moves ``action_layers`` layers that are still FP8. 10 layers, the
    first and last kept (``keep_bf16_layers: [1, 1]``) and layer 5 named: of the ranking
    0, 9, 5, 3, 7, ... the two worst still FP8 are 3 and 7."""
    spec = spec_of(keep_bf16_layers=[1, 1], bf16_layers=[5])
    worst = [0, 9, 5, 3, 7, 1, 2, 4, 6, 8]
    after, what = take(spec, Actions(), 4, worst) or (None, "")
    assert after == Actions(("tighten-is", "bf16-layers"), (3, 7), 4)
    assert what.endswith("bf16-layers: decoder layers [3, 7] to BF16 in both engines")
    assert effective(spec, after).precision.bf16_layers == (3, 5, 7)


def test_bf16_layers_is_passed_over_when_no_layer_is_left_in_fp8() -> None:
    """4 layers: the ends keep 0 and 3, ``bf16_layers`` names 1 and 2, so no layer is FP8 and the
    breach goes on to the KV cache."""
    spec = spec_of(keep_bf16_layers=[1, 1], bf16_layers=[1, 2])
    assert next_action(spec, Actions(("tighten-is",)), [2, 0, 1, 3]) == "bf16-kv-cache"
    assert spec.precision.bf16_decoder_layers(4) == {0, 1, 2, 3}
    assert spec.precision.bf16_decoder_layers(2) == {0, 1}  # counts past the model are clipped
    assert spec_of().precision.bf16_decoder_layers(4) == set()


@pytest.mark.parametrize("bad", [0, -3, 129, 10**9, "half", 2.5])
def test_action_layers_out_of_its_range_is_refused_with_its_field(bad: Any) -> None:
    slo = {"action": "respond", "action_layers": bad}
    with pytest.raises(ValueError, match=r"mismatch_slo\.action_layers"):
        parse_spec(helpers.tiny_spec(precision={"recipe": "fp8-gen", "mismatch_slo": slo}))


def test_undo_takes_back_the_last_action_only() -> None:
    spec = spec_of()
    actions = Actions(("tighten-is", "bf16-layers", "bf16-kv-cache"), (4,), 9)
    back, what = undo(spec, actions, 20) or (None, "")
    assert back == Actions(("tighten-is", "bf16-layers"), (4,), 20)
    assert what == "undone: bf16-kv-cache: the generators' KV cache from FP8 (E4M3) to BF16"
    assert effective(spec, back).precision.fp8_kv_cache
    back2, what2 = undo(spec, back, 21) or (None, "")
    assert back2 == Actions(("tighten-is",), (), 21) and "[4]" in what2
    assert undo(spec, Actions(), 3) is None


def test_the_checkpointed_state_reads_back_and_refuses_what_no_ladder_makes() -> None:
    actions = Actions(("tighten-is", "bf16-layers"), (2, 0), 12)
    assert Actions.from_json(actions.to_json()) == actions
    assert Actions.from_json(None) == Actions()
    with pytest.raises(ValueError, match="each once"):
        Actions.from_json({"taken": ["tighten-is", "tighten-is"]})
    with pytest.raises(ValueError, match="not a subset"):
        Actions.from_json({"taken": ["fp4-everything"]})


def test_bf16_layers_is_bounded_and_checked() -> None:
    with pytest.raises(ValueError, match="names a layer twice"):
        parse_spec(helpers.tiny_spec(precision={"bf16_layers": [1, 1]}))
    with pytest.raises(ValueError, match="bf16_layers"):
        parse_spec(helpers.tiny_spec(precision={"bf16_layers": [128]}))
    megatron = {"trainer_engine": "megatron", "gpus_per_trainer": 1}
    with pytest.raises(ValueError, match="Megatron keeps only the first and last"):
        parse_spec(helpers.tiny_spec(precision={"bf16_layers": [0]}, resources=megatron))

"""The one rule of which decoder layers an FP8 engine keeps in BF16 (:func:`rljob.spec.bf16_layer_reason`),
on hand-worked cases; that the engines follow it: tests/workers/engines/vllm/test_config.py."""

from __future__ import annotations

import pytest

from rljob.spec import PrecisionSpec, bf16_layer_reason


@pytest.mark.parametrize(
    ("keep", "named", "bf16"),
    [
        # 6 layers, 0-5, worked by hand
        ((0, 0), (), set()),
        ((1, 0), (), {0}),
        ((0, 2), (), {4, 5}),
        ((1, 1), (3,), {0, 3, 5}),
        ((2, 2), (1, 4), {0, 1, 4, 5}),  # named layers that are already ends: counted once
        ((4, 4), (), {0, 1, 2, 3, 4, 5}),  # the ends overlap
        ((0, 9), (), {0, 1, 2, 3, 4, 5}),  # a count past the model keeps every layer
    ],
)
def test_the_layers_kept_in_bf16(keep: tuple[int, int], named: tuple[int, ...], bf16: set[int]) -> None:
    assert {i for i in range(6) if bf16_layer_reason(i, 6, keep, named)} == bf16
    assert PrecisionSpec(keep_bf16_layers=keep, bf16_layers=named).bf16_decoder_layers(6) == bf16


def test_each_reason_names_the_field_that_keeps_the_layer() -> None:
    assert bf16_layer_reason(0, 6, (1, 1), (3,)) == (
        "decoder layer 0 is among the first 1 kept in BF16 (keep_bf16_layers)"
    )
    assert bf16_layer_reason(5, 6, (1, 1), (3,)) == (
        "decoder layer 5 is among the last 1 kept in BF16 (keep_bf16_layers)"
    )
    assert bf16_layer_reason(3, 6, (1, 1), (3,)) == "decoder layer 3 is named in bf16_layers"
    assert bf16_layer_reason(2, 6, (1, 1), (3,)) is None
    # an end wins over a name: the reason a user reads is the count that would keep it anyway
    assert "first 1" in (bf16_layer_reason(0, 6, (1, 0), (0,)) or "")

"""The CUDA stand-ins Megatron-Core gets on a CPU trainer: what they answer inside, and that
nothing is left changed outside. Pure torch: no Megatron needed."""

from __future__ import annotations

import pytest
import torch

from workers.engines.megatron import without_cuda

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the stand-ins are for machines without CUDA"
)


def test_inside_cuda_calls_are_answered_on_the_cpu() -> None:
    original = torch.cuda.current_device
    cpu_float = torch.ones(2)
    with without_cuda.cuda_calls_on_cpu():
        assert str(torch.cuda.current_device()) == "cpu"
        made = torch.zeros(3, dtype=torch.int, device="cuda")  # as optimizer/clip_grads.py:103
        assert made.device.type == "cpu" and made.dtype == torch.int32 and not made.any()
        on_current = torch.empty(2, device=torch.cuda.current_device())  # as utils.py:631
        assert on_current.device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert cpu_float.cuda() is cpu_float  # as language_module.py:244
        assert cpu_float.type() == "torch.cuda.FloatTensor"  # as optimizer/optimizer.py:690
        assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert cpu_float.type(torch.float64).dtype == torch.float64  # a conversion is left alone
    assert torch.cuda.current_device is original
    assert cpu_float.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):  # torch without CUDA, as before
        torch.zeros(1, device="cuda")


def test_everything_is_restored_after_an_error() -> None:
    original = torch.cuda.current_device
    with pytest.raises(ValueError, match="inside"), without_cuda.cuda_calls_on_cpu():
        raise ValueError("inside")
    assert torch.cuda.current_device is original and torch.ones(1).type() == "torch.FloatTensor"


def test_the_causal_mask_by_hand() -> None:
    # True where a query (row) must not see a key (column): the keys after it
    expected = [[False, True, True], [False, False, True], [False, False, False]]
    mask = without_cuda.causal_mask(3, torch.device("cpu"))
    assert mask.shape == (1, 1, 3, 3) and mask[0, 0].tolist() == expected


def test_megatron_calls_wraps_only_cpu_trainers() -> None:
    original = torch.cuda.current_device
    with without_cuda.megatron_calls(torch.device("cuda", 0)):
        assert torch.cuda.current_device is original
    with without_cuda.megatron_calls(torch.device("cpu")):
        assert str(torch.cuda.current_device()) == "cpu"

"""The trainer's CUDA hot loop, run on a CPU with fake CUDA tensors (tests/workers/fake_cuda.py):
no host sync, and the kernels it launches, counted against a count worked out by hand.

The meta tests (test_cuda_contract.py) cannot reach these paths: a ``meta`` tensor is not
``is_cuda``, so the Triton dual quantizer, its padded layouts and the fused q/k/v and gate/up
groups only run on a GPU. Here they run with every torch operator's meta implementation (cuBLAS's
layout checks in ``F.scaled_mm`` included) and Triton's launches recorded, not run.

The shapes are the 1B preset's (hidden 2048, MLP 8192, 16/8 heads of 128) with two layers: a
layer has seven projections, of which an fp8-e2e trainer runs four GEMMs (q/k/v fused, o_proj,
gate/up fused, down_proj); lm_head stays BF16. The H200 profile of 2026-11-29 counted 1024 dual
quantizer calls in a 16-layer step of 8 micro-batches, forward and backward: 4 per layer and pass.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.common import MODELS
from rljob import parse_spec
from tests.workers.fake_cuda import CUDA, Launches, added, build_on_fake_cuda, fake_cuda
from workers.engines.protocols import Rollouts
from workers.fp8 import Fp8Linear, simulate
from workers.fp8.fused import TrainFusedGroup
from workers.fp8.linear_gemm import train_backward, train_forward

LAYERS = 2
PROJECTIONS = 7  # q, k, v, o, gate, up, down
FP8_GEMMS = 4  # q/k/v, o, gate/up, down
VOCAB = 32768
# Fp8Linear's weight key reads the weight's data pointer, which a fake tensor warns about (it has
# none; the key still changes with the version counter and the object)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


def trainer_on_fake_cuda(
    monkeypatch: pytest.MonkeyPatch, mode: FakeTensorMode, recipe: str, layers: int = LAYERS
) -> Any:
    """A NativeTrainer for ``recipe`` whose model lives on the fake CUDA device."""
    from workers.engines.native import trainer
    from workers.engines.native.trainer import NativeTrainer

    build_on_fake_cuda(monkeypatch, mode, trainer)
    shape = {**MODELS["1b"], "num_layers": layers, "max_position_embeddings": 256}
    spec = parse_spec({"model": {"tiny": shape}, "precision": {"recipe": recipe}})
    return NativeTrainer(spec, VOCAB, "cuda")


def micro_batch(sequences: int = 8, prompt: int = 16, response: int = 64) -> Rollouts:
    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (sequences, n), device=CUDA)

    ones = torch.ones(sequences, response, device=CUDA)
    return Rollouts(
        ids(prompt), torch.ones(sequences, prompt, dtype=torch.long, device=CUDA), ids(response), ones, ones
    )


def forward_launches(monkeypatch: pytest.MonkeyPatch, recipe: str, layers: int = LAYERS) -> Launches:
    """The kernels of the training forward of one micro-batch (the second: the first binds the
    GEMMs and quantizes the weights)."""
    from workers.engines.native.trainer import sequence_logprobs

    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        trainer = trainer_on_fake_cuda(monkeypatch, mode, recipe, layers)
        batch = micro_batch()
        sequence_logprobs(trainer.model, batch, 1.0)
        launches.clear()
        with launches:
            logp = sequence_logprobs(trainer.model, batch, 1.0)
        assert logp.is_cuda and logp.shape == (8, 64)
        assert len(trainer.model.model.layers) == layers
    return launches


def test_the_training_forward_on_cuda_reads_nothing_back_and_swaps_each_bf16_gemm_for_one_fp8_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16: one ``mm`` per projection and lm_head, and a BF16 copy of each float32 master weight
    (the forward's compute parameters). fp8-e2e: per FP8 GEMM one Triton dual quantizer (x and
    x.T in one read) and one cuBLAS ``_scaled_mm_v2``, no BF16 copy of an FP8 layer's weight, the
    BF16 lm_head's ``mm``; every other kernel the same, one for one. Neither reads anything back
    (a host read cannot run on fake tensors)."""
    bf16 = forward_launches(monkeypatch, "bf16")
    fp8 = forward_launches(monkeypatch, "fp8-e2e")
    assert bf16.triton == {} and bf16.aten["_scaled_mm_v2"] == 0
    assert bf16.aten["mm"] == LAYERS * PROJECTIONS + 1
    assert fp8.triton == {"_quantize_1x128_dual": LAYERS * FP8_GEMMS}
    assert fp8.aten["_scaled_mm_v2"] == LAYERS * FP8_GEMMS and fp8.aten["mm"] == 1
    assert bf16.aten["_to_copy"] - fp8.aten["_to_copy"] == LAYERS * PROJECTIONS
    others = {"mm", "_scaled_mm_v2", "_to_copy"}
    assert {k: v for k, v in bf16.aten.items() if k not in others} == {
        k: v for k, v in fp8.aten.items() if k not in others
    }
    # so fp8-e2e launches fewer kernels than bf16: the GPU's idle time in its step (221 ms on
    # 2026-11-29) is the host's cost per launch (Triton's, cuBLAS's), not more launches
    assert fp8.total == bf16.total - LAYERS * (2 * PROJECTIONS - 2 * FP8_GEMMS)


def test_the_split_dual_pass_takes_the_dual_kernels_place_one_launch_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``FP8RL_DUAL_QUANT=split``: every dual quantizer of the training forward, and of a
    linear's backward (dy), is one launch of the split pass instead; nothing else changes. An
    unknown value is refused, naming the variable and its values."""
    fp8 = forward_launches(monkeypatch, "fp8-e2e")
    monkeypatch.setenv("FP8RL_DUAL_QUANT", "split")
    split = forward_launches(monkeypatch, "fp8-e2e")
    assert split.triton == {"_quantize_1x128_split": LAYERS * FP8_GEMMS}
    assert split.aten == fp8.aten
    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        trainer = trainer_on_fake_cuda(monkeypatch, mode, "fp8-e2e")
        o_proj = trainer.model.model.layers[0].self_attn.o_proj
        x = torch.randn(1000, 2048, device=CUDA, dtype=torch.bfloat16)
        ctx = types.SimpleNamespace()
        train_forward(ctx, x, o_proj, None, True, torch.float32)
        with launches:
            train_backward(ctx, torch.randn(1000, 2048, device=CUDA, dtype=torch.bfloat16), True, True, False)
        assert launches.triton == {"_quantize_1x128_split": 1}
        monkeypatch.setenv("FP8RL_DUAL_QUANT", "fast")
        with pytest.raises(ValueError, match=r"FP8RL_DUAL_QUANT='fast': use fp8 \(default\), f32, split"):
            train_forward(types.SimpleNamespace(), x + 1, o_proj, None, True, torch.float32)


# One decoder layer's training forward with Hugging Face's Llama and the default switches, worked
# out by hand from its code: each RMSNorm (2) casts to float32, squares, averages, adds eps, takes
# rsqrt, scales, casts back and multiplies by its weight; RoPE of q and of k is x*cos +
# rotate_half(x)*sin, rotate_half a neg and a cat; two residual adds; the MLP's SiLU and product;
# SDPA (one kernel), with repeat_kv's copies of K and V and the output's contiguous copy; the FP8
# GEMMs (q/k/v, o, gate/up, down) each with its dual quantizer; the BF16 copies of the two norms'
# float32 master weights (the FP8 layers read their FP8 weights). No KV cache.
FP8_LAYER_FORWARD = {
    "_to_copy": 2 * 2 + 2,
    "pow": 2,
    "mean": 2,
    "rsqrt": 2,
    "mul": 2 * 2 + 2 * 2 + 1,
    "add": 2 + 2 * 1 + 2,
    "neg": 2,
    "cat": 2,
    "silu": 1,
    "scaled_dot_product_attention": 1,
    "clone": 2 + 1,
    "_scaled_mm_v2": FP8_GEMMS,
    "_quantize_1x128_dual": FP8_GEMMS,
}


def test_a_layer_of_the_training_forward_launches_what_its_code_says_and_keeps_no_kv_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer's share of the fp8-e2e training forward (three layers' launches less two layers')
    is the hand count above: in particular no copy of K and V into a cache nobody reads."""
    counts = []
    for layers in (2, 3):
        launches = forward_launches(monkeypatch, "fp8-e2e", layers)
        counts.append(Counter(launches.aten) + Counter(launches.triton))
    assert added(counts[0], counts[1]) == FP8_LAYER_FORWARD


@pytest.mark.parametrize("wgrad", ["cublas", "triton"])
def test_a_training_linears_backward_on_cuda_quantizes_dy_once_and_runs_dgrad_and_wgrad(
    monkeypatch: pytest.MonkeyPatch, wgrad: str
) -> None:
    """The backward of a fused group (q/k/v) and of a lone FP8 layer (o_proj), 1000 tokens (x.T
    and dy.T padded to 1024 for cuBLAS): one dual quantizer of dy, then dgrad and wgrad as
    cuBLAS blockwise GEMMs, or wgrad as the Triton kernel with ``FP8RL_WGRAD_GEMM=triton``;
    nothing else (the first backward after a weight update also binds dgrad's GEMM), and no host
    read."""
    monkeypatch.setenv("FP8RL_WGRAD_GEMM", wgrad)
    with simulate("sm90-cuda13.0"), fake_cuda(monkeypatch) as (mode, launches):
        trainer = trainer_on_fake_cuda(monkeypatch, mode, "fp8-e2e")
        attention = trainer.model.model.layers[0].self_attn
        group, member = attention.q_proj.fused_train
        assert isinstance(group, TrainFusedGroup) and member == 0 and isinstance(attention.o_proj, Fp8Linear)
        # q/k/v: 2048 + 2 x 1024 outputs (16 query and 8 KV heads of 128); o_proj: 2048
        for owner, n in ((group, 4096), (attention.o_proj, 2048)):
            x = torch.randn(1000, 2048, device=CUDA, dtype=torch.bfloat16)
            grad_y = torch.randn(1000, n, device=CUDA, dtype=torch.bfloat16)
            for first in (True, False):
                ctx = types.SimpleNamespace()
                train_forward(ctx, x, owner, None, True, torch.float32)
                assert ctx.x_t.shape == (2048, 1024)  # tokens padded for the wgrad GEMM
                launches.clear()
                with launches:
                    grad_x, grad_w, grad_b = train_backward(ctx, grad_y, True, True, False)
                assert grad_x is not None and grad_x.shape == (1000, 2048) and grad_x.dtype == torch.bfloat16
                assert grad_w is not None and grad_w.shape == (n, 2048) and grad_w.dtype == torch.float32
                assert grad_b is None
                # the first backward after a weight update binds dgrad's GEMM: the weight's
                # column-major copy and its scales laid out for cuBLAS, once
                binding = {"clone": 2} if first else {}
                if wgrad == "cublas":
                    assert launches.triton == {"_quantize_1x128_dual": 1}
                    assert launches.aten == {"_scaled_mm_v2": 2, **binding}, launches.aten
                else:
                    assert launches.triton == {"_quantize_1x128_dual": 1, "_wgrad_kernel": 1}, launches.triton
                    assert launches.aten == {"_scaled_mm_v2": 1, **binding}, launches.aten


def test_the_counter_sees_a_host_read_and_a_blocking_copy_and_counts_no_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The harness itself: ``.item()`` and a blocking ``.cpu()`` of a fake CUDA tensor fail, a
    non-blocking copy does not; views and empty allocations launch nothing; a reshape that must
    copy (of a transposed tensor), an in-place add and a Triton launch count one each."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from tests.workers.fake_cuda import HostCopyError
    from workers.fp8.triton_quant import quantize_1x128

    with fake_cuda(monkeypatch) as (_, launches):
        x = torch.randn(256, 256, device=CUDA, dtype=torch.bfloat16)
        with launches:
            with pytest.raises(DataDependentOutputException):
                x.sum().item()
            with pytest.raises(HostCopyError):
                x.cpu()
            with pytest.raises(HostCopyError):
                torch.empty(256, 256, dtype=torch.bfloat16).copy_(x)
            x.to("cpu", non_blocking=True)
        launches.clear()
        with launches:
            y = x.t().reshape(-1)[:10]
            torch.empty_like(x)
            x.add_(1)
            quantize_1x128(x, "e4m3", 448.0, torch.float8_e4m3fn, False, None, 256)
        assert y.shape == (10,)
        assert launches.aten == {"add_": 1, "clone": 1} and launches.triton == {"_quantize_1x128": 1}

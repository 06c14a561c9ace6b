"""The chunked log-softmax of workers/engines/logprobs.py against the one-piece form and float64."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workers.engines.logprobs import rows_per_chunk, token_logprobs


def one_piece(logits: torch.Tensor, tokens: torch.Tensor, t: float) -> torch.Tensor:
    """What the trainer computed before: every logit upcast, log-softmaxed, gathered."""
    return torch.log_softmax(logits.float() / t, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def case(dtype: torch.dtype, b: int = 3, length: int = 7, v: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(b, length, v, generator=g) * 4).to(dtype)  # [B, L, V]
    tokens = torch.randint(0, v, (b, length), generator=g)  # [B, L]
    return logits, tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 5, 21, 1000])  # 21 rows in all: ragged last blocks, one block
def test_forward_is_the_one_piece_log_softmax_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    logits, tokens = case(dtype)
    for t in (1.0, 0.7):
        assert torch.equal(token_logprobs(logits, tokens, t, rows), one_piece(logits, tokens, t))


def test_values_and_gradient_against_float64() -> None:
    """Float32 logits: log p within float32 rounding of float64 (relative 2^-23 of |log p| up
    to ~20 here), and the gradient
    (onehot - softmax) * g / T likewise, for an arbitrary upstream gradient g."""
    logits, tokens = case(torch.float32)
    g = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_(True)
    (token_logprobs(x, tokens, 0.7, rows=4) * g).sum().backward()
    ref = logits.double().requires_grad_(True)
    want = torch.log_softmax(ref / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (want * g.double()).sum().backward()
    torch.testing.assert_close(
        token_logprobs(logits, tokens, 0.7, 4).double(), want.detach(), rtol=1e-6, atol=1e-6
    )
    assert x.grad is not None and ref.grad is not None
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=0, atol=2e-6)


def test_bf16_gradient_is_the_one_piece_gradient() -> None:
    """BF16 logits (the trainer's): the gradient reaching the logits, rounded to BF16 as the
    one-piece form's upcast rounds it, is the one-piece form's."""
    logits, tokens = case(torch.bfloat16)
    g = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(2))
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    (token_logprobs(a, tokens, 1.0, rows=4) * g).sum().backward()
    (one_piece(b, tokens, 1.0) * g).sum().backward()
    assert a.grad is not None and b.grad is not None and a.grad.dtype == torch.bfloat16
    assert torch.equal(a.grad, b.grad)


class _Float32Sizes(TorchDispatchMode):
    """The element counts of every float32 tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.sizes.append(t.numel())
        return out


def test_no_float32_tensor_of_every_logit_forward_or_backward() -> None:
    """The point of the chunking: forward and backward make float32 tensors of at most one block
    (here 4 rows of V), never [B, L, V]; the one-piece form does (the check can fail)."""
    b, length, v = 3, 7, 50
    logits, tokens = case(torch.bfloat16, b, length, v)
    for fn, biggest in (
        (lambda x: token_logprobs(x, tokens, 1.0, 4), 4 * v),
        (lambda x: one_piece(x, tokens, 1.0), b * length * v),
    ):
        x = logits.clone().requires_grad_(True)
        with _Float32Sizes() as seen:
            fn(x).sum().backward()
        assert max(seen.sizes) == biggest


def test_block_size_and_bad_input() -> None:
    assert rows_per_chunk(49_152) == 64 * 2**20 // (4 * 49_152) == 341
    assert rows_per_chunk(10**9) == 1
    logits, tokens = case(torch.float32)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(logits, tokens[:, :-1])
    with pytest.raises(ValueError, match="temperature 0"):
        token_logprobs(logits, tokens, 0.0)

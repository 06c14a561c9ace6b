"""Log-probs of chosen tokens without a float32 copy of every logit: a chunked log-softmax.

A trainer needs ``log p(token)`` at every response position, ``log_softmax(logits / T)`` gathered
at the token. Done in one piece, that holds ``[B, L, V]`` float32 twice (the upcast logits and the
log-softmax autograd keeps for its backward) beside the model's own ``[B, L, V]`` logits: at a real
vocabulary (SmolLM2: V = 49,152) and a micro-batch of 32 sequences of 128 tokens that is 1.6 GB
each, against the model's 135M parameters.

:func:`token_logprobs` computes the same numbers a row block at a time (``rows_per_chunk``,
about 64 MiB of float32 per block): each block is upcast, divided by the temperature,
log-softmaxed and gathered, and only ``[B, L]`` float32 is kept. Its backward recomputes each
block's softmax from the saved logits (which the model's output holds anyway) and writes that
block's gradient, ``(onehot(token) - softmax) * g / T``, in the logits' dtype: no ``[B, L, V]``
float32 tensor lives longer than one block.

The arithmetic per row is that of ``torch.log_softmax(logits.float() / T, -1).gather(...)``, which
works row by row, so the forward equals the one-piece form bit for bit (a test holds that), and
the generators, which take the same log-softmax of one row per sequence, agree with it as before.
"""

from __future__ import annotations

from typing import Any

import torch

# float32 bytes of one block: ~64 MiB
CHUNK_BYTES = 64 * 2**20


def rows_per_chunk(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows of ``vocab`` float32 logits in one block of at most ``chunk_bytes`` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def _block_logp(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(block.float() / T)`` of a ``[n, V]`` block, float32."""
    return torch.log_softmax(block.float() / temperature, dim=-1)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int
    ) -> torch.Tensor:
        flat, idx = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)  # [N, V], [N, 1]
        out = torch.empty(idx.shape[0], dtype=torch.float32, device=logits.device)  # [N]
        for a in range(0, flat.shape[0], rows):
            out[a : a + rows] = _block_logp(flat[a : a + rows], temperature).gather(-1, idx[a : a + rows])[
                :, 0
            ]
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.rows = temperature, rows
        return out.reshape(tokens.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, tokens = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        flat, idx = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)  # [N, V], [N, 1]
        g = grad.reshape(-1, 1).to(torch.float32)  # [N, 1]
        out = torch.empty_like(flat)  # [N, V] in the logits' dtype
        for a in range(0, flat.shape[0], rows):
            # d logp / d x = (onehot(token) - softmax(x / T)) / T, times the incoming gradient
            block = -_block_logp(flat[a : a + rows], t).exp_() * g[a : a + rows]  # [n, V]
            block.scatter_add_(-1, idx[a : a + rows], g[a : a + rows])
            out[a : a + rows] = block / t
        return out.reshape(logits.shape), None, None, None


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, rows: int | None = None
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens``, in blocks of ``rows`` rows.

    ``logits [..., V]`` (any float dtype, may require grad), ``tokens [...]`` int64. Returns
    ``[...]`` float32. ``rows`` defaults to :func:`rows_per_chunk` of the vocabulary.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree")
    if temperature <= 0:
        raise ValueError(f"temperature {temperature} must be positive (greedy log-probs are at 1.0)")
    n = rows or rows_per_chunk(logits.shape[-1])
    out: torch.Tensor = _TokenLogprobs.apply(logits, tokens, float(temperature), n)  # type: ignore[no-untyped-call]
    return out

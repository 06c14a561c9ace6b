"""A decode step's sampling in three small launches (Triton), in place of torch's ten or so
(imported only where it runs: CUDA, or the CPU under Triton's interpreter).

:func:`workers.engines.native.sampling.next_token` with ``top_p = 1`` computes, over ``[B, V]``
logits, ``log_softmax(logits.float() / T)``, its ``exp``, the exponential race ``argmax(p / E)``
with ``E ~ Exp(1)`` (or, greedy, the argmax of the log-probs), the padding of finished rows and
the chosen token's log-prob: about ten kernels, each reading and writing ``[B, V]`` in float32.
Here each row of the vocabulary is cut into ``splits`` ranges, one program each:

    1. stats   per range, online: m_r = max x, s_r = sum exp(x - m_r)      x = logit / T (IEEE)
    2. pick    m = max m_r, s = sum s_r exp(m_r - m), log_p = (x - m) - log(s)
               the range's argmax of exp(log_p) / E (IEEE division), or of log_p when greedy
    3. finish  per row: the ranges' argmax (the first of equal values, as torch's argmax), the
               pad id where the row has finished, the token's log-prob (step 2's m and log(s))

``E`` is drawn by torch (``exponential_`` on the same generator and shape as the torch path), so
the race is the same race: the choice differs from torch's only where two candidates' ``p / E``
are within a rounding of each other. ``exp``/``log`` are CUDA's (libdevice) on a GPU, linked by
Triton with subnormals flushed to zero: an ``exp`` below 2^-126 becomes 0, which no result here can
see (``s >= 1``, and such a token's ``p / E`` is never the largest). The sum of ``exp`` runs in
another order than torch's, so ``log(s)`` (and each log-prob) can be a few float32 roundings from
torch's (``sample_checks.py`` bounds it against float64).

Non-finite logits: a row holding NaN or +inf gets NaN log-probs (as torch's) and a token inside the
vocabulary; ``-inf`` logits (a masked token) have probability 0, and a row of only ``-inf`` is NaN.
``FP8RL_SAMPLING=triton`` switches it on (:func:`workers.engines.native.sampling.enabled`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from workers.fp8.dispatch import multiprocessors
from workers.fp8.triton_math import HW_BF16, expf, logf

BLOCK_V = 1024


@triton.jit
def _logits(logits_ptr, row, stride_l, cols, inside, temperature):
    x = tl.load(logits_ptr + row * stride_l + cols, mask=inside, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, temperature)  # torch's logits.float() / T: IEEE division


@triton.jit
def _range_stats(
    logits_ptr, stats_ptr, stride_l, vocab, span, splits, temperature, BLOCK: tl.constexpr, HW: tl.constexpr
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * span
    end = tl.minimum(start + span, vocab)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for off in tl.range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = _logits(logits_ptr, row, stride_l, cols, cols < end, temperature)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # exp(-inf - -inf) is NaN: a range (or a prefix of one) of only -inf adds nothing
        e = tl.where(x == float("-inf"), 0.0, expf(x - m_new, HW))
        carry = tl.where(m == float("-inf"), 0.0, expf(m - m_new, HW))
        s = s * carry + tl.sum(e, axis=0)
        m = m_new
    at = stats_ptr + (row * splits + part) * 2
    tl.store(at, m)
    tl.store(at + 1, s)


@triton.jit
def _row_lse(stats_ptr, row, splits, BLOCK_S: tl.constexpr, HW: tl.constexpr):
    """``(m, log(s))`` of a row from its ranges' stats: the same bits in every program."""
    parts = tl.arange(0, BLOCK_S)
    inside = parts < splits
    at = stats_ptr + (row * splits + parts) * 2
    m_r = tl.load(at, mask=inside, other=float("-inf"))
    s_r = tl.load(at + 1, mask=inside, other=0.0)
    m = tl.max(m_r, axis=0)
    s = tl.sum(s_r * expf(m_r - m, HW), axis=0)  # a range of only -inf: s_r = 0
    return m, logf(s, HW)


@triton.jit
def _range_pick(
    logits_ptr, noise_ptr, stats_ptr, lse_ptr, best_ptr, index_ptr, stride_l, stride_n, vocab, span,
    splits, temperature, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, GREEDY: tl.constexpr, HW: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * span
    end = tl.minimum(start + span, vocab)
    m, log_s = _row_lse(stats_ptr, row, splits, BLOCK_S, HW)
    if part == 0:  # for the token's log-prob in _finish: the bits this row's choice used
        tl.store(lse_ptr + row * 2, m)
        tl.store(lse_ptr + row * 2 + 1, log_s)
    best = tl.full((), float("-inf"), tl.float32)
    index = start
    for off in tl.range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        inside = cols < end
        log_p = (_logits(logits_ptr, row, stride_l, cols, inside, temperature) - m) - log_s
        if GREEDY:
            score = log_p
        else:
            e = tl.load(noise_ptr + row * stride_n + cols, mask=inside, other=1.0)
            score = tl.math.div_rn(expf(log_p, HW), e)
        score = tl.where(inside, score, float("-inf"))
        top, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = top > best  # strictly: an earlier block keeps a tie (torch: the first maximum)
        best = tl.where(take, top, best)
        index = tl.where(take, off + at, index)
    tl.store(best_ptr + row * splits + part, best)
    tl.store(index_ptr + row * splits + part, index)


@triton.jit
def _finish(
    logits_ptr, lse_ptr, best_ptr, index_ptr, finished_ptr, tok_ptr, logp_ptr, stride_l, splits,
    temperature, pad_id, BLOCK_S: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_S)
    inside = parts < splits
    best = tl.load(best_ptr + row * splits + parts, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * splits + parts, mask=inside, other=0)
    _, first = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tok = tl.sum(tl.where(parts == first, index, 0), axis=0)
    done = tl.load(finished_ptr + row) != 0
    tok = tl.where(done, pad_id, tok)
    m = tl.load(lse_ptr + row * 2)
    log_s = tl.load(lse_ptr + row * 2 + 1)
    x = tl.math.div_rn(tl.load(logits_ptr + row * stride_l + tok).to(tl.float32), temperature)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, (x - m) - log_s)


def default_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Ranges per row: enough programs for two per processor, each range at least one block."""
    want = -(-2 * multiprocessors(device, elsewhere=4) // max(rows, 1))  # 4: the interpreter's
    return max(1, min(want, -(-vocab // BLOCK_V)))


def sample_rows(
    logits: torch.Tensor,
    temperature: float,
    gen: torch.Generator | None,
    finished: torch.Tensor,
    pad_id: int,
    splits: int | None = None,
    block: int = BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token [B] int64, its log-prob [B] float32)`` from ``logits [B, V]`` (any float dtype,
    the last dimension contiguous): :func:`workers.engines.native.sampling.next_token` with
    ``top_p = 1`` (temperature 0: greedy, log-probs at temperature 1). ``splits``: ranges per
    row (:func:`default_splits`); ``block``: columns per step (a power of two; tests use less)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or not logits.dtype.is_floating_point:
        got = f"{logits.dtype} with strides {logits.stride()}"
        raise ValueError(f"sample_rows: float logits with contiguous rows, got {got}")
    if not 0 <= pad_id < vocab:
        raise ValueError(f"sample_rows: pad id {pad_id} is outside the vocabulary of {vocab}")
    if finished.shape != (rows,) or finished.dtype != torch.bool:
        got = f"{finished.dtype} {tuple(finished.shape)}"
        raise ValueError(f"sample_rows: finished must be bool [{rows}], got {got}")
    greedy = temperature == 0
    t = float(temperature) if not greedy else 1.0
    if greedy:
        noise = logits  # a stand-in: the greedy kernel reads no noise
    else:  # the torch path's draw: the same shape and generator, so the same Philox offsets and values
        noise = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device).exponential_(
            1, generator=gen
        )
    tok = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tok, logp
    splits = splits or default_splits(rows, vocab, logits.device)
    per_range = -(-vocab // splits)
    span = -(-per_range // block) * block  # each range whole blocks
    splits = -(-vocab // span)
    stats = torch.empty(rows, splits, 2, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, 2, dtype=torch.float32, device=logits.device)
    best = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    block_s = triton.next_power_of_2(splits)
    grid: Any = (rows, splits)
    warps = 4 if block <= 1024 else 8
    _range_stats[grid](
        logits, stats, logits.stride(0), vocab, span, splits, t, BLOCK=block, HW=HW_BF16, num_warps=warps
    )
    _range_pick[grid](
        logits, noise, stats, lse, best, index, logits.stride(0), noise.stride(0), vocab, span, splits, t,
        BLOCK=block, BLOCK_S=block_s, GREEDY=greedy, HW=HW_BF16, num_warps=warps,
    )  # fmt: skip
    _finish[(rows,)](
        logits, lse, best, index, finished, tok, logp, logits.stride(0), splits, t, pad_id,
        BLOCK_S=block_s, num_warps=1,
    )  # fmt: skip
    return tok, logp

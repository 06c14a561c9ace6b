"""Checks of the three-launch sampling (workers/engines/native/triton_sample.py) that need Triton's
interpreter, which must be switched on before Triton is imported: ``test_sampling.py`` runs this
module in a fresh interpreter with ``TRITON_INTERPRET=1``
(``python -m tests.workers.engines.native.sample_checks``)."""

from __future__ import annotations

import numpy
import torch

from tests.workers.recording import recorded
from tests.workers.switches import switched_on
from workers.engines.native.sampling import next_token

# Log-prob bound against float64: log(s) sums about 40 float32 roundings deep (a 256-wide tree,
# the blocks of a range in sequence with a rescale each, the ranges' combine, exp and log each
# within 2 ulp), each at most 2^-24 relative, so |d log s| <= 2^-18; the last subtraction adds
# half an ulp of the log-prob.
LSE_BOUND = 2.0**-18


def float64_reference(
    logits: torch.Tensor, t: float, noise: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs [B, V], scores [B, V])`` in float64 from the float32 ``logits / T`` torch
    computes (greedy: the scores are the log-probs)."""
    x = (logits.float() / (t or 1.0)).double()
    logp = x - torch.logsumexp(x, -1, keepdim=True)
    return logp, logp if noise is None else logp.exp() / noise.double()


def margin(scores: torch.Tensor) -> torch.Tensor:
    """Per row: how far apart (relative) the best two scores are in float64."""
    top = scores.topk(2, -1).values
    return (top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(1e-300)


def the_draw_is_torchs_race_on_the_same_numbers() -> None:
    """Tokens equal torch's ``next_token`` (top-p 1) from the same seed wherever float64 says the
    best two scores are more than 2^-16 apart (rows closer than that could round either way),
    and 98% of rows are that far apart; log-probs within :data:`LSE_BOUND` + half an ulp of
    float64. Temperatures 1, 0.7 and greedy; 1, 2, 3 and 8 ranges per row; a vocabulary that is
    not a multiple of the block; BF16 and float32 logits; a row stride wider than the vocabulary."""
    from workers.engines.native.triton_sample import sample_rows

    g = torch.Generator().manual_seed(11)
    b, v, block = 12, 3001, 256  # every row of the 12 is clear (>= 98%); each row-range is a program
    for dtype, scale in ((torch.bfloat16, 3.0), (torch.float32, 8.0)):
        wide = torch.randn(b, v + 40, generator=g) * scale
        logits = wide.to(dtype)[:, :v]  # row stride v + 40
        finished = torch.zeros(b, dtype=torch.bool)
        for t in (1.0, 0.7, 0.0):
            noise = (
                None
                if t == 0
                else torch.empty(b, v).exponential_(1, generator=torch.Generator().manual_seed(5))
            )
            logp64, scores = float64_reference(logits, t, noise)
            clear = margin(scores) > 2.0**-16
            assert float(clear.float().mean()) >= 0.98
            want, _ = next_token(logits, t, 1.0, torch.Generator().manual_seed(5), finished, 0)
            for splits in (1, 2, 3, 8):
                tok, logp = sample_rows(
                    logits, t, torch.Generator().manual_seed(5), finished, 0, splits, block
                )
                assert torch.equal(tok[clear], want[clear]), (dtype, t, splits)
                ref = logp64.gather(-1, tok[:, None]).squeeze(-1)
                bound = LSE_BOUND + 2.0**-24 * ref.abs()
                assert bool(((logp.double() - ref).abs() <= bound).all()), float(
                    (logp.double() - ref).abs().max()
                )


def finished_rows_take_the_pad_and_its_log_prob() -> None:
    """A finished row's token is the pad id and its log-prob the pad's (the torch path gathers it)."""
    from workers.engines.native.triton_sample import sample_rows

    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(6, 700, generator=g) * 2).bfloat16()
    finished = torch.tensor([False, True, False, True, True, False])
    pad = 613
    tok, logp = sample_rows(logits, 1.0, torch.Generator().manual_seed(1), finished, pad, 3, 128)
    logp64, _ = float64_reference(logits, 1.0, None)
    assert tok[finished].tolist() == [pad] * 3 and bool((tok[~finished] != pad).all())
    ref = logp64[:, pad][finished]
    assert bool(((logp[finished].double() - ref).abs() <= LSE_BOUND + 2.0**-24 * ref.abs()).all())


def greedy_ties_take_the_first_index() -> None:
    """Greedy, the largest logit repeated across blocks and ranges: the first index (torch's argmax)."""
    from workers.engines.native.triton_sample import sample_rows

    logits = torch.zeros(4, 1000, dtype=torch.bfloat16)
    for row, cols in enumerate(((999, 5), (640, 300, 900), (128, 127), (0, 999))):
        logits[row, list(cols)] = 4.0
    finished = torch.zeros(4, dtype=torch.bool)
    for splits in (1, 2, 3, 8):
        tok, _ = sample_rows(logits, 0.0, None, finished, 0, splits, 128)
        assert tok.tolist() == [5, 300, 127, 0], (splits, tok.tolist())


def non_finite_logits() -> None:
    """``-inf`` (a masked token) is never drawn and leaves the other log-probs finite; a whole range
    of ``-inf`` adds nothing; a row holding NaN or +inf, or only ``-inf``, gets a NaN log-prob (as
    torch's) and a token inside the vocabulary."""
    from workers.engines.native.triton_sample import sample_rows

    g = torch.Generator().manual_seed(13)
    v = 512
    logits = (torch.randn(5, v, generator=g) * 2).bfloat16()
    # 2 ranges of 4 blocks of 64: range 0 only -inf, range 1 -inf for its first block and a
    # part of its second (4 ranges of 1 block: ranges 0 and 1 only -inf, range 2 partly)
    logits[0, :330] = float("-inf")
    logits[1, 7] = float("nan")
    logits[2, 400] = float("inf")
    logits[3, :] = float("-inf")
    finished = torch.zeros(5, dtype=torch.bool)
    for t, splits, block in ((1.0, 4, 128), (0.0, 4, 128), (1.0, 2, 64), (0.0, 2, 64)):
        with numpy.errstate(invalid="ignore", divide="ignore"):  # the interpreter's NaN and log(0)
            tok, logp = sample_rows(logits, t, torch.Generator().manual_seed(2), finished, 0, splits, block)
        assert bool(((tok >= 0) & (tok < v)).all())
        assert int(tok[0]) >= 330 and bool(logp[0].isfinite())
        logp64, _ = float64_reference(logits[:1], t, None)
        assert abs(float(logp[0]) - float(logp64[0, int(tok[0])])) <= LSE_BOUND + 2.0**-24 * 10
        assert bool(logp[1:4].isnan().all()), logp.tolist()
        assert bool(logp[4].isfinite())


def the_generator_takes_it() -> None:
    """``FP8RL_SAMPLING=triton``: the generator (its eager loop and the static decoder's eager step)
    samples every decode step with the kernels (counted), drawing the tokens torch's path draws
    from the same seed, log-probs within the bound; top-p below 1 and row-exact models keep
    torch's path."""
    from tests.workers.engines.native.test_native import PROMPTS, TOK, spec_for
    from workers.engines.batching import left_pad
    from workers.engines.native import triton_sample
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.sampling import log_softmax
    from workers.engines.native.static_decode import StaticDecoder

    def generator(**precision: bool) -> NativeGenerator:
        return NativeGenerator(
            spec_for("bf16", 0, **precision), TOK.vocab_size, -1, TOK.pad_id, "cpu"
        )  # no stops

    with recorded(triton_sample, "sample_rows") as calls:
        plain_gen = generator()
        plain = plain_gen.generate(PROMPTS[:6], 8, 1.0, 1.0, 3)
        assert not plain_gen.fused_sampling and not calls
        with switched_on("FP8RL_SAMPLING"):
            gen = generator()
            fused = gen.generate(PROMPTS[:6], 8, 1.0, 1.0, 3)
            assert gen.fused_sampling and len(calls) == fused.response_ids.shape[1] == 8
            assert torch.equal(fused.response_ids, plain.response_ids)
            mask = plain.response_mask.bool()
            gap = (fused.logprobs[mask].double() - plain.logprobs[mask].double()).abs()
            assert bool((gap <= 2 * LSE_BOUND + 2.0**-23 * plain.logprobs[mask].double().abs()).all())
            gen.generate(PROMPTS[:6], 4, 1.0, 0.9, 3)  # top-p: torch's path
            assert len(calls) == 8
            static = StaticDecoder(gen.model, torch.device("cpu"), False, False, log_softmax)
            assert static.fused_sampling
            ids, attn = left_pad(PROMPTS[:6], TOK.pad_id)
            tokens, _, _ = static.generate(ids, attn, 5, 1.0, 1.0, 3, -1, TOK.pad_id)
            assert len(calls) - 8 == 5 and torch.equal(tokens, plain.response_ids[:, :5])
            assert not generator(exact=True).fused_sampling


CHECKS = (
    the_draw_is_torchs_race_on_the_same_numbers,
    finished_rows_take_the_pad_and_its_log_prob,
    greedy_ties_take_the_first_index,
    non_finite_logits,
    the_generator_takes_it,
)

if __name__ == "__main__":
    for check in CHECKS:
        check()
        print(f"ok {check.__name__}")

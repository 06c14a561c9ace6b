"""Checks of the Triton decode attention that need Triton's interpreter, which must be switched on
before Triton is imported: ``test_decode_attention.py`` runs this module in a fresh interpreter with
``TRITON_INTERPRET=1`` (``python -m tests.workers.engines.native.decode_attention_checks NAME``)."""

from __future__ import annotations

import os
import sys

import torch

from workers.engines.native import decode_attention as da


def case(b: int, hq: int, hkv: int, t: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    k = torch.randn(b, hkv, t, d, generator=g).bfloat16()
    v = torch.randn(b, hkv, t, d, generator=g).bfloat16()
    seen = torch.rand(b, t, generator=g) > 0.3  # left padding and the like
    return q, k, v, seen


def fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def kernel_matches_float64_attention() -> None:
    """GQA groups, a length inside the buffer, one or several key ranges: within BF16 rounding of
    the exact result (the output is BF16, and the probabilities are rounded to BF16 before the
    product with V, as flash attention does: 0.5% measured, bound 1%)."""
    for b, hq, hkv, t, n, splits in ((3, 4, 2, 70, 50, 1), (2, 6, 2, 96, 96, 3), (1, 2, 1, 40, 7, 2)):
        q, k, v, seen = case(b, hq, hkv, t, 32, seed=n)
        seen[:, n - 1] = True  # the query's own key
        out = da.decode_attention(q, k, v, seen, torch.tensor([n]), 32**-0.5, splits=splits)
        assert out.shape == (b, hq, 32) and out.dtype == torch.bfloat16
        err = rel(out, da.reference(q, k, v, seen, n, 32**-0.5))
        assert err < 1e-2, (b, hq, hkv, t, n, splits, err)


def fp8_cache_is_dequantized_in_registers_to_the_materialized_values() -> None:
    """E4M3 tiles times their scale, rounded to BF16, in registers: the same output, bit for bit,
    as the kernel over the BF16 cache that materialized dequantization writes."""
    q, k, v, seen = case(2, 4, 2, 64, 32, seed=1)
    seen[:, 40] = True
    ks, vs = torch.tensor(0.02), torch.tensor(0.03)
    kq, vq = fp8(k, 0.02), fp8(v, 0.03)
    length = torch.tensor([41])
    got = da.decode_attention(q, kq, vq, seen, length, 32**-0.5, ks, vs, splits=2)
    k_deq, v_deq = (kq.float() * ks).bfloat16(), (vq.float() * vs).bfloat16()
    assert torch.equal(got, da.decode_attention(q, k_deq, v_deq, seen, length, 32**-0.5, splits=2))
    assert rel(got, da.reference(q, kq, vq, seen, 41, 32**-0.5, ks, vs)) < 1e-2


def nothing_at_or_past_the_length_is_read_and_masked_keys_do_not_count() -> None:
    q, k, v, seen = case(2, 4, 2, 64, 32, seed=2)
    seen[:, 29] = True
    want = da.decode_attention(q, k, v, seen, torch.tensor([30]), 32**-0.5, splits=2)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:], v2[:, :, 30:] = float("nan"), float("nan")  # never written: must never be read
    masked = ~seen[:, None, :, None].expand_as(k2).clone()
    masked[:, :, 30:] = False
    k2[masked], v2[masked] = 1e4, -1e4  # masked keys: weight exactly 0
    assert torch.equal(da.decode_attention(q, k2, v2, seen, torch.tensor([30]), 32**-0.5, splits=2), want)


def static_decode_through_the_kernel_samples_what_the_trainer_scores() -> None:
    from tests.workers.engines.native.test_static_decode import PROMPTS, TOK, spec, static_of
    from workers.algo.mismatch import mismatch_metrics
    from workers.engines.batching import left_pad
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer
    from workers.engines.protocols import Rollouts
    from workers.weight_sync.payload import fp8_weight_names

    os.environ["FP8RL_DECODE_ATTENTION"] = "triton"
    s = spec("fp8-e2e", fp8_kv=True)
    gen = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cpu")
    trainer = NativeTrainer(s, TOK.vocab_size, "cpu")
    gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
    decoder = static_of(gen, True)
    assert decoder.kernel_attention and decoder.impl == da.ATTENTION_NAME
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    tokens, valid, logps = decoder.generate(ids, mask, 16, 1.0, 1.0, 0, -1, TOK.pad_id)
    batch = Rollouts(ids, mask, tokens, valid, logps)
    metrics = mismatch_metrics(trainer.logprobs(batch, 1.0), logps, valid)
    assert float(metrics["mismatch/token_mult_prob_error"]) < 1.02, metrics


CHECKS = {
    "arithmetic": (
        kernel_matches_float64_attention,
        fp8_cache_is_dequantized_in_registers_to_the_materialized_values,
        nothing_at_or_past_the_length_is_read_and_masked_keys_do_not_count,
    ),
    "decode": (static_decode_through_the_kernel_samples_what_the_trainer_scores,),
}

if __name__ == "__main__":
    for check in CHECKS[sys.argv[1]]:
        check()
        print(f"ok {check.__name__}")

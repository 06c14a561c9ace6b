"""Checks of the Triton decode attention that need Triton's interpreter, which must be switched on
before Triton is imported: ``test_decode_attention.py`` runs this module in a fresh interpreter with
``TRITON_INTERPRET=1`` (``python -m tests.workers.engines.native.decode_attention_checks NAME``)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import triton
import triton.language as tl

from tests.workers.recording import recorded
from tests.workers.switches import switched_on
from workers.engines.native import decode_attention as da
from workers.engines.native.triton_decode import _foldable


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


def trainer_error(
    trainer: Any, ids: torch.Tensor, mask: torch.Tensor, generated: tuple[torch.Tensor, ...]
) -> float:
    """token_mult_prob_error of a static decoder's ``(tokens, valid, log-probs)`` against the
    trainer's log-probs of the same tokens."""
    from workers.algo.mismatch import mismatch_metrics
    from workers.engines.protocols import Rollouts

    tokens, valid, logps = generated
    metrics = mismatch_metrics(trainer.logprobs(Rollouts(ids, mask, tokens, valid, logps), 1.0), logps, valid)
    return float(metrics["mismatch/token_mult_prob_error"])


def kernel_matches_float64_attention() -> None:
    """GQA groups, a length inside the buffer, one or several key ranges: within BF16 rounding of
    the exact result (the output is BF16, and the probabilities are rounded to BF16 before the
    product with V, as flash attention does: 0.5% measured, bound 1%)."""
    cases = [(3, 4, 2, 70, 50, 1), (2, 6, 2, 96, 96, 3), (1, 2, 1, 40, 7, 2)]
    # several tiles of 64 keys per split, the last one partly past the length; 8 splits of one tile
    cases += [(2, 8, 2, 300, 263, 2), (1, 4, 1, 520, 517, 8)]
    for b, hq, hkv, t, n, splits in cases:
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


def power_of_two_scales_leave_the_loop_with_the_same_bits() -> None:
    """Power-of-two scales (the calibrator's rule) are applied once, outside the key loop (the
    scores' and V's float32 sums scale by 2^e exactly): the output is still, bit for bit, the
    kernel's over the BF16 cache the materialized dequantization writes. Over GQA groups of 2 and
    4, lengths inside a tile, padding, 1/2/3/8 splits, and a scale too small to fold (2^-70: the
    per-element branch) or mixed with a non-power-of-two one."""
    for (b, hq, hkv, t, n, splits), (ks, vs) in (
        ((2, 4, 2, 64, 41, 1), (2.0**-6, 2.0**-5)),
        ((2, 8, 2, 96, 77, 2), (2.0**-7, 2.0**-4)),
        ((1, 8, 2, 130, 129, 3), (2.0**-6, 2.0**-6)),
        ((2, 4, 1, 100, 95, 8), (2.0**-5, 2.0**-7)),
        ((2, 4, 2, 64, 41, 2), (2.0**-70, 2.0**-70)),
        ((2, 4, 2, 64, 41, 2), (2.0**-6, 0.03)),
    ):
        q, k, v, seen = case(b, hq, hkv, t, 32, seed=n)
        seen[:, n - 1] = True
        k, v = k * ks * 64, v * vs * 64  # values in the scale's range
        kq, vq = fp8(k, ks), fp8(v, vs)
        kst, vst = torch.tensor(ks), torch.tensor(vs)
        length = torch.tensor([n])
        got = da.decode_attention(q, kq, vq, seen, length, 32**-0.5, kst, vst, splits=splits)
        k_deq, v_deq = (kq.float() * kst).bfloat16(), (vq.float() * vst).bfloat16()
        want = da.decode_attention(q, k_deq, v_deq, seen, length, 32**-0.5, splits=splits)
        assert torch.equal(got, want), (b, hq, hkv, t, n, splits, ks, vs)


@triton.jit  # type: ignore[untyped-decorator]
def _probe_foldable(s_ptr, out_ptr, N: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _foldable(tl.load(s_ptr + i)).to(tl.int32))


def only_normal_powers_of_two_are_folded() -> None:
    """Which scales leave the loop: a power of two between 2^-60 and 2^60; not a scale with
    mantissa bits, not a tiny or huge one (its products could leave float32's normal range), not
    zero or a negative (never a calibrated scale)."""
    cases = {2.0**-6: 1, 1.0: 1, 2.0**60: 1, 2.0**-60: 1, 0.03: 0, 0.75: 0, 2.0**-61: 0, 2.0**61: 0}
    cases |= {0.0: 0, -(2.0**-6): 0}
    scales = torch.tensor(list(cases) + [1.0] * (16 - len(cases)), dtype=torch.float32)
    out = torch.zeros(16, dtype=torch.int32)
    _probe_foldable[(1,)](scales, out, N=16)
    assert out[: len(cases)].tolist() == list(cases.values()), out


def one_split_writes_what_the_combine_would() -> None:
    """At one split the kernel writes the BF16 output itself (no partials, no second kernel): the
    same bits as through the combine kernel, BF16 and E4M3 caches."""
    from workers.engines.native import triton_decode

    q, k, v, seen = case(3, 8, 2, 70, 32, seed=5)
    seen[:, 49] = True
    length = torch.tensor([50])
    for kk, vv, ks, vs in ((k, v, None, None), (fp8(k, 2.0**-6), fp8(v, 2.0**-6), 2.0**-6, 2.0**-6)):
        k_scale = None if ks is None else torch.tensor(ks)
        v_scale = None if vs is None else torch.tensor(vs)
        runs = [
            triton_decode.run(
                q, kk, vv, seen, length, 32**-0.5, k_scale, v_scale, 1, da.BLOCK_N, ks is not None, direct
            )
            for direct in (True, False)
        ]
        assert torch.equal(runs[0], runs[1]), ks


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
    from workers.engines.batching import left_pad
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer
    from workers.weight_sync.payload import fp8_weight_names

    with switched_on("FP8RL_DECODE_ATTENTION"):
        s = spec("fp8-e2e", fp8_kv=True)
        gen = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cpu")
        trainer = NativeTrainer(s, TOK.vocab_size, "cpu")
        gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
        decoder = static_of(gen, True)
        assert decoder.kernel_attention and decoder.impl == da.ATTENTION_NAME
        ids, mask = left_pad(PROMPTS, TOK.pad_id)
        error = trainer_error(
            trainer, ids, mask, decoder.generate(ids, mask, 16, 1.0, 1.0, 0, -1, TOK.pad_id)
        )
    assert error < 1.02, error


def rope_write_is_hugging_faces_rope_then_the_write() -> None:
    """The fused RoPE + K/V write (workers/fp8/triton_kv.rope_write_kv) against Hugging Face's
    ``apply_rotary_pos_emb`` and the cache write: the rotated queries and a BF16 cache's K and V
    bit for bit; an E4M3 cache's bytes against torch's ``quantize_kv`` of Hugging Face's rotated K
    (and against :func:`write_kv`, the unfused kernel).
    GQA groups of 1, 3 and 4, a head_dim that is not a power of two, positions far apart (large
    angles), batch strides of a sliced projection, and nothing written outside the position."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from workers.fp8.kv_cache import quantize_kv
    from workers.fp8.triton_kv import rope_write_kv, write_kv

    g = torch.Generator().manual_seed(5)
    for b, hq, hkv, d in ((3, 6, 2, 64), (2, 4, 4, 32), (1, 12, 3, 48), (5, 8, 2, 128)):
        length, pos = 13, (7 * b) % 13
        cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
        # one fused projection, sliced: q, k and v have the batch stride of all three
        qkv = (torch.randn(b, 1, (hq + 2 * hkv) * d, generator=g) * 4).bfloat16()
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        at = torch.tensor([[3], [900], [41], [2047], [0]])[:b]
        cos, sin = LlamaRotaryEmbedding(cfg)(q, at)  # [B, 1, D] BF16
        want_q, want_k = apply_rotary_pos_emb(
            q.view(b, 1, hq, d).transpose(1, 2), k.view(b, 1, hkv, d).transpose(1, 2), cos, sin
        )  # [B, H, 1, D]
        v_heads = v.view(b, 1, hkv, d).transpose(1, 2)
        index = torch.tensor([pos])
        for store in (torch.bfloat16, torch.float8_e4m3fn):
            k_buf = torch.full((b, hkv, length, d), 0x55, dtype=torch.uint8).view(store)
            if store == torch.bfloat16:
                k_buf = torch.full((b, hkv, length, d), 0x5555, dtype=torch.int16).view(store)
            v_buf = k_buf.clone()
            k_scale, v_scale = torch.tensor(0.03), torch.tensor(2.0**-4)
            got_q = rope_write_kv(
                q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d), cos[:, 0], sin[:, 0],
                k_scale, v_scale, index, k_buf, v_buf,
            )  # fmt: skip
            assert torch.equal(got_q, want_q[:, :, 0]), (b, hq, hkv, d)
            if store == torch.bfloat16:
                want_k_bytes, want_v_bytes = want_k[:, :, 0], v_heads[:, :, 0]
            else:
                ref_k, ref_v = k_buf.clone(), v_buf.clone()
                write_kv(want_k, k_scale, index, ref_k)
                write_kv(v_heads, v_scale, index, ref_v)
                want_k_bytes, want_v_bytes = ref_k[:, :, pos], ref_v[:, :, pos]
                torch_k = quantize_kv(want_k, k_scale).data[:, :, 0]
                torch_v = quantize_kv(v_heads, v_scale).data[:, :, 0]
                assert torch.equal(want_k_bytes.view(torch.uint8), torch_k.view(torch.uint8))
                assert torch.equal(want_v_bytes.view(torch.uint8), torch_v.view(torch.uint8))
            for buf, want in ((k_buf, want_k_bytes), (v_buf, want_v_bytes)):
                raw = buf.view(torch.uint8 if store != torch.bfloat16 else torch.int16)
                assert torch.equal(raw[:, :, pos], want.view(raw.dtype)), (store, b, hq, hkv, d)
                others = torch.ones(length, dtype=torch.bool)
                others[pos] = False
                assert bool((raw[:, :, others] == (0x55 if raw.dtype == torch.uint8 else 0x5555)).all())


def static_decode_with_fused_rope_is_the_unfused_step_bit_for_bit() -> None:
    """The static decode loop with ``FP8RL_KV_WRITE=triton`` beside the Triton attention: its
    steps' RoPE and K/V write run in one launch (one per layer and step, counted), and it samples
    the same tokens with the same log-probs as the same loop with Hugging Face's RoPE and the
    separate write, bit for bit, for a BF16 and an E4M3 cache, greedy and sampled."""
    from tests.workers.engines.native.test_static_decode import PROMPTS, TOK, spec, static_of
    from workers.engines.batching import left_pad
    from workers.engines.native.generator import NativeGenerator
    from workers.fp8 import triton_kv

    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    with (
        switched_on("FP8RL_DECODE_ATTENTION", "FP8RL_KV_WRITE"),
        recorded(triton_kv, "rope_write_kv") as calls,
    ):
        for recipe, fp8_kv, temperature in (("bf16", False, 0.0), ("fp8-e2e", True, 1.0)):
            gen = NativeGenerator(spec(recipe, fp8_kv), TOK.vocab_size, -1, TOK.pad_id, "cpu")
            decoder = static_of(gen, fp8_kv)
            assert decoder.kernel_attention and decoder.fused_rope
            runs = {}
            for rope in (True, False):
                decoder.fused_rope = rope
                calls.clear()
                runs[rope] = decoder.generate(ids, mask, 6, temperature, 1.0, 3, -1, TOK.pad_id)
                steps = runs[rope][0].shape[1] - 1  # the first token comes from the prefill
                assert len(calls) == (2 * steps if rope else 0), (len(calls), steps)  # 2 layers
            for got, want in zip(runs[True], runs[False], strict=True):
                assert torch.equal(got, want), (recipe, got, want)


def every_decode_kernel_together_samples_what_the_trainer_scores() -> None:
    """An FP8 generator as a GPU builds it (q/k/v and gate/up fused) with every decode switch on:
    the Triton attention, RoPE + the K/V write in one launch, the fused SiLU·mul, the one-kernel
    RMSNorm (in the trainer too; in the generator writing q/k/v's and gate/up's input tiles, and
    taking each layer's closing add) and the three-launch sampling. Its samples' log-probs agree with
    the trainer's as the eager loop's do (the bound of the attention-only check, 1.02), and each
    kernel ran (counted)."""
    from tests.workers.engines.native.test_static_decode import PROMPTS, TOK, spec, static_of
    from workers.engines.batching import left_pad
    from workers.engines.native import triton_sample
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer
    from workers.fp8 import triton_act, triton_kv
    from workers.fp8.fused import fuse_projections, fuse_silu_mul
    from workers.weight_sync.payload import fp8_weight_names

    switches = ("FP8RL_DECODE_ATTENTION", "FP8RL_KV_WRITE", "FP8RL_RMS_NORM", "FP8RL_SAMPLING")
    with (
        switched_on(*switches),
        recorded(triton_kv, "rope_write_kv") as rope,
        recorded(triton_act, "silu_mul_rows") as silu,
        recorded(triton_sample, "sample_rows") as sample,
    ):
        s = spec("fp8-e2e", fp8_kv=True)
        gen = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cpu")
        assert fuse_projections(gen.model) >= 2 and fuse_silu_mul(gen.model) == 2  # as on a GPU
        trainer = NativeTrainer(s, TOK.vocab_size, "cpu")
        assert gen.fused_norms == trainer.fused_norms == 5  # 2 per layer and the final one, both sides
        assert gen.emitting_norms == 4  # the layers' norms write the FP8 tiles q/k/v and gate/up read
        assert gen.chained_adds == 2  # each layer's closing add inside the next norm's kernel
        gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))  # into the fused groups
        decoder = static_of(gen, True)
        assert decoder.kernel_attention and decoder.fused_rope and decoder.fused_sampling
        ids, mask = left_pad(PROMPTS, TOK.pad_id)
        error = trainer_error(
            trainer, ids, mask, decoder.generate(ids, mask, 16, 1.0, 1.0, 0, -1, TOK.pad_id)
        )
        assert len(rope) == 2 * 15 and len(silu) == 2 * 16  # 2 layers; the prefill's MLP too
        assert len(sample) == 16
        assert error < 1.02, error
        print(f"token_mult_prob_error {error:.4f}")


def fp8_amplification_not_the_kernel() -> None:
    """The GPU test's model and prompts (tests/workers/test_gpu_data_plane.py), fp8-e2e weights
    moved as after many optimizer steps, a BF16 cache: with the Triton decode attention the samples
    score token_mult_prob_error above the 1.02 of the SDPA loop (1.037 on an H200). The float64
    attention rounded once to BF16 scores as much: 1.02 is out of reach of any attention that rounds
    otherwise than the trainer's SDPA, because the E4M3 input of o_proj turns a last-bit difference
    into an E4M3 step. The kernel's excess over 1 stays within 1.25x the exact attention's (0.96-1.07x
    over ten cases: docs/engines.md), the bound the GPU test now uses; a score scale 10% off fails
    it (1.073 against 1.053)."""
    from tests.workers.engines.native.exact_attention import exact_decode_attention
    from tests.workers.engines.native.test_static_decode import static_of
    from tests.workers.test_gpu_data_plane import PROMPTS, TOK, spec
    from workers.engines.batching import left_pad
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer
    from workers.weight_sync.payload import fp8_weight_names

    with switched_on("FP8RL_DECODE_ATTENTION"):
        s = spec("fp8-e2e")
        trainer = NativeTrainer(s, TOK.vocab_size, "cpu")
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
        gen = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cpu")
        gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
        ids, mask = left_pad(PROMPTS, TOK.pad_id)

        def error() -> float:
            decoder = static_of(gen, False)
            assert decoder.kernel_attention
            return trainer_error(
                trainer, ids, mask, decoder.generate(ids, mask, 16, 1.0, 1.0, 1, -1, TOK.pad_id)
            )

        with recorded(da, "decode_attention") as calls:
            kernel = error()
        assert len(calls) == 2 * 15  # 2 layers, 15 decode steps: the kernel ran
        with exact_decode_attention(), recorded(da, "decode_attention") as calls:
            exact = error()
        assert len(calls) == 2 * 15
    print(f"token_mult_prob_error: kernel {kernel:.4f}, float64 attention rounded to BF16 {exact:.4f}")
    assert 1.02 < exact < 1.10, exact  # 1.02 is not a correct attention's; a key left out: 1.15
    assert kernel - 1 <= 1.25 * (exact - 1), (kernel, exact)


CHECKS = {
    "arithmetic": (
        kernel_matches_float64_attention,
        fp8_cache_is_dequantized_in_registers_to_the_materialized_values,
        power_of_two_scales_leave_the_loop_with_the_same_bits,
        only_normal_powers_of_two_are_folded,
        one_split_writes_what_the_combine_would,
        nothing_at_or_past_the_length_is_read_and_masked_keys_do_not_count,
    ),
    "decode": (static_decode_through_the_kernel_samples_what_the_trainer_scores,),
    "amplification": (fp8_amplification_not_the_kernel,),
    "rope": (
        rope_write_is_hugging_faces_rope_then_the_write,
        static_decode_with_fused_rope_is_the_unfused_step_bit_for_bit,
        every_decode_kernel_together_samples_what_the_trainer_scores,
    ),
}

if __name__ == "__main__":
    for check in CHECKS[sys.argv[1]]:
        check()
        print(f"ok {check.__name__}")

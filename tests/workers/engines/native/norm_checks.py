"""Checks of the one-kernel RMSNorm (workers/engines/native/rms_norm.py) that need Triton's
interpreter, which must be switched on before Triton is imported: ``test_rms_norm.py`` runs this
module in a fresh interpreter with ``TRITON_INTERPRET=1``
(``python -m tests.workers.engines.native.norm_checks``)."""

from __future__ import annotations

import os

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.workers.recording import Call, recorded
from tests.workers.switches import switched_on

EPS = 1e-5


def float64_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


def hf_norm(d: int, w: torch.Tensor) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(d, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


def kernel_is_rms_norm_within_its_two_roundings() -> None:
    """Against float64: within the two BF16 roundings (unit roundoff 2^-8 each, so 2 x 2^-8
    relative, and a float32 part far below it). Against Hugging Face's BF16 module: the same value,
    or one BF16 step away where the float32 sums of squares (another order) round apart, on a
    small share of the values. Row widths that are not a power of two (SmolLM2's 576), a strided
    input, values of five decades."""
    from workers.engines.native.triton_norm import rms_norm

    g = torch.Generator().manual_seed(3)
    for rows, d in ((7, 576), (33, 2048), (1, 128)):
        wide = torch.randn(rows, d + 64, generator=g) * torch.logspace(-2, 3, d + 64)
        x = wide.bfloat16()[:, :d]  # row stride d + 64
        w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
        _, out, rstd = rms_norm(x, w, EPS)
        want = float64_norm(x, w)
        err = (out.double() - want).abs()
        bound = (2 * 2.0**-8 + 2.0**-20) * want.abs()
        assert bool((err <= bound).all()), float((err / want.abs()).max())
        x64 = x.double()
        rstd64 = 1 / torch.sqrt(x64.pow(2).mean(-1) + EPS)
        assert float(((rstd.double() - rstd64) / rstd64).abs().max()) < 2.0**-20
        hf = hf_norm(d, w)(x)
        apart = out != hf
        step = (hf.float().abs() * 2.0**-7).clamp_min(2.0**-133)  # one BF16 step (ulp <= |v| 2^-7)
        assert bool(((out.float() - hf.float()).abs() <= step)[apart].all())
        assert float(apart.float().mean()) < 0.02, float(apart.float().mean())


def backward_is_rms_norms_gradient() -> None:
    """The backward (rstd saved, float32) against autograd of the norm in float64, for x and the
    weight: within BF16's rounding of the results (relative norm error < 1%, 0.2% seen)."""
    from workers.engines.native.rms_norm import _RmsNormFn

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 9, 576, generator=g) * 3).bfloat16().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16().requires_grad_(True)
    dout = torch.randn(2, 9, 576, generator=g).bfloat16()
    out = _RmsNormFn.apply(x, w, EPS)
    out.backward(dout)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    float64_norm(x64, w64).backward(dout.double())
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert got is not None and want is not None
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 1e-2, rel


def the_residual_add_joins_the_norm() -> None:
    """With a residual: the sum is torch's BF16 ``residual + x`` bit for bit, and the norm is the
    kernel's norm of that sum bit for bit; the backward (the sum feeding both the norm and the
    rest of the layer) is within 1% of float64 autograd for x, the residual and the weight."""
    from workers.engines.native.rms_norm import _AddRmsNormFn
    from workers.engines.native.triton_norm import rms_norm

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(2, 9, 576, generator=g) * 3).bfloat16()
    r = (torch.randn(2, 9, 576, generator=g) * 30).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    s, out, _ = rms_norm(x.view(-1, 576), w, EPS, r.view(-1, 576))
    assert torch.equal(s, (r + x).view(-1, 576))
    assert torch.equal(out, rms_norm((r + x).view(-1, 576), w, EPS)[1])
    x, r, w = (t.clone().requires_grad_(True) for t in (x, r, w))
    d_sum, d_out = (torch.randn(2, 9, 576, generator=g).bfloat16() for _ in range(2))
    total, normed = _AddRmsNormFn.apply(x, r, w, EPS)
    torch.autograd.backward((total, normed), (d_sum, d_out))
    x64, r64, w64 = (t.detach().double().requires_grad_(True) for t in (x, r, w))
    s64 = x64 + r64
    ((s64 * d_sum.double()).sum() + (float64_norm(s64, w64) * d_out.double()).sum()).backward()
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        assert got is not None and want is not None
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 1e-2, rel


def generator_and_trainer_compute_the_same_norms() -> None:
    """``FP8RL_RMS_NORM=triton``: the generator and the trainer both take the kernel (every norm of
    the two-layer model, counted on each side, each layer's add after attention inside it), and
    the trainer's log-probs are the generator's, bit for bit, as with Hugging Face's norm on both
    sides. Off, neither takes it."""
    from tests.workers.engines.native.test_native import PROMPTS, TOK, spec_for
    from workers.engines.factory import native_pair
    from workers.engines.native import triton_norm

    with switched_on("FP8RL_RMS_NORM"), recorded(triton_norm, "rms_norm") as calls:
        trainer, gen = native_pair(spec_for("bf16", 0), TOK.vocab_size, TOK.eos_id, TOK.pad_id)
        assert trainer.fused_norms == gen.fused_norms == 5  # 2 per layer, and the final one
        out = gen.generate(PROMPTS, 6, 1.0, 1.0, 0)
        assert len(calls) == 5 * 6  # the prefill and 5 decode steps (the 6th token needs no forward)
        # each layer's two adds (after attention, and closing the layer) inside the next norm's kernel
        assert gen.chained_adds == 2 and with_residual(calls) == 4 * 6
        mask = out.response_mask.bool()
        with_kernel = trainer.logprobs(out, 1.0)
        assert len(calls) == 5 * 6 + 5 * 2, len(calls)  # the trainer's 2 micro-batches (20 prompts, 16 each)
        assert with_residual(calls) == 4 * 6 + 2 * 2  # the trainer's layers add after attention in the kernel
        assert torch.equal(with_kernel[mask], out.logprobs[mask])
        os.environ["FP8RL_RMS_NORM"] = "torch"
        plain, plain_gen = native_pair(spec_for("bf16", 0), TOK.vocab_size, TOK.eos_id, TOK.pad_id)
        assert plain.fused_norms == plain_gen.fused_norms == 0
        before = len(calls)
        plain.logprobs(out, 1.0)
        assert len(calls) == before


def the_norm_writes_the_next_gemms_input_tiles() -> None:
    """``rms_norm_fp8``: the norm (and the sum) bit for bit ``rms_norm``'s, and the tiles exactly what
    torch's quantizer (``quantize`` in 1x128 tiles) makes of that output, and what the Triton
    quantizer kernel makes: bytes, scales (M-major), padding rows zeros with scale 1; E4M3 and E5M2,
    power-of-two scales, widths 576 (a half tile at the end), 2048 and 128, with and without the
    residual. A non-finite tile is folded into the guard's code as the quantizer folds it."""
    from workers.engines.native.triton_norm import rms_norm, rms_norm_fp8
    from workers.fp8.formats import get_format
    from workers.fp8.fp8_tensor import TILE_1x128
    from workers.fp8.quant import quantize
    from workers.fp8.triton_quant import quantize_1x128

    g = torch.Generator().manual_seed(8)
    cases = (
        (7, 576, "e4m3", False),
        (33, 2048, "e5m2", True),
        (16, 128, "e4m3", True),
        (5, 576, "e5m2", False),
    )
    for rows, d, name, pow2 in cases:
        fmt = get_format(name)
        rows_out = -(-rows // 16) * 16
        x = (torch.randn(rows, d, generator=g) * torch.logspace(-2, 2, d)).bfloat16()
        r = (torch.randn(rows, d, generator=g) * 4).bfloat16()
        w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
        for residual in (None, r):
            s, out, q = rms_norm_fp8(x, w, EPS, residual, fmt, pow2, rows_out, None)
            s_want, out_want, _ = rms_norm(x, w, EPS, residual)
            assert torch.equal(s, s_want) and torch.equal(out, out_want)
            assert q.data.shape == (rows_out, d) and q.scale.stride() == (1, rows_out)
            want = quantize(out, fmt, TILE_1x128, power_of_two=pow2)
            assert torch.equal(q.data[:rows].view(torch.uint8), want.data.view(torch.uint8)), (rows, d, name)
            assert torch.equal(q.scale[:rows], want.scale)
            assert not q.data[rows:].view(torch.uint8).any() and bool((q.scale[rows:] == 1).all())
            data, scale = quantize_1x128(out, fmt.name, fmt.max, fmt.dtype, pow2, None, rows_out)
            assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(
                q.scale, scale
            )
    fmt = get_format("e4m3")
    x = torch.ones(5, 576, dtype=torch.bfloat16)
    x[3, 300] = float("inf")  # row 3, tile 2 of 5: rstd = 0, so inf * 0 = NaN there, 0 elsewhere
    x[4, 10] = float("nan")  # row 4: every value NaN
    code = torch.full((), 2**63 - 1, dtype=torch.int64)
    rms_norm_fp8(x, torch.ones(576, dtype=torch.bfloat16), EPS, None, fmt, False, 16, (code, 3))
    assert int(code) == 3 * 2**32 + 3 * 5 + 2, int(code)  # the first bad tile: row 3's third


# head_dim 128, one KV head: whole 128-row blocks in every projection, so q/k/v and gate/up can
# fuse (workers/fp8/fused.py)
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1, "num_layers": 2}


def an_fp8_generator_takes_the_tiles_from_its_norms() -> None:
    """An fp8-e2e generator with ``FP8RL_RMS_NORM=triton``: each layer's two norms write the tiles
    (counted), q/k/v and gate/up quantize no input of their own (counted: only o_proj and
    down_proj do), and the tokens and log-probs are bit for bit those of the same generator with
    the norms not writing tiles: with q/k/v and gate/up apart (the CPU's layout) and fused (a
    GPU's), and with power-of-two scales."""
    from rljob import parse_spec
    from tests.workers.engines.native.test_native import PROMPTS, TOK, spec_for
    from workers.engines.native.generator import NativeGenerator
    from workers.fp8 import linear_gemm
    from workers.fp8.fused import fuse_projections

    with switched_on("FP8RL_RMS_NORM"), recorded(linear_gemm, "_quantize_rows") as quantized:
        for fused, pow2 in ((False, False), (True, False), (False, True)):
            outs = []
            for emit in (True, False):
                precision = {"recipe": "fp8-e2e", "power_of_two_scales": pow2}
                spec = parse_spec({"model": {"tiny": SHAPE}, "precision": precision})
                gen = NativeGenerator(spec, TOK.vocab_size, -1, TOK.pad_id, "cpu")
                assert gen.emitting_norms == 4  # 2 layers x (input, post-attention)
                if fused:
                    assert fuse_projections(gen.model) == 4  # q/k/v and gate/up of each layer
                if not emit:
                    for module in gen.model.modules():
                        if hasattr(module, "fp8rl_tiles_for"):
                            module.fp8rl_tiles_for = None
                quantized.clear()
                # three prompts: the interpreter runs the norm kernel once per row (prefill 3 x 18)
                outs.append(gen.generate(PROMPTS[:3], 5, 1.0, 1.0, 1))
                readers = {args[-1].split(":")[0].split(".")[-1] for args, _ in quantized}
                if emit:
                    assert readers == {"o_proj", "down_proj"}, readers
                else:
                    assert {"o_proj", "down_proj"} < readers, readers
            a, b = outs
            assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
        plain = NativeGenerator(spec_for("bf16", 0), TOK.vocab_size, -1, TOK.pad_id, "cpu")
        assert plain.fused_norms == 5 and plain.emitting_norms == 0  # no FP8 readers


def the_layer_closing_add_joins_the_next_norm() -> None:
    """A bf16 generator with the switch on chains each layer's closing add into the next norm's
    kernel (the next layer's input norm, then the final norm): each layer still returns the sum
    (hooks see the same bits as without the chain), the logits are the same bit for bit, the norm
    kernels take 4 adds per forward instead of 2 and still run 5 times (counted: no norm computed
    twice), and each carried norm output is taken once (no layer output still holds one after)."""
    from tests.workers.engines.native.test_native import PROMPTS, TOK, spec_for
    from workers.engines.batching import left_pad, positions
    from workers.engines.native import triton_norm
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.rms_norm import NEXT_NORM_ATTR, NORMED_ATTR

    with switched_on("FP8RL_RMS_NORM"), recorded(triton_norm, "rms_norm") as calls:
        ids, mask = left_pad(PROMPTS[:5], TOK.pad_id)
        runs = []
        for chain in (True, False):
            gen = NativeGenerator(spec_for("bf16", 0), TOK.vocab_size, -1, TOK.pad_id, "cpu")
            assert gen.chained_adds == 2
            layers = list(gen.model.model.layers)
            if not chain:
                for layer in layers:
                    delattr(layer, NEXT_NORM_ATTR)
            seen: list[torch.Tensor] = []
            hooks = [
                layer.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out)) for layer in layers
            ]
            calls.clear()
            with torch.no_grad():
                logits = gen.model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
            for hook in hooks:
                hook.remove()
            adds = with_residual(calls)
            assert adds == (4 if chain else 2) and len(calls) == 5, (adds, len(calls))
            assert not any(hasattr(out, NORMED_ATTR) for out in seen)
            runs.append((logits, seen))
        (a, seen_a), (b, seen_b) = runs
        assert torch.equal(a, b)
        assert all(torch.equal(x, y) for x, y in zip(seen_a, seen_b, strict=True))


def with_residual(calls: list[Call]) -> int:
    """Of the recorded ``rms_norm(x2d, weight, eps, residual)`` calls, those given a residual."""
    return sum(len(args) > 3 and args[3] is not None for args, _ in calls)


CHECKS = (
    kernel_is_rms_norm_within_its_two_roundings,
    backward_is_rms_norms_gradient,
    the_residual_add_joins_the_norm,
    generator_and_trainer_compute_the_same_norms,
    the_norm_writes_the_next_gemms_input_tiles,
    an_fp8_generator_takes_the_tiles_from_its_norms,
    the_layer_closing_add_joins_the_next_norm,
)

if __name__ == "__main__":
    for check in CHECKS:
        check()
        print(f"ok {check.__name__}")

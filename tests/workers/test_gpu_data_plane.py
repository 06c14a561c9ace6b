"""The GPU data plane on a real GPU: kernels against emulation, no host sync, FP8 memory.

Marked ``gpu``: skipped without CUDA (``make gpu-check`` runs them on a GPU machine). Their CPU
counterparts: tests/workers/fp8/test_cuda_contract.py (every kernel call CUDA accepts, on every
device profile, replayed on meta tensors) and tests/workers/engines/native/test_native.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rljob import JobSpec, parse_spec
from workers.engines.batching import left_pad
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.fp8 import Fp8Linear, simulate
from workers.models.tokenizer import ByteTokenizer
from workers.weight_sync.payload import fp8_weight_names

pytestmark = pytest.mark.gpu
TOK = ByteTokenizer()
PROMPTS = [TOK.encode(f"Calculate {a} + {b}. ") for a in range(8) for b in range(4)]


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Any operation that makes the host wait for the GPU raises inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def spec(recipe: str, **precision: object) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_layers": 2}},
            "precision": {"recipe": recipe, **precision},
            "optimizer": {"micro_batch_size": 16},
            "resources": {"gpus_per_generator": 1, "gpus_per_trainer": 1},
        }
    )


GPU_FP8_REL_TOL = 1e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("m,k,n", [(256, 1024, 512), (7, 200, 48), (130, 256, 384), (1, 4096, 1024)])
def test_fp8_linear_kernels_match_emulation(seed: int, m: int, k: int, n: int) -> None:
    layer = Fp8Linear(k, n, bias=False, device="cuda")
    x = torch.randn(m, k, device="cuda", requires_grad=True)

    def run() -> tuple[torch.Tensor, ...]:
        y = layer(x)
        y.backward(torch.ones_like(y) * 1e-2)
        assert x.grad is not None and layer.weight.grad is not None
        out = (y.detach().clone(), x.grad.clone(), layer.weight.grad.clone())
        x.grad, layer.weight.grad = None, None
        return out

    cuda = run()
    with simulate("cpu"):  # the same GPU tensors, emulated GEMMs
        emulated = run()
    print({g: p.kernel for g, p in layer.gemm_plans(m).items()})
    for got, want in zip(cuda, emulated, strict=True):
        # Hopper's FP8 tensor cores keep about 14 bits of each partial sum (DeepSeek-V3, section
        # 3.3.2; the kernel probe measures ~1.3e-4): far from float32, far below a wrong scale
        # layout or a missed block, which are O(1). Over 20 seeds on an H100: y 0.85e-4-1.26e-4
        # (margin 7.9), dx and dW equal to the emulation
        assert rel_err(got, want) < GPU_FP8_REL_TOL


def test_generate_never_waits_for_the_host() -> None:
    gen = NativeGenerator(spec("fp8-e2e", fp8_kv_cache=True), TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    ids, mask = ids.cuda(), mask.cuda()
    gen.generate_on_device(ids, mask, 4, 1.0, 0.9, 0)  # warm-up: allocator, kernels, cuBLAS handles
    with no_host_sync():
        # the guards' reads at the end are the one sync (tests/workers/engines/native/test_decode_launches.py)
        from workers.fp8 import guard

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(guard.FiniteGuard, "check", lambda self: None)
            out_ids, out_mask, logps = gen.generate_on_device(ids, mask, 16, 1.0, 0.9, 1)
    assert out_ids.shape == out_mask.shape == logps.shape and bool(out_mask[:, 0].all())


def test_train_step_never_waits_for_the_host() -> None:
    s = spec("fp8-e2e")
    trainer = NativeTrainer(s, TOK.vocab_size, "cuda")
    gen = NativeGenerator(s, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
    batch = gen.generate(PROMPTS, 8, 1.0, 1.0, 0)
    rewards = torch.rand(len(PROMPTS))
    trainer.train_step(batch, rewards, 1.0)  # warm-up
    from workers.fp8 import guard

    with no_host_sync(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(guard.FiniteGuard, "check", lambda self: None)
        logp_old, totals = trainer.train_step_on_device(batch, rewards, 1.0)
    assert logp_old.shape == batch.logprobs.shape and float(totals["grad_norm"]) > 0


def test_fp8_generator_holds_fp8_weights_only() -> None:
    gen = NativeGenerator(spec("fp8-e2e"), TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cuda")
    fp8_layers = [m for m in gen.model.modules() if isinstance(m, Fp8Linear)]
    assert fp8_layers and all(m.fp8_only and m.weight.device.type == "meta" for m in fp8_layers)
    gen.generate(PROMPTS[:4], 4, 1.0, 1.0, 0)  # no dequantization cache appears on a GPU
    # by hand: FP8 layers 1 byte/parameter + 4 bytes per 128x128 block, and cuBLAS's copy of the
    # block scales ([N/128, K/128 padded to a multiple of 4], float32); everything else BF16
    expected = 0
    for m in fp8_layers:
        n, k = m.weight.shape
        blocks_n, blocks_k = -(-n // 128), -(-k // 128)
        expected += n * k + 4 * blocks_n * blocks_k + 4 * blocks_n * (-(-blocks_k // 4) * 4)
    fp8_params = {id(m.weight) for m in fp8_layers}
    expected += sum(2 * p.numel() for p in gen.model.parameters() if id(p) not in fp8_params)
    expected += sum(b.numel() * b.element_size() for b in gen.model.buffers())
    assert gen.weight_bytes == expected


@pytest.mark.parametrize("shape", [(1, 128), (7, 200), (300, 4096), (2048, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_quantizer_is_the_torch_quantizer_bit_for_bit(
    seed: int, shape: tuple[int, int], dtype: torch.dtype, fmt: str, pow2: bool, transposed: bool
) -> None:
    from workers.fp8 import quant

    x = (torch.randn(*shape, device="cuda") * torch.rand(shape[0], 1, device="cuda") * 10).to(dtype)
    x.view(-1)[torch.randperm(x.numel(), device="cuda")[:3]] *= 1000  # outliers in a few tiles
    if transposed:  # the wgrad copies quantize transposed views
        x = x.t()
    fast = quant.quantize(x, fmt, (1, 128), power_of_two=pow2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_TRITON", False)
        ref = quant.quantize(x, fmt, (1, 128), power_of_two=pow2)
    assert torch.equal(fast.scale, ref.scale)
    assert torch.equal(fast.data.view(torch.uint8), ref.data.view(torch.uint8))


@pytest.mark.parametrize("dual", ["fp8", "f32", "split"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 200), (300, 4096), (2048, 14336)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dual_layout_quantizer_is_two_torch_quantizations_bit_for_bit(
    seed: int, shape: tuple[int, int], fmt: str, dual: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training's pass of both layouts (x along K, x.T along tokens), each way FP8RL_DUAL_QUANT
    makes it, against the torch quantizer of x and of x.T: same bytes, same scales, x's rows
    padded to 16 with zeros of scale 1."""
    from workers.fp8 import quant

    monkeypatch.setenv("FP8RL_DUAL_QUANT", dual)

    x = (torch.randn(*shape, device="cuda") * torch.rand(shape[0], 1, device="cuda") * 10).to(torch.bfloat16)
    x.view(-1)[torch.randperm(x.numel(), device="cuda")[:3]] *= 1000
    rows, cols = quant.quantize_dual(x, fmt, rows_multiple=16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_TRITON", False)
        ref_rows, ref_cols = quant.quantize(x, fmt, (1, 128)), quant.quantize(x.t(), fmt, (1, 128))
    m = shape[0]
    assert rows.shape[0] == -(-m // 16) * 16 and bool((rows.scale[m:] == 1).all())
    assert torch.equal(rows.scale[:m], ref_rows.scale) and torch.equal(cols.scale, ref_cols.scale)
    assert torch.equal(rows.data[:m].view(torch.uint8), ref_rows.data.view(torch.uint8))
    assert torch.equal(cols.data.view(torch.uint8), ref_cols.data.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 7, 16, 64])
@pytest.mark.parametrize("k_n", [(2048, 8192), (8192, 2048), (300, 256)])
def test_small_m_gemm_is_the_quantized_product(seed: int, m: int, k_n: tuple[int, int]) -> None:
    """The Triton GEMM for few tokens against float64 of the torch quantizer's bytes (bit for bit
    the kernel's on a GPU): within float32 summation, then the BF16 output's rounding."""
    from workers.fp8.quant import quantize
    from workers.fp8.triton_gemm import small_m_gemm

    k, n = k_n
    x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 10).to(torch.bfloat16)
    w = quantize(torch.randn(n, k, device="cuda") / k**0.5, "e4m3", (128, 128))
    got = small_m_gemm(x, w.data, w.scale, torch.float32, None)
    want = quantize(x, "e4m3", (1, 128)).dequantize(torch.float64) @ w.dequantize(torch.float64).t()
    assert float((got.double() - want).abs().max()) <= 2 * k * 2**-24 * float(want.abs().max())
    bf16 = small_m_gemm(x, w.data, w.scale, torch.bfloat16, None)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, got.to(torch.bfloat16))


@pytest.mark.parametrize("m_n_k", [(300, 256, 384), (4736, 2048, 8192), (4096, 14336, 4096)])
def test_wgrad_gemm_is_the_quantized_product(seed: int, m_n_k: tuple[int, int, int]) -> None:
    """The Triton wgrad GEMM against float64 of the torch quantizer's bytes (the Triton one's on a
    GPU), element by element: within float32 sums across the 128-token chunks and, inside one,
    Hopper's FP8 accumulator, taken as keeping 14 bits (DeepSeek-V3's report, section 3.3.2:
    u = 2^-13 over 128 products); a BF16 output is the float32 one rounded to nearest."""
    from workers.fp8.quant import quantize
    from workers.fp8.triton_wgrad import wgrad_gemm

    m, n, k = m_n_k
    dy = (torch.randn(m, n, device="cuda") * torch.rand(1, n, device="cuda") * 10).to(torch.bfloat16)
    x = (torch.randn(m, k, device="cuda") * torch.rand(1, k, device="cuda")).to(torch.bfloat16)
    g, xt = quantize(dy.t().contiguous(), "e4m3", (1, 128)), quantize(x.t().contiguous(), "e4m3", (1, 128))
    got = wgrad_gemm(g.data, g.scale, xt.data, xt.scale, torch.float32)
    g64, x64 = g.dequantize(torch.float64), xt.dequantize(torch.float64)
    want, magnitudes = g64 @ x64.t(), g64.abs() @ x64.abs().t()
    chunks = -(-m // 128)
    bound = (128 * 2**-13 + (chunks + 2) * 2**-24) * magnitudes
    assert bool(((got.double() - want).abs() <= bound).all())
    bf16 = wgrad_gemm(g.data, g.scale, xt.data, xt.scale, torch.bfloat16)
    assert torch.equal(bf16, got.to(torch.bfloat16))


def test_a_gpu_trainer_fuses_its_projections_and_keeps_the_gradients() -> None:
    """On CUDA the trainer runs q/k/v and gate/up as one FP8 GEMM each way: its loss and gradients
    are those of the separate layers (same FP8 bytes; the GPU's FP8 accumulation at most)."""
    import copy

    spec = parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": {"recipe": "fp8-e2e"},
        }
    )
    trainer = NativeTrainer(spec, ByteTokenizer().vocab_size, "cuda")
    assert trainer.fused_groups == 2 * 2
    plain = copy.deepcopy(trainer.model)
    for m in plain.modules():
        if isinstance(m, Fp8Linear):
            m.fused_train = None
    tok = ByteTokenizer()
    ids, mask = left_pad([tok.encode("12 + 30 = 42"), tok.encode("7 + 5 = 12")], tok.pad_id)
    ids, mask = ids.cuda(), mask.cuda()
    for model in (trainer.model, plain):
        model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()
    for (name, p), q in zip(trainer.model.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert rel_err(p.grad, q.grad) < GPU_FP8_REL_TOL, name


def test_a_reports_checksums_in_one_launch_are_the_torch_checksums(seed: int) -> None:
    """``FP8RL_CHECKSUM=triton`` (workers/weight_sync/triton_checksum.py) against the torch
    checksum, tensor by tensor: an FP8 weight's data and scales, BF16 tensors of several programs
    and of none, a transposed view; and a report read back without waiting for the GPU before it."""
    from workers.weight_sync.contract import checksum
    from workers.weight_sync.triton_checksum import checksum_many

    w = Fp8Linear(4096, 1024, bias=False, device="cuda").fp8_weight()
    tensors = [
        w.data,
        w.scale,
        torch.randn(50257, 768, device="cuda").to(torch.bfloat16),
        torch.randn(3, device="cuda"),
        torch.empty(0, device="cuda"),
        torch.randn(96, 80, device="cuda").t(),
    ]
    want = [int(checksum(t)) for t in tensors]
    with no_host_sync():
        sums = checksum_many(tensors)
    assert sums.tolist() == want


@pytest.mark.parametrize("pow2", [False, True])
def test_an_fp8_gen_export_is_the_quantizer_weight_by_weight(pow2: bool) -> None:
    """fp8-gen's export quantizes the generators' FP8 layers with the grouped kernel, in one launch
    and without waiting for the GPU: each weight's bytes and scales are the torch quantizer's."""
    from torch import nn

    from workers.fp8 import Fp8LinearConfig
    from workers.weight_sync.payload import export_weights

    model = nn.Sequential(
        nn.Linear(2048, 8192, bias=False), nn.Linear(8192, 2048), nn.Linear(200, 300)
    ).cuda()
    cfg = Fp8LinearConfig(power_of_two_scales=pow2)
    names = ["0.weight", "1.weight", "2.weight"]
    with no_host_sync():
        payload = export_weights(model, names, cfg)
    params = dict(model.named_parameters())
    for name in names:
        want = cfg.quantize_weight(params[name], name)
        assert torch.equal(payload[name].scale, want.scale), name
        assert torch.equal(payload[name].data.view(torch.uint8), want.data.view(torch.uint8)), name


def test_a_gpu_trainers_weights_are_quantized_in_one_launch_bit_for_bit() -> None:
    """After an update one Triton launch quantizes every FP8 weight (workers/fp8/weights.py):
    each layer's bytes and scales are the torch quantizer's, its cuBLAS scale layout the one the
    forward GEMM would derive, a fused group's weight its members' bytes in their storage."""
    from torch.profiler import ProfilerActivity, profile

    from workers.fp8.matmul import cublas_b_scale_layout
    from workers.fp8.quant import quantize

    s = parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": {"recipe": "fp8-e2e"},
        }
    )
    trainer = NativeTrainer(s, TOK.vocab_size, "cuda")
    assert trainer.fused_groups == 2 * 2
    layers = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    with torch.no_grad():
        for m in layers:
            m.weight.mul_(1.5)  # as an optimizer does: in place
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        assert trainer.fp8_weights.quantize() == len(layers) == 2 * 7
        torch.cuda.synchronize()
    launches = [e.count for e in prof.key_averages() if "_quantize_128x128_many" in e.key]
    assert launches == [1], launches
    for m in layers:
        w_q, want = m._w_q, quantize(m.weight.detach(), "e4m3", (128, 128))
        assert w_q is not None and torch.equal(w_q.data.view(torch.uint8), want.data.view(torch.uint8)), (
            m.name
        )
        assert torch.equal(w_q.scale, want.scale), m.name
        layout, derived = w_q._memo["cublas_scale_t"], cublas_b_scale_layout(want.t())
        assert torch.equal(layout, derived) and layout.stride() == derived.stride(), m.name
    attn = trainer.model.model.layers[0].self_attn
    stacked = attn.q_proj.fused_train[0].fp8_weight()
    members = torch.cat([m._w_q.data for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
    assert stacked.data.data_ptr() == attn.q_proj._w_q.data.data_ptr()
    assert torch.equal(stacked.data.view(torch.uint8), members.view(torch.uint8))
    assert torch.equal(stacked._memo["cublas_scale_t"], cublas_b_scale_layout(stacked.t()))


@pytest.mark.parametrize("triton", [True, False])
def test_non_finite_tile_is_named_at_the_end_of_the_guard(triton: bool) -> None:
    from workers.fp8 import NonFiniteError, finite_guard, quant, quantize

    x = torch.ones(40, 300, device="cuda")
    x[33, 260] = float("nan")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant, "_TRITON", triton)
        named = r"second: .*block \(33, 2\): rows 33..33, columns 256..299"
        with pytest.raises(NonFiniteError, match=named), finite_guard():
            quantize(torch.ones(8, 128, device="cuda"), "e4m3", (1, 128), where="first")
            quantize(x, "e4m3", (1, 128), where="second")
            quantize(x, "e4m3", (1, 128), where="third")


@pytest.mark.parametrize(("recipe", "fp8_kv"), [("bf16", False), ("fp8-e2e", False), ("fp8-e2e", True)])
def test_graph_decode_samples_what_the_trainer_scores(recipe: str, fp8_kv: bool) -> None:
    """The CUDA-graph decode loop (``rollout.decode: auto`` on CUDA) against the trainer's full-
    sequence log-probs, before and after new weights arrive: the second load writes into the
    storage the captured graph reads (stale weights would put the mismatch far above 1.05).

    With ``FP8RL_DECODE_ATTENTION=triton`` the bound is the same run's float64 attention rounded to
    BF16 (tests/workers/engines/native/exact_attention.py), whose excess over 1 the kernel's may pass
    by 25%: any attention that rounds otherwise than the trainer's SDPA scores ~1.04 here with
    fp8-e2e weights (FP8 amplification through o_proj's E4M3 input; derived on the CPU, docs/engines.md)."""
    from tests.workers.engines.native.exact_attention import exact_decode_attention
    from workers.algo.mismatch import mismatch_metrics

    s = spec(recipe, fp8_kv_cache=fp8_kv)
    gen = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cuda")  # eos -1: all 16 tokens
    assert gen.static is not None
    exact = (
        NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cuda") if gen.static.kernel_attention else None
    )
    trainer = NativeTrainer(s, TOK.vocab_size, "cuda")

    def error(g: NativeGenerator, update: int) -> float:
        batch = g.generate(PROMPTS, 16, 1.0, 1.0, update)
        metrics = mismatch_metrics(trainer.logprobs(batch, 1.0), batch.logprobs, batch.response_mask)
        return float(metrics["mismatch/token_mult_prob_error"])

    errors, exact_errors = [], []
    for update in range(2):
        if update:  # other weights, same shapes (as after many optimizer steps)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
        payload = trainer.export_weights(fp8_weight_names(gen.model))
        gen.load_weights(payload)
        errors.append(error(gen, update))
        if exact is not None:
            exact.load_weights(payload)
            with exact_decode_attention():
                exact_errors.append(error(exact, update))
    assert gen.static.captures == 1  # one shape: captured once, replayed after the weight update
    # the same weights (FP8: the same bytes) in both engines: BF16 kernel differences only. An FP8
    # KV cache, which the trainer does not have, adds its own error: the eager loop on the CPU
    # (bit for bit the static loop there) gives 1.013 and, on the perturbed weights, 1.062 for this
    # test; stale weights (the first ones) against the second trainer would give far above 1.1
    base = 1.10 if fp8_kv else 1.02
    for i, err in enumerate(errors):
        bound = base  # each update against its own exact run, not an earlier update's
        if exact_errors:  # the exact attention goes through the same cache: a key left out gives 1.15
            assert exact_errors[i] < 1.10, exact_errors
            bound = max(base, 1 + 1.25 * (exact_errors[i] - 1))
        assert err < bound, (errors, exact_errors)


def _agreement(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[float, float, float]:
    """Two greedy runs' (tokens, valid, log-probs): the fraction of rows whose first token agrees,
    the fraction of tokens up to each row's first difference, and the largest log-prob difference
    over those shared tokens."""
    same = (a[0] == b[0]).long().cumprod(1).bool()
    gap = float((a[2][same] - b[2][same]).abs().max()) if bool(same.any()) else 0.0
    return float(same[:, 0].float().mean()), float(same.float().mean()), gap


def test_graph_decode_greedy_matches_eager_decode() -> None:
    """Temperature 0 through the graph and through the eager loop, same weights: the first
    tokens agree (later ones may part where BF16 kernels for different key lengths round a
    near-tie differently), and the graph's log-probs of the shared tokens match eager's.

    With ``FP8RL_DECODE_ATTENTION=triton`` the graph's decode attention rounds otherwise than the
    eager loop's SDPA, and with fp8-e2e weights o_proj's E4M3 input amplifies that: the shared
    tokens and their log-prob gap are held to the same run's float64 attention rounded to BF16,
    with the margins ten CPU cases needed (docs/engines.md: shared fraction at most 0.11 lower,
    gap at most 1.39x)."""
    from tests.workers.engines.native.exact_attention import exact_decode_attention

    s = spec("fp8-e2e")
    graph = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cuda")
    eager = NativeGenerator(
        s.model_copy(update={"rollout": s.rollout.model_copy(update={"decode": "eager"})}),
        TOK.vocab_size, -1, TOK.pad_id, "cuda",
    )  # fmt: skip
    assert graph.static is not None and eager.static is None
    trainer = NativeTrainer(s, TOK.vocab_size, "cuda")
    payload = trainer.export_weights(fp8_weight_names(graph.model))
    graph.load_weights(payload)
    eager.load_weights(payload)
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    g = graph.generate_on_device(ids.cuda(), mask.cuda(), 12, 0.0, 1.0, 0)
    e = eager.generate_on_device(ids.cuda(), mask.cuda(), 12, 0.0, 1.0, 0)
    first, shared, gap = _agreement(g, e)
    assert first >= 0.9  # the first token comes from the prefill (SDPA in both loops)
    if not graph.static.kernel_attention:
        # broken decoding (stale cache, wrong mask or position) agrees on ~none of them
        assert shared > 0.6 and gap <= 0.02, (shared, gap)
        return
    exact = NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cuda")
    exact.load_weights(payload)
    with exact_decode_attention():
        x = exact.generate_on_device(ids.cuda(), mask.cuda(), 12, 0.0, 1.0, 0)
    _, exact_shared, exact_gap = _agreement(x, e)
    assert exact_shared > 0.3, exact_shared  # the same cache and positions: broken decoding fails here
    assert shared >= exact_shared - 0.15 and gap <= max(0.02, 1.5 * exact_gap + 0.005), (
        (shared, gap),
        (exact_shared, exact_gap),
    )


@pytest.mark.parametrize("scale", [2.0**-3, 0.3, 7.0])
def test_fused_kv_write_is_the_torch_write_bit_for_bit(seed: int, scale: float) -> None:
    """``FP8RL_KV_WRITE=triton``'s kernel against the static cache's torch path (quantize with the
    scale, index_copy_) on random K of five decades, a strided [B, H, 1, D] view, powers of two and
    other scales; only the position written changes, and no host sync."""
    from workers.fp8.kv_cache import quantize_kv
    from workers.fp8.triton_kv import write_kv

    b, h, d, length, pos = 5, 4, 128, 33, 17
    x = (torch.randn(b, 1, h, d, device="cuda") * torch.logspace(-2, 3, d, device="cuda")).to(torch.bfloat16)
    x = x.transpose(1, 2)  # [B, H, 1, D], as attention hands it over
    s = torch.tensor(scale, device="cuda")
    buf = torch.full((b, h, length, d), 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    at = torch.tensor([pos], device="cuda")
    with no_host_sync():
        write_kv(x, s, at, buf)
    want = quantize_kv(x, s).data[:, :, 0]
    assert torch.equal(buf[:, :, pos].view(torch.uint8), want.view(torch.uint8))
    others = torch.ones(length, dtype=torch.bool)
    others[pos] = False
    assert bool((buf[:, :, others].view(torch.uint8) == 0x55).all())


@pytest.mark.parametrize("store", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_rope_kv_write_is_hugging_faces_rope_and_the_torch_write_bit_for_bit(
    seed: int, store: torch.dtype
) -> None:
    """``rope_write_kv`` (RoPE of q and k, the K/V write, one launch) against Hugging Face's
    ``apply_rotary_pos_emb`` and the static cache's torch write (quantize_kv, then the position's
    bytes) on the GPU, bit for bit: the hardware's BF16 rounding and E4M3 cast, no host sync."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from workers.fp8.kv_cache import quantize_kv
    from workers.fp8.triton_kv import rope_write_kv

    b, hq, hkv, d, length, pos = 64, 32, 8, 128, 40, 23
    cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    rope = LlamaRotaryEmbedding(cfg).cuda()  # float32 frequencies of the host, as build_policy keeps them
    q = (torch.randn(b, 1, hq * d, device="cuda") * torch.logspace(-2, 2, hq * d, device="cuda")).bfloat16()
    k = (torch.randn(b, 1, hkv * d, device="cuda") * 3).bfloat16()
    v = (torch.randn(b, 1, hkv * d, device="cuda") * 3).bfloat16()
    cos, sin = rope(q, torch.randint(0, 8192, (b, 1), device="cuda"))
    k_scale, v_scale = torch.tensor(0.037, device="cuda"), torch.tensor(2.0**-5, device="cuda")
    k_buf = torch.zeros(b, hkv, length, d, dtype=store, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    at = torch.tensor([pos], device="cuda")
    with no_host_sync():
        got = rope_write_kv(
            q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d), cos[:, 0], sin[:, 0],
            k_scale, v_scale, at, k_buf, v_buf,
        )  # fmt: skip
    want_q, want_k = apply_rotary_pos_emb(
        q.view(b, 1, hq, d).transpose(1, 2), k.view(b, 1, hkv, d).transpose(1, 2), cos, sin
    )
    v_heads = v.view(b, 1, hkv, d).transpose(1, 2)
    assert torch.equal(got, want_q[:, :, 0])
    if store == torch.bfloat16:
        assert torch.equal(k_buf[:, :, pos], want_k[:, :, 0])
        assert torch.equal(v_buf[:, :, pos], v_heads[:, :, 0])
    else:
        for buf, x, scale in ((k_buf, want_k, k_scale), (v_buf, v_heads, v_scale)):
            want = quantize_kv(x, scale).data[:, :, 0]
            assert torch.equal(buf[:, :, pos].view(torch.uint8), want.view(torch.uint8))


def test_an_e4m3_cache_writes_through_the_kernel_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FP8RL_KV_WRITE unset on CUDA: the one-launch write (measured bit for bit and faster on an
    H200, 2026-11-29); ``torch`` keeps the torch path; a BF16 cache has no quantization to fuse."""
    from workers.engines.native.static_decode import StaticKvCache

    def cache(fp8: bool) -> StaticKvCache:
        return StaticKvCache(2, 3, 4, 128, 16, torch.bfloat16, torch.device("cuda"), fp8)

    monkeypatch.delenv("FP8RL_KV_WRITE", raising=False)
    assert cache(True).fused_write and not cache(False).fused_write
    monkeypatch.setenv("FP8RL_KV_WRITE", "torch")
    assert not cache(True).fused_write


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_graph_decode_with_fused_rope_is_the_unfused_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, fp8_kv: bool
) -> None:
    """CUDA graphs, the Triton attention, and RoPE + the K/V write in one launch: the same tokens
    and log-probs as the same graphs with Hugging Face's RoPE and the separate write."""
    from workers.engines.native import decode_attention

    monkeypatch.setenv("FP8RL_DECODE_ATTENTION", "triton")
    monkeypatch.setenv("FP8RL_KV_WRITE", "triton")
    s = spec("fp8-e2e", fp8_kv_cache=fp8_kv)
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    gens = [NativeGenerator(s, TOK.vocab_size, -1, TOK.pad_id, "cuda") for _ in range(2)]
    payload = NativeTrainer(s, TOK.vocab_size, "cuda").export_weights(fp8_weight_names(gens[0].model))
    runs = []
    for gen, rope in zip(gens, (True, False), strict=True):
        gen.load_weights(payload)
        static = gen.static
        assert static is not None and static.fused_rope and static.impl == decode_attention.ATTENTION_NAME
        static.fused_rope = rope
        runs.append(gen.generate_on_device(ids.cuda(), mask.cuda(), 24, 1.0, 1.0, 0))
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 64, 4096])
def test_fused_silu_mul_is_torchs_silu_mul_and_quantizer_bit_for_bit(seed: int, rows: int) -> None:
    """``FP8RL_SILU_MUL=triton``'s kernel against torch on the GPU: ``F.silu(g) * u`` in BF16, then
    the one-layout quantizer, bytes and scales equal, as the kernel launches (triton_act.FP_FUSION).
    A failure says whether the other contraction setting would have matched."""
    from workers.fp8 import triton_act
    from workers.fp8.formats import get_format
    from workers.fp8.quant import quantize_rows

    inter = 14336
    gu = (torch.randn(rows, 2 * inter, device="cuda") * 4).bfloat16()
    h = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    want = quantize_rows(h, "e4m3", rows_multiple=16)
    f = get_format("e4m3")
    rows_out = want.data.shape[0]
    with no_host_sync():
        data, scale = triton_act.silu_mul_1x128(gu, f, False, None, rows_out)
    other = triton_act.silu_mul_1x128(gu, f, False, None, rows_out, fp_fusion=not triton_act.FP_FUSION)
    other_ok = torch.equal(other[0].view(torch.uint8), want.data.view(torch.uint8))
    differ = int((data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
    assert differ == 0, f"{differ} bytes differ; FP_FUSION={not triton_act.FP_FUSION} would match: {other_ok}"
    assert torch.equal(scale, want.scale)


@pytest.mark.parametrize("d", [576, 2048, 4096])
def test_rms_norm_kernel_is_hugging_faces_norm_within_a_bf16_step(seed: int, d: int) -> None:
    """``FP8RL_RMS_NORM=triton``'s kernel on the GPU against Hugging Face's module: the same value or
    one BF16 step away (the float32 sums of squares add in another order), on under 2% of the
    values; no host sync."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from workers.engines.native.triton_norm import rms_norm

    x = (torch.randn(4096, d, device="cuda") * 3).bfloat16()
    norm = LlamaRMSNorm(d, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d, device="cuda"))
    with no_host_sync():
        _, out, _ = rms_norm(x, norm.weight.detach(), 1e-5)
    want = norm(x).detach()
    apart = out != want
    step = (want.float().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert bool(((out.float() - want.float()).abs() <= step)[apart].all())
    assert float(apart.float().mean()) < 0.02


@pytest.mark.parametrize(("d", "pow2"), [(576, False), (4096, True)])
def test_rms_norm_tiles_are_the_quantizers_bytes(seed: int, d: int, pow2: bool) -> None:
    """The norm's 1x128 tiles for the next GEMM (an FP8 generator with ``FP8RL_RMS_NORM=triton``)
    on the GPU: bit for bit what ``quantize_rows`` (the Triton quantizer) makes of the norm's
    output, rows padded to 16 as the GEMM reads them; no host sync."""
    from workers.engines.native.triton_norm import rms_norm_fp8
    from workers.fp8.formats import get_format
    from workers.fp8.quant import quantize_rows

    x = (torch.randn(37, d, device="cuda") * 3).bfloat16()
    r = (torch.randn(37, d, device="cuda") * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(d, device="cuda")).bfloat16()
    with no_host_sync():
        _, out, q = rms_norm_fp8(x, w, 1e-5, r, get_format("e4m3"), pow2, 48, None)
    want = quantize_rows(out, "e4m3", power_of_two=pow2, rows_multiple=16)
    assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(q.scale, want.scale)


@pytest.mark.parametrize("temperature", [1.0, 0.8, 0.0])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (64, 128256), (256, 49152)])
def test_sampling_kernels_draw_torchs_race_on_the_gpu(temperature: float, rows: int, vocab: int) -> None:
    """``FP8RL_SAMPLING=triton``'s kernels on the GPU against torch's ``next_token`` from the same
    seed: the same token wherever float64 puts the best two scores more than 2^-16 apart, log-probs
    within 2^-18 + half an ulp of float64 (sample_checks.py derives it); no host sync, and the
    kernels replay in a CUDA graph with the generator registered."""
    from tests.workers.engines.native.sample_checks import LSE_BOUND, float64_reference, margin
    from workers.engines.native.sampling import next_token
    from workers.engines.native.triton_sample import sample_rows

    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    done = torch.zeros(rows, dtype=torch.bool, device="cuda")
    first = torch.Generator("cuda").manual_seed(9)
    with no_host_sync():
        tok, logp = sample_rows(logits, temperature, first, done, 0)
    want, _ = next_token(logits, temperature, 1.0, torch.Generator("cuda").manual_seed(9), done, 0)
    noise = None
    if temperature:
        noise = torch.empty(rows, vocab, device="cuda").exponential_(
            1, generator=torch.Generator("cuda").manual_seed(9)
        )
    logp64, scores = float64_reference(logits, temperature, noise)
    clear = margin(scores) > 2.0**-16
    assert torch.equal(tok[clear], want[clear])
    ref = logp64.gather(-1, tok[:, None]).squeeze(-1)
    assert bool(((logp.double() - ref).abs() <= LSE_BOUND + 2.0**-24 * ref.abs()).all())
    gen = torch.Generator("cuda").manual_seed(9)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    sample_rows(logits, temperature, gen, done, 0)  # compiled outside the capture
    with torch.cuda.graph(graph):
        replayed = sample_rows(logits, temperature, gen, done, 0)
    gen.manual_seed(9)
    graph.replay()
    assert torch.equal(replayed[0][clear], want[clear])


def test_a_random_init_model_is_built_on_the_gpu_with_the_hosts_rope() -> None:
    from workers.engines.models import build_policy

    s = spec("bf16")
    a = build_policy(s, TOK.vocab_size, torch.float32, "cuda")
    b = build_policy(s, TOK.vocab_size, torch.bfloat16, "cuda")
    host = build_policy(s, TOK.vocab_size, torch.float32, "cpu")
    assert {p.device.type for p in a.parameters()} == {"cuda"}
    # same seed, same weights on the GPU (b: a's values rounded to BF16)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x.to(torch.bfloat16), y), name
    # the RoPE frequencies are the host's, bit for bit, in both dtypes (trainer and generator agree)
    want = host.model.rotary_emb.inv_freq
    assert torch.equal(a.model.rotary_emb.inv_freq.cpu(), want)
    assert torch.equal(b.model.rotary_emb.inv_freq.cpu(), want)

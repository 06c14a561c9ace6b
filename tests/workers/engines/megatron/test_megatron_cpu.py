"""The Megatron trainer on the real Megatron-Core 0.16.1, on the CPU (local layer spec, gloo).

Expected values come from elsewhere: the Hugging Face model the weights came from, the native
trainer on the same weights and batch, and the native K/V calibration. Both engines compute in
float32 here (the trainer's ``compute_dtype``; the native trainer's ``sequence_logprobs`` with
``compute_dtype=float32``), so they compute the same function up to float32 rounding in another
order of operations (fused q/k/v GEMM, baddbmm attention scores, torch's RMSNorm, the
vocabulary-parallel cross entropy). Bounds, and in brackets what this machine measured:

- logits vs Hugging Face: 2e-5 absolute on logits of size ~3 [0: bit-identical here; another
  BLAS may round differently]: float32 rounding (2^-24 relative) over 2 layers of 64-128-wide
  sums is ~1e-6; a wrong mapping (a swapped norm, a mis-ordered q/k/v head, a missing bias)
  moves logits by O(0.1);
- log-probs vs the native trainer: 2e-5 [1.4e-6];
- one GRPO step: statistics to 1e-5 relative [2e-7], the loss to 1e-6 absolute [4e-8; it sums
  terms of size ~5 that nearly cancel]; each optimizer step's clipped gradients to 1e-5 of the
  largest [1.2e-6]; updated weights to 1e-3 x lr where every step's gradient exceeds 1e-6
  [1.6e-4 x lr], 5e-2 x lr elsewhere [1e-2 x lr]: Adam moves a weight by ~lr x g / (|g| + 1e-8),
  so where |g| is within a few epsilons of 0 a float32 difference of 1e-9 in g is a visible
  fraction of lr;
- the SFT step: loss to 1e-6 relative [identical], weights as above [1.1e-2 x warmup.lr];
- K/V scales: 1e-5 relative [identical]: the amax of the same K and V, rounded to a power of two.

BF16 (the job's compute dtype) is checked against the native trainer's BF16 through the factory:
log-probs to 2e-2 [5e-7], gradient norm to 2% [3e-5].
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import megatron.core as megatron_core  # noqa: F401  # `make engines` installs it (make test does): missing is an error
import pytest
import torch

from rljob import JobSpec
from tests.workers.engines.megatron.megatron_cpu import (
    REWARDS,
    TOK,
    VOCAB,
    assert_same_state,
    assert_same_stats,
    cpu_spec,
    fixed_batch,
    hf_state,
    megatron_logits,
    one_rank_group,
    random_hf_model,
    release_megatron,
)
from workers.engines.megatron.trainer import MegatronTrainer
from workers.engines.native import trainer as native_module
from workers.engines.native.trainer import NativeTrainer

F32 = torch.float32
VOCAB_ROWS = 272  # the byte tokenizer's 259 ids, padded to a multiple of 16 by the model builder


@pytest.fixture
def group() -> Iterator[None]:
    yield from one_rank_group()


@pytest.fixture
def float32_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native trainer computing in float32 between its GEMMs (its forward's own option)."""
    f32 = functools.partial(native_module.sequence_logprobs, compute_dtype=F32)
    monkeypatch.setattr(native_module, "sequence_logprobs", f32)


def megatron(spec: JobSpec, state: dict[str, torch.Tensor] | None = None) -> MegatronTrainer:
    trainer = MegatronTrainer(spec, VOCAB, "cpu", compute_dtype=F32)
    if state is not None:
        trainer.load_state_dict({"model": state})
    return trainer


def native(spec: JobSpec, state: dict[str, torch.Tensor]) -> NativeTrainer:
    trainer = NativeTrainer(spec, VOCAB)
    trainer.model.load_state_dict(state, strict=False)  # a tied lm_head is the embedding
    return trainer


# -- conversion ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_megatron_logits_equal_the_hugging_face_model(group: Any, arch: str) -> None:
    spec = cpu_spec(arch)
    hf = random_hf_model(spec)
    meg = megatron(spec, hf_state(hf))
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [3, 17, V]
    logits = megatron_logits(meg, ids)  # [3, 17, 384]: the vocabulary padded to a multiple of 128
    assert not logits[..., VOCAB_ROWS:].any()  # zero rows: logit 0, masked to -inf in the log-probs
    got = logits[..., :VOCAB_ROWS]
    worst, size = float((got - expected).abs().max()), float(expected.abs().max())
    print(f"{arch}: max |logit diff| {worst:.2e}, max |logit| {size:.2f}")
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_export_round_trips_bit_for_bit(group: Any, arch: str) -> None:
    spec = cpu_spec(arch)
    state = hf_state(random_hf_model(spec))
    meg = megatron(spec, state)
    back = meg.state_dict()["model"]
    assert back.keys() == state.keys()  # a tied model has no lm_head
    assert all(back[k].dtype == F32 and torch.equal(back[k], state[k]) for k in state)
    payload = meg.export_weights(())
    assert payload.keys() == state.keys()
    assert all(torch.equal(payload[k], v.to(torch.bfloat16)) for k, v in state.items())


# -- training against the native trainer -----------------------------------------------------------


def megatron_grads(trainer: MegatronTrainer) -> list[dict[str, torch.Tensor]]:
    """The Megatron-named gradients of each optimizer step (after clipping), as the inner torch
    optimizer steps with them (float32 compute: its parameters are the model's)."""
    steps: list[dict[str, torch.Tensor]] = []
    model = trainer.model
    inner = model.optimizer.optimizer

    def capture(step: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append({name: p.grad.clone() for name, p in model.gpt.named_parameters()})
        return step(*args, **kwargs)

    inner.step = functools.partial(capture, inner.step)
    return steps


def native_grads(trainer: NativeTrainer) -> list[dict[str, torch.Tensor]]:
    """The native trainer's gradients of each optimizer step (after clipping)."""
    steps: list[dict[str, torch.Tensor]] = []
    opt = trainer.optimizer

    def capture(step: Any, *args: Any, **kwargs: Any) -> Any:
        steps.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    opt.step = functools.partial(capture, opt.step)  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize(
    ("arch", "aggregation", "minibatches"),
    [("llama", "token-mean", 1), ("qwen2", "seq-mean-token-mean", 2)],
    ids=["llama-token", "qwen2-seq-2mini"],
)
def test_a_grpo_step_equals_the_native_trainers(
    group: Any, float32_native: None, arch: str, aggregation: str, minibatches: int
) -> None:
    from workers.engines.megatron.convert import megatron_to_hf

    spec = cpu_spec(arch, algorithm={"loss_aggregation": aggregation, "minibatches": minibatches})
    state = hf_state(random_hf_model(spec))
    meg, nat = megatron(spec, state), native(spec, state)
    batch = fixed_batch()
    mask = batch.response_mask
    lp, lp_native = meg.logprobs(batch, 0.9), nat.logprobs(batch, 0.9)
    print(f"log-probs: max diff {float((lp - lp_native).abs().max()):.2e}")
    torch.testing.assert_close(lp, lp_native, atol=2e-5, rtol=0)
    assert not (lp * (1 - mask)).any()
    ours_g, theirs_g = megatron_grads(meg), native_grads(nat)
    ours, theirs = meg.train_step(batch, REWARDS, 1.0), nat.train_step(batch, REWARDS, 1.0)
    assert_same_stats(ours.stats, theirs.stats)
    torch.testing.assert_close(ours.logprobs_old, theirs.logprobs_old, atol=2e-5, rtol=0)
    # each minibatch's gradients, clipped as each optimizer applied them
    assert len(ours_g) == len(theirs_g) == minibatches
    for step, (mine, expected) in enumerate(zip(ours_g, theirs_g, strict=True)):
        grads = megatron_to_hf(mine, meg.model.shapes)
        assert grads.keys() == expected.keys()
        largest = max(float(g.abs().max()) for g in expected.values())
        worst = max(float((grads[k] - g).abs().max()) for k, g in expected.items())
        print(f"gradients of step {step}: max diff {worst:.2e} of max {largest:.2e}")
        assert worst <= 1e-5 * largest
    after, native_after = meg.state_dict()["model"], nat.model.state_dict()
    lr = spec.optimizer.lr
    diff = {k: (w - native_after[k]).abs() for k, w in after.items()}
    worst = max(float(d.max()) for d in diff.values())
    # where every step's gradient is well above Adam's epsilon (1e-8), an update is ~lr x sign
    clear = {k: torch.stack([g[k].abs() for g in theirs_g]).min(0).values > 1e-6 for k in diff}
    worst_clear = max(float(torch.where(clear[k], d, 0.0).max()) for k, d in diff.items())
    moved = min(float((native_after[k] - w).abs().max()) for k, w in state.items())
    print(f"updated weights: max diff {worst / lr:.2e} x lr, {worst_clear / lr:.2e} x lr where |grad| > 1e-6")
    assert worst <= 5e-2 * lr and worst_clear <= 1e-3 * lr and moved > 0.5 * lr


def test_the_sft_step_equals_the_native_trainers(group: Any, float32_native: None) -> None:
    spec = cpu_spec("qwen2")
    state = hf_state(random_hf_model(spec))
    meg, nat = megatron(spec, state), native(spec, state)
    # the Megatron trainer warms up with its own Adam at warmup.lr and the job's weight decay (0);
    # the native one makes a separate AdamW, whose default weight decay is 0.01: the same here
    nat.sft_optimizer = torch.optim.AdamW(nat.model.parameters(), lr=spec.warmup.lr, weight_decay=0.0)
    batch = fixed_batch(seed=1)
    loss, expected = meg.sft_step(batch), nat.sft_step(batch)
    print(f"SFT loss {loss:.8g} vs {expected:.8g}")
    assert loss == pytest.approx(expected, rel=1e-6)
    assert all(g["lr"] == spec.optimizer.lr for g in meg.model.optimizer.param_groups)  # restored
    after, native_after = meg.state_dict()["model"], nat.model.state_dict()
    worst = max(float((w - native_after[k]).abs().max()) for k, w in after.items())
    print(f"updated weights: max diff {worst / spec.warmup.lr:.2e} x warmup.lr")
    assert worst <= 5e-2 * spec.warmup.lr


# -- K/V calibration -------------------------------------------------------------------------------


def test_kv_scales_equal_the_native_calibration(group: Any) -> None:
    """The local spec's core attention sees K after RoPE and V as Transformer Engine's does; the
    scales sent to vLLM are those the native calibration computes on the updated weights."""
    from workers.engines.native.kv_calibration import kv_scale_payload, observe_kv
    from workers.fp8.formats import get_format
    from workers.fp8.kv_cache import KvScaleCalibrator, KvScales, kv_scale_name

    spec = cpu_spec(
        "llama",
        precision={"recipe": "bf16", "fp8_kv_cache": True},
        resources={"generator_engine": "vllm"},
    )
    state = hf_state(random_hf_model(spec))
    meg = megatron(spec, state)
    assert meg.kv is not None
    before = meg.export_weights(())
    assert not any(kv_scale_name(i, w) in before for i in range(2) for w in "kv")  # none yet
    batch = fixed_batch(seed=2)
    meg.train_step(batch, REWARDS, 1.0)
    payload = meg.export_weights(())
    nat = native(cpu_spec("llama"), meg.state_dict()["model"])  # the updated weights
    calibrator = KvScaleCalibrator(2)
    observe_kv(nat.model, batch, calibrator, spec.optimizer.micro_batch_size, compute_dtype=F32)
    expected = kv_scale_payload(calibrator.scales())
    assert expected.keys() <= payload.keys() and len(expected) == 4
    for name, scale in expected.items():
        got = payload[name]
        assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == F32
        print(f"{name}: {float(got):.8g} vs {float(scale):.8g}")
        torch.testing.assert_close(got, scale, rtol=1e-5, atol=0)
    # the scales are part of the trainer's state: a trainer started from it (a replaced actor)
    # sends the same ones, bit for bit, before it calibrates again
    again = megatron(spec, state)
    again.load_state_dict(meg.state_dict())
    sent_again = again.export_weights(())
    assert all(torch.equal(sent_again[name], payload[name]) for name in expected)
    # precision.fp8_kv_cache_in_training: Megatron's forward now reads K/V rounded with these
    # scales, as the native trainer's does with the same scales (to the float32 bound above),
    # and apart from the BF16-K/V forward by far more than that bound
    scales = KvScales(
        torch.stack([payload[kv_scale_name(i, "k")] for i in range(2)]),
        torch.stack([payload[kv_scale_name(i, "v")] for i in range(2)]),
        get_format("e4m3"),
    )
    lp = meg.logprobs(batch, 0.9)
    with torch.no_grad():
        rounded = native_module.sequence_logprobs(nat.model, batch, 0.9, F32, kv_scales=scales)
        plain = native_module.sequence_logprobs(nat.model, batch, 0.9, F32)
    print(f"log-probs with rounded K/V: max diff {float((lp - rounded).abs().max()):.2e}")
    torch.testing.assert_close(lp, rounded, atol=2e-5, rtol=0)
    assert float((lp - plain).abs().max()) > 1e-3


def test_kv_scales_of_the_evenly_spaced_rows(group: Any) -> None:
    """``precision.kv_calibration_sequences`` = 3 of 8 rows: rows i * 8 // 3 = 0, 2 and 5 (worked
    by hand); the scales are the native calibration's on exactly those rows."""
    from workers.engines.native.kv_calibration import kv_scale_payload, observe_kv
    from workers.engines.protocols import Rollouts
    from workers.fp8.kv_cache import KvScaleCalibrator

    spec = cpu_spec(
        "llama",
        precision={"recipe": "bf16", "fp8_kv_cache": True, "kv_calibration_sequences": 3},
        resources={"generator_engine": "vllm"},
    )
    state = hf_state(random_hf_model(spec))
    batch = fixed_batch(seed=2)
    rows = torch.tensor([0, 2, 5])
    # a token only the other rows hold gets an embedding that makes layer 0's K large: scales
    # that saw those rows differ from these
    ids = torch.cat([batch.prompt_ids * batch.prompt_mask, batch.response_ids], 1)
    kept = set(ids[rows].flatten().tolist())
    token = next(t for t in ids[[1, 3, 4, 6, 7]].flatten().tolist() if t not in kept)
    k_row = state["model.layers.0.self_attn.k_proj.weight"][0]
    state["model.embed_tokens.weight"][token] = k_row / k_row.norm()
    meg = megatron(spec, state)
    meg.calibrate_kv(batch)
    payload = meg.export_weights(())
    nat = native(cpu_spec("llama"), state)
    expected, everything = KvScaleCalibrator(2), KvScaleCalibrator(2)
    observe_kv(nat.model, Rollouts(*(t[rows] for t in batch)), expected, 3, compute_dtype=F32)
    observe_kv(nat.model, batch, everything, 3, compute_dtype=F32)
    assert float(everything.scales().k[0]) > float(expected.scales().k[0])
    for name, scale in kv_scale_payload(expected.scales()).items():
        torch.testing.assert_close(payload[name], scale, rtol=1e-5, atol=0)


def test_no_calibration_without_an_fp8_kv_cache(group: Any) -> None:
    meg = megatron(cpu_spec("llama", precision={"recipe": "bf16", "fp8_kv_cache": False}))
    assert meg.kv is None
    assert not any(k.endswith(("k_scale", "v_scale")) for k in meg.export_weights(()))


# -- the trainer the job builds --------------------------------------------------------------------


@pytest.fixture
def no_group() -> Iterator[None]:
    """No process group before the test; whatever the trainer made is released after it."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    try:
        yield
    finally:
        release_megatron()


def test_a_lone_trainer_makes_its_own_gloo_group(no_group: Any) -> None:
    import torch.distributed as dist

    meg = MegatronTrainer(cpu_spec("llama"), VOCAB, "cpu")
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert meg.device == torch.device("cpu") and meg.model.compute_dtype == torch.bfloat16
    assert meg.model.shapes.layout == "local"
    assert {r.precision for r in meg.audit.rows} == {"bfloat16"} and meg.audit.device == "CPU"


def test_the_factory_builds_a_bf16_trainer_that_trains_like_the_native_one(no_group: Any) -> None:
    """BF16 compute (Megatron's Float16Module and mixed-precision optimizer on the CPU) against the
    native trainer's BF16: the same function up to BF16 rounding in a different order."""
    from workers.engines.factory import build_trainer

    spec = cpu_spec("qwen2", "bf16")
    meg = build_trainer(spec, VOCAB, "cpu")
    assert isinstance(meg, MegatronTrainer)
    nat = NativeTrainer(spec, VOCAB)  # the same initial weights, from the spec's seed
    start = meg.state_dict()["model"]
    assert all(torch.equal(v, nat.model.state_dict()[k]) for k, v in start.items())
    assert all(p.main_param.dtype == F32 for p in meg.model.gpt.parameters())  # float32 main weights
    assert all(p.dtype == torch.bfloat16 for p in meg.model.gpt.parameters())  # BF16 compute copies
    batch = fixed_batch(seed=3)
    lp, lp_native = meg.logprobs(batch, 1.0), nat.logprobs(batch, 1.0)
    print(f"BF16 log-probs: max diff {float((lp - lp_native).abs().max()):.2e}")
    assert float((lp - lp_native).abs().max()) < 2e-2
    ours, theirs = meg.train_step(batch, REWARDS, 1.0), nat.train_step(batch, REWARDS, 1.0)
    print(f"BF16 grad norm {ours.stats['train/grad_norm']:.6g} vs {theirs.stats['train/grad_norm']:.6g}")
    assert ours.stats["train/grad_norm"] == pytest.approx(theirs.stats["train/grad_norm"], rel=2e-2)
    after = meg.state_dict()["model"]
    payload = meg.export_weights(())
    assert all(torch.equal(payload[k], v.to(torch.bfloat16)) for k, v in after.items())


def test_the_factory_builds_an_fp8_gen_trainer_that_sends_fp8_weights(no_group: Any) -> None:
    """fp8-gen: the trainer computes in BF16 and sends the generator's FP8 layers as E4M3 data and
    128x128 block scales, quantized from its BF16 weights; the FP8 generator samples with them
    close to the trainer's own log-probs."""
    from workers.algo.mismatch import mismatch_metrics
    from workers.engines.factory import build_trainer
    from workers.engines.native.generator import NativeGenerator
    from workers.fp8.fp8_tensor import Fp8Tensor

    spec = cpu_spec("llama", "fp8-gen")
    meg = build_trainer(spec, VOCAB, "cpu")
    meg.train_step(fixed_batch(seed=4), REWARDS, 1.0)
    gen = NativeGenerator(spec, VOCAB, TOK.eos_id, TOK.pad_id)
    names = gen.fp8_weight_names()
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    weights = {k: v.to(torch.bfloat16).float() for k, v in meg.state_dict()["model"].items()}
    payload = meg.export_weights(names)
    for name in names:
        q = payload[name]
        assert isinstance(q, Fp8Tensor) and q.data.dtype == torch.float8_e4m3fn and q.block == (128, 128)
        w = weights[name]
        assert q.data.shape == w.shape and q.scale.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        # E4M3 keeps 3 mantissa bits: within half a unit (2^-4 relative), or a subnormal step
        scale = q.scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        assert ((q.dequantize() - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all(), name
    assert all(isinstance(payload[k], torch.Tensor) for k in weights.keys() - set(names))
    gen.load_weights(payload)
    prompts = [TOK.encode(p) for p in ("1+1=", "12+345=", "Calculate 7 + 8. ", "9*9=")]
    rollouts = gen.generate(prompts, 8, 1.0, 1.0, 0)
    metrics = mismatch_metrics(meg.logprobs(rollouts, 1.0), rollouts.logprobs, rollouts.response_mask)
    print(f"fp8-gen token_mult_prob_error {metrics['mismatch/token_mult_prob_error']:.4f}")
    assert metrics["mismatch/token_mult_prob_error"] < 1.05  # NVIDIA's healthy bound


def test_a_checkpoint_round_trips_and_resumes_exactly(group: Any, float32_native: None) -> None:
    """The checkpoint holds the float32 main weights and Adam's moments by Hugging Face name (the
    native trainer's moments after the same step); loading it, into this trainer or a new one,
    and taking the next step gives the same bits as never having stopped."""
    spec = cpu_spec("qwen2")
    state = hf_state(random_hf_model(spec))
    meg, nat = megatron(spec, state), native(spec, state)
    assert meg.state_dict()["optimizer"] is None  # no step yet: no moments
    first, second = fixed_batch(seed=5), fixed_batch(seed=6)
    meg.train_step(first, REWARDS, 1.0)
    nat.train_step(first, REWARDS, 1.0)
    saved = meg.state_dict()
    assert saved["optimizer"]["steps"] == 1
    for name, p in nat.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            expected = nat.optimizer.state[p][key]
            got = saved["optimizer"][key][name]
            assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max()), (key, name)
    meg.train_step(second, REWARDS, 1.0)
    uninterrupted = meg.state_dict()
    for trainer in (meg, megatron(spec)):  # this trainer, and a new one (a resumed run)
        trainer.load_state_dict(saved)
        assert_same_state(trainer.state_dict(), saved)
        trainer.train_step(second, REWARDS, 1.0)
        assert_same_state(trainer.state_dict(), uninterrupted)
    meg.load_state_dict(nat.state_dict())  # a native checkpoint: its weights, Adam afresh
    assert meg.state_dict()["optimizer"] is None
    loaded = meg.state_dict()["model"]
    assert all(torch.equal(loaded[k], v) for k, v in nat.model.named_parameters())


def test_the_trainer_actor_runs_one_megatron_trainer(no_group: Any, tmp_path: Any) -> None:
    """``TrainerWorker.setup`` as the job calls it on the CPU (a gloo group of the one trainer),
    then a step and a checkpoint that loads back exactly (two trainers: test_megatron_parallel)."""
    import torch.distributed as dist

    from tests.workers.engines.megatron.megatron_cpu import free_port
    from workers.job.ray_workers import TrainerWorker

    threads = torch.get_num_threads()  # the actor shares the cores out between its actors
    try:
        worker = TrainerWorker(cpu_spec("llama").model_dump_json(), 0, 2, VOCAB)  # + one generator
        audit = worker.setup(f"tcp://127.0.0.1:{free_port()}", "gloo")
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1 and worker.dp_group is None
        assert isinstance(worker.engine, MegatronTrainer) and "input_layernorm" in audit["table"]
        logp_old, stats = worker.train_step(fixed_batch(), REWARDS)
        assert logp_old.shape == (8, 6) and stats["train/tokens"] == float(fixed_batch().response_mask.sum())
        worker.save(str(tmp_path))
        saved = worker.engine.state_dict()
        worker.train_step(fixed_batch(seed=1), REWARDS)
        worker.load(str(tmp_path))
        assert_same_state(worker.engine.state_dict(), saved)
    finally:
        torch.set_num_threads(threads)


def test_fp8_e2e_is_refused_on_the_cpu(no_group: Any) -> None:
    """The spec refuses fp8-e2e with gpus_per_trainer 0; a trainer that asked for a GPU but got
    the CPU (no CUDA visible) refuses it too, rather than train BF16 silently."""
    spec = cpu_spec("llama", "fp8-e2e", resources={"gpus_per_trainer": 1})
    with pytest.raises(ValueError, match=r"fp8-e2e .* need a CUDA GPU"):
        MegatronTrainer(spec, VOCAB, "cpu")

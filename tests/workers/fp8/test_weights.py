"""A trainer's FP8 weights quantized in one batched call after each optimizer step
(workers/fp8/weights.py): the bytes each layer would make itself, one flat buffer whose views the
layers, a fused group and export all read, exactly one quantization per layer per update.

The CPU runs the torch quantizer weight by weight into the flat buffers; the Triton kernel that
does it in one launch on a GPU is checked under the interpreter (triton_kernel_checks.py), for
SM90 (test_triton_kernels.py) and on the GPU (tests/workers/test_gpu_data_plane.py)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from rljob import parse_spec
from workers.engines.batching import left_pad
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.fp8 import Fp8Linear, NonFiniteError, finite_guard
from workers.fp8.fused import fuse_for_training
from workers.fp8.quant import quantize
from workers.fp8.weights import WeightBatch
from workers.models.tokenizer import ByteTokenizer
from workers.weight_sync.payload import fp8_weight_names

TOK = ByteTokenizer()
# head_dim 128, one KV head: q 256 rows, k and v 128 each, gate and up 512: whole 128-row blocks
SPEC = parse_spec(
    {
        "model": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}},
        "precision": {"recipe": "fp8-e2e"},
    }
)


def fp8_layers(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def own_bytes(m: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight quantized on its own, by the quantizer itself (128x128 blocks, E4M3)."""
    q = quantize(m.weight.detach(), "e4m3", (128, 128))
    return q.data.view(torch.uint8), q.scale


def assert_own_bytes(model: torch.nn.Module) -> None:
    for name, m in fp8_layers(model).items():
        data, scale = own_bytes(m)
        w_q = m._w_q
        assert w_q is not None and torch.equal(w_q.data.view(torch.uint8), data), name
        assert torch.equal(w_q.scale, scale), name


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def batch() -> tuple[Rollouts, torch.Tensor]:
    """One group of 8 responses (the spec's default group size), half of them rewarded."""
    ids, mask = left_pad([TOK.encode("1 + 2 ="), TOK.encode("30 + 4 =")] * 4, TOK.pad_id)
    response = torch.full((8, 5), ord("3"))
    rewards = torch.tensor([1.0, 0.0] * 4)
    return Rollouts(ids, mask, response, torch.ones(8, 5), torch.zeros(8, 5)), rewards


def test_a_trainer_quantizes_every_fp8_weight_into_one_buffer() -> None:
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    layers = fp8_layers(trainer.model)
    assert trainer.fp8_weights.layers == len(layers) == 2 * 7
    assert_own_bytes(trainer.model)
    assert len({storage(m._w_q.data) for m in layers.values() if m._w_q is not None}) == 1
    assert trainer.fp8_weights.quantize() == 0  # nothing changed since: nothing is quantized again


def test_one_quantization_per_layer_per_optimizer_step_reused_by_export() -> None:
    """A train step (one optimizer step) then an export: each layer's FP8 copy made once, after the
    step, from the new master weight; the payload is that copy, not a new quantization."""
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    layers = fp8_layers(trainer.model)
    before = {n: m.fp8_weight_updates for n, m in layers.items()}
    old = {n: m.weight.detach().clone() for n, m in layers.items()}
    rollouts, rewards = batch()
    trainer.train_step(rollouts, rewards, 1.0)
    payload = trainer.export_weights(fp8_weight_names(trainer.model))
    for name, m in layers.items():
        assert not torch.equal(m.weight.detach(), old[name]), name  # the step moved every weight
        assert m.fp8_weight_updates == before[name] + 1, name
        sent = payload[f"{name}.weight"]
        assert sent is m._w_q, name  # the very copy the layer computes with
    # made by the batch after the step (one buffer), not by each layer on its next use
    assert len({storage(payload[f"{name}.weight"].data) for name in layers}) == 1
    assert_own_bytes(trainer.model)


def test_a_fused_groups_weight_is_a_view_of_its_members_adjacent_copies() -> None:
    """q/k/v and gate/up fused (a GPU trainer's layout, made by hand on the CPU): the group's
    stacked weight is its members' bytes, in order, in the same storage (no concatenation); an
    optimizer step's batch gives the group and its members the new weights at once."""
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    assert fuse_for_training(trainer.model) == 2 * 2
    weights = WeightBatch(trainer.model)
    with torch.no_grad():
        for m in fp8_layers(trainer.model).values():
            m.weight.mul_(1.5)  # as an optimizer does: in place, under no_grad
    assert weights.quantize() == 2 * 7
    attn = trainer.model.model.layers[1].self_attn
    group = attn.q_proj.fused_train[0]
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    stacked = group._w_q
    assert stacked is not None and stacked.shape == (256 + 128 + 128, 256)
    assert stacked.data.data_ptr() == members[0]._w_q.data.data_ptr()
    assert stacked.scale.data_ptr() == members[0]._w_q.scale.data_ptr()
    want = [own_bytes(m) for m in members]
    assert torch.equal(stacked.data.view(torch.uint8), torch.cat([d for d, _ in want]))
    assert torch.equal(stacked.scale, torch.cat([s for _, s in want]))
    updates = [m.fp8_weight_updates for m in members]
    assert group.fp8_weight() is stacked  # current: the group does not stack again
    assert [m.fp8_weight_updates for m in members] == updates


def test_a_weight_changed_in_place_makes_its_lane_quantize_again() -> None:
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    down = trainer.model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight[3, 7] = 9.0  # a new block maximum: its block's scale changes
    assert trainer.fp8_weights.quantize() == 2 * 7
    assert float(down._w_q.scale[0, 0]) == pytest.approx(9.0 / 448.0)
    assert_own_bytes(trainer.model)


def set_up_proj_weight(trainer: NativeTrainer, layer: int, at: tuple[int, int], value: float) -> Fp8Linear:
    """Write ``value`` into decoder layer ``layer``'s up_proj master weight (in place); the layer."""
    up: Fp8Linear = trainer.model.model.layers[layer].mlp.up_proj
    with torch.no_grad():
        up.weight[at] = value
    return up


def test_a_non_finite_master_weight_is_named() -> None:
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    set_up_proj_weight(trainer, 1, (200, 5), float("nan"))
    match = r"model\.layers\.1\.mlp\.up_proj: weight.*block \(1, 0\)"
    with pytest.raises(NonFiniteError, match=match), finite_guard():
        trainer.fp8_weights.quantize()


def test_layers_without_master_weights_take_no_part() -> None:
    """A generator holds FP8 weights alone (loaded, never quantized from a master)."""
    gen = NativeGenerator(SPEC, TOK.vocab_size, TOK.eos_id, TOK.pad_id, "cpu")
    assert fp8_layers(gen.model) and WeightBatch(gen.model).layers == 0
    bf16 = parse_spec({"model": {"tiny": {}}, "precision": {"recipe": "bf16"}})
    assert NativeTrainer(bf16, TOK.vocab_size, "cpu").fp8_weights.layers == 0


def test_a_checkpoint_load_quantizes_the_loaded_weights_at_once() -> None:
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    state = trainer.state_dict()
    state["model"] = {k: v * 0.5 for k, v in state["model"].items()}
    trainer.load_state_dict(state)
    layers = fp8_layers(trainer.model)
    assert len({storage(m._w_q.data) for m in layers.values() if m._w_q is not None}) == 1
    assert all(m._w_q_key == m._weight_key() for m in layers.values())
    assert_own_bytes(trainer.model)


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_the_previous_copies_are_let_go_before_the_new_buffers_are_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No second set of FP8 weights at the peak: when the batch allocates its buffers, the layers'
    previous copies are gone; a payload exported before keeps its bytes."""
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    layers = list(fp8_layers(trainer.model).values())

    def step() -> None:  # what an optimizer step does to the master weights
        with torch.no_grad():
            for m in layers:
                m.weight.mul_(2.0)

    previous = [weakref.ref(m._w_q.data) for m in layers if m._w_q is not None]
    gone_at_allocation: list[bool] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        gc.collect()
        gone_at_allocation.append(all(ref() is None for ref in previous))
        return real_empty(*args, **kwargs)

    step()
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", empty)
        trainer.fp8_weights.quantize()
    assert len(previous) == len(layers) and gone_at_allocation and gone_at_allocation[0]

    names = fp8_weight_names(trainer.model)
    payload = trainer.export_weights(names)
    sent = {name: payload[name].scale.clone() for name in names}
    step()  # doubles every weight: every block's scale doubles
    trainer.fp8_weights.quantize()
    layer_of = dict(fp8_layers(trainer.model))
    for name in names:
        assert torch.equal(payload[name].scale, sent[name]), name  # the payload is not overwritten
        now = layer_of[name.removesuffix(".weight")]._w_q
        assert now is not None and torch.equal(now.scale, 2 * sent[name]), name
    assert_own_bytes(trainer.model)


def test_a_failed_batch_leaves_each_layer_to_quantize_its_own() -> None:
    trainer = NativeTrainer(SPEC, TOK.vocab_size, "cpu")
    set_up_proj_weight(trainer, 0, (0, 0), float("inf"))
    with pytest.raises(NonFiniteError, match="up_proj: weight"):
        trainer.fp8_weights.quantize()  # outside a guard the CPU checks at once
    set_up_proj_weight(trainer, 0, (0, 0), 0.0)
    for m in fp8_layers(trainer.model).values():
        m.fp8_weight()  # each layer on its own
    assert_own_bytes(trainer.model)

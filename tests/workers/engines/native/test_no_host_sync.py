"""The generator's decode loop and the trainer's step never read a tensor back: they run on ``meta``.

Tensors on the ``meta`` device have shapes and no data, so anything that would make the host wait
for a GPU (``.item()``, ``bool(t)``, a device-to-host copy, a data-dependent shape) raises there.
Under a simulated SM90 profile the FP8 GEMMs also go through torch's real ``_scaled_mm`` /
``scaled_mm`` meta kernels, which apply CUDA's preconditions to every call of a real model's
forward, backward and decode. The GPU twin (sync debug mode "error" on a real H100) is in
tests/workers/test_gpu_data_plane.py.
"""

from __future__ import annotations

import pytest
import torch

from rljob import JobSpec, parse_spec
from workers.engines.batching import left_pad
from workers.engines.models import CPU_ATTENTION
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts
from workers.fp8 import simulate
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def spec(recipe: str, **precision: object) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": {"hidden_size": 256, "intermediate_size": 512, "num_layers": 2}},
            "precision": {"recipe": recipe, **precision},
            "rollout": {"group_size": 2},
            "algorithm": {"minibatches": 2, "kl": {"coef": 0.1}},
            "optimizer": {"micro_batch_size": 2},
        }
    )


@pytest.mark.parametrize("profile", ["cpu", "sm90-cuda13.0"])
@pytest.mark.parametrize("attention", [CPU_ATTENTION, "sdpa"])
@pytest.mark.parametrize("fp8_kv", [False, True])
def test_decode_loop_runs_on_meta(profile: str, attention: str, fp8_kv: bool) -> None:
    gen = NativeGenerator(
        spec("fp8-e2e", fp8_kv_cache=fp8_kv), TOK.vocab_size, TOK.eos_id, TOK.pad_id, "meta"
    )
    gen.model.config._attn_implementation = attention
    ids, mask = left_pad([TOK.encode("1 + 2 ="), TOK.encode("30 + 4 =")] * 2, TOK.pad_id)
    with simulate(profile):
        tokens, valid, logps = gen.generate_on_device(ids.to("meta"), mask.to("meta"), 6, 0.7, 0.9, 0)
    # no early stop can be read on meta: every step runs
    assert tokens.shape == valid.shape == logps.shape == (4, 6) and tokens.device.type == "meta"


def test_greedy_decode_loop_runs_on_meta() -> None:
    """Temperature 0 (validation) takes the argmax on the device: still no read back."""
    gen = NativeGenerator(spec("fp8-e2e"), TOK.vocab_size, TOK.eos_id, TOK.pad_id, "meta")
    ids, mask = left_pad([TOK.encode("1 + 2 ="), TOK.encode("30 + 4 =")], TOK.pad_id)
    with simulate("sm90-cuda13.0"):
        tokens, valid, logps = gen.generate_on_device(ids.to("meta"), mask.to("meta"), 4, 0.0, 1.0, 0)
    assert tokens.shape == valid.shape == logps.shape == (2, 4) and tokens.device.type == "meta"


@pytest.mark.parametrize("profile", ["cpu", "sm90-cuda13.0"])
@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_train_step_runs_on_meta(profile: str, recipe: str) -> None:
    trainer = NativeTrainer(spec(recipe), TOK.vocab_size, "meta")
    ids, mask = left_pad([TOK.encode("1 + 2 =")] * 4, TOK.pad_id)
    response = torch.full((4, 5), ord("3"))
    batch = Rollouts(ids, mask, response, torch.ones(4, 5), torch.zeros(4, 5))
    with simulate(profile):
        logp_old, totals = trainer.train_step_on_device(batch, torch.tensor([1.0, 0.0, 1.0, 0.0]), 1.0)
    assert logp_old.device.type == "meta" and logp_old.shape == (4, 5)
    assert {t.device.type for t in totals.values()} == {"meta"}


def test_a_train_step_with_fused_groups_runs_on_meta() -> None:
    """The trainer's fused q/k/v and gate/up (one GEMM each way; what a GPU trainer runs) on SM90's
    kernels: no host read in the step."""
    from workers.fp8.fused import fuse_for_training

    trainer = NativeTrainer(spec("fp8-e2e"), TOK.vocab_size, "meta")
    assert fuse_for_training(trainer.model) == 2 * 2
    ids, mask = left_pad([TOK.encode("1 + 2 =")] * 4, TOK.pad_id)
    response = torch.full((4, 5), ord("3"))
    batch = Rollouts(ids, mask, response, torch.ones(4, 5), torch.zeros(4, 5))
    with simulate("sm90-cuda13.0"):
        logp_old, totals = trainer.train_step_on_device(batch, torch.tensor([1.0, 0.0, 1.0, 0.0]), 1.0)
    assert logp_old.device.type == "meta" and {t.device.type for t in totals.values()} == {"meta"}
    attn = trainer.model.model.layers[1].self_attn
    assert attn.k_proj.fused_train is not None and attn.k_proj.fp8_weight().data.device.type == "meta"

"""The Megatron trainer adapter on CPU, against a stand-in for Megatron-Core's schedule and
parallel state: its module imports without Megatron, it trains like the native trainer, and
calibrates the same K/V scales. These need no Megatron-Core (the pure half of the adapter);
test_megatron_cpu.py runs the adapter on the real Megatron-Core."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rljob import JobSpec, parse_spec
from tests.helpers import TWO_LAYER_MODEL
from tests.workers.engines.megatron.test_convert import overwriting_ce
from workers.engines.megatron.config import (
    MegatronShapes,
    megatron_state_shapes,
)
from workers.engines.megatron.convert import (
    megatron_to_hf,
)


def test_the_trainer_module_imports_without_megatron() -> None:
    """In a fresh interpreter: other tests of this session may have imported Megatron already."""
    code = (
        "import sys, workers.engines.megatron.trainer; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- the adapter on a stand-in for Megatron-Core ---------------------------------------------------
#
# Where Megatron-Core is not installed, the adapter drives a stand-in with the documented behaviour
# of the pieces it calls (fact sheet §2-5): a GPT model holding Megatron-named parameters (local
# layer spec names; computing with the Hugging Face model they map to, its padded vocabulary rows
# giving logit 0, under the causal mask the adapter passes on the CPU), BF16 wrapping with float32
# output, float32 main weights, and the no-pipelining schedule's 3-tuple loss convention
# (loss / max(num_tokens, 1) / micro-batches). One rank: tp = pp = dp = 1.


class _Config:
    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self.finalize_model_grads_func: Any = None
        self.grad_scale_func: Any = None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


def install_fake_megatron(monkeypatch: pytest.MonkeyPatch, spec: JobSpec, vocab: int) -> None:
    import types

    from torch import nn

    from workers.engines.models import build_policy

    reference = build_policy(spec, vocab, torch.float32, "cpu")
    shapes = MegatronShapes.from_hf(reference.config, layout="local")

    class CoreAttention(nn.Module):
        def forward(self, query: Any, key: torch.Tensor, value: torch.Tensor, mask: Any) -> None:
            return None  # only its pre-hooks matter here

    class ShowKv(DynamicCache):
        """Shows each layer's K (after RoPE) and V to its core attention, as [s, b, heads, d]."""

        def __init__(self, layers: Any) -> None:
            super().__init__()
            self.layers_ = layers

        def update(
            self,
            key_states: torch.Tensor,
            value_states: torch.Tensor,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # [b, heads, s, d] -> [s, b, heads, d]
            sbhd = (key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3))
            self.layers_[layer_idx].self_attention.core_attention(None, *sbhd, None)
            return key_states, value_states

    class GPTModel(nn.Module):
        def __init__(self, config: _Config, layer_spec: Any, *, vocab_size: int, **kwargs: Any) -> None:
            super().__init__()
            assert vocab_size == shapes.padded_vocab and kwargs["pre_process"] and kwargs["post_process"]
            self.decoder = nn.Module()
            self.decoder.layers = nn.ModuleList(nn.Module() for _ in range(shapes.layers))
            for name, shape in megatron_state_shapes(shapes).items():
                *path, leaf = name.split(".")
                module: nn.Module = self
                for part in path:
                    if part not in module._modules:
                        module.add_module(part, nn.Module())
                    module = module._modules[part]  # type: ignore[assignment]
                nan = torch.full(shape, float("nan"), dtype=config.params_dtype)  # every one must be loaded
                module.register_parameter(leaf, nn.Parameter(nan))
            layers: Any = self.decoder.layers
            for layer in layers:
                layer.self_attention.core_attention = CoreAttention()

        def forward(self, input_ids: torch.Tensor, position_ids: Any, attention_mask: Any) -> torch.Tensor:
            # causal only (True: hidden); positions 0..T-1 whatever position_ids say
            t = input_ids.shape[1]
            assert torch.equal(attention_mask, torch.ones(t, t, dtype=torch.bool).triu(1)[None, None])
            state = megatron_to_hf(dict(self.named_parameters()), shapes)
            inputs = {
                "input_ids": input_ids,
                "past_key_values": ShowKv(self.decoder.layers),
                "use_cache": True,
            }
            out = torch.func.functional_call(reference, state, (), inputs, strict=False)
            return F.pad(out.logits, (0, shapes.padded_vocab - shapes.vocab))  # zero rows: logit 0

    class Float16Module(nn.Module):
        def __init__(self, config: _Config, module: nn.Module) -> None:
            super().__init__()
            self.module = module.bfloat16()

        def forward(self, **kwargs: Any) -> torch.Tensor:
            return self.module(**kwargs).float()

    class DistributedDataParallel(nn.Module):
        def __init__(self, config: _Config, ddp_config: Any, module: nn.Module) -> None:
            super().__init__()
            self.config, self.module = config, module

        def forward(self, **kwargs: Any) -> torch.Tensor:
            return self.module(**kwargs)

        def zero_grad_buffer(self) -> None:
            for p in self.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)  # type: ignore[attr-defined]

    def finalize_model_grads(models: list[nn.Module], num_tokens: Any = None) -> None:
        for p in models[0].parameters():  # one replica: nothing to all-reduce
            if p.grad is not None:
                p.main_grad += p.grad.float()  # type: ignore[attr-defined]

    class Optimizer:
        def __init__(self, config: _Config, models: list[nn.Module]) -> None:
            self.config, self.params = config, list(models[0].parameters())
            for p in self.params:
                p.main_param = p.detach().float().clone()  # type: ignore[attr-defined]
            mains = [p.main_param for p in self.params]  # type: ignore[attr-defined]
            betas = (config.adam_beta1, config.adam_beta2)
            self.optimizer = torch.optim.AdamW(
                mains, lr=config.lr, betas=betas, weight_decay=config.weight_decay
            )
            self.param_groups = self.optimizer.param_groups

        def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
            return loss  # BF16: loss scale 1

        def zero_grad(self) -> None:
            for p in self.params:
                p.grad = None

        def step(self) -> tuple[bool, float, None]:
            mains = [p.main_param for p in self.params]  # type: ignore[attr-defined]
            for p, main in zip(self.params, mains, strict=True):
                main.grad = p.main_grad  # type: ignore[attr-defined]
            norm = torch.nn.utils.clip_grad_norm_(mains, self.config.clip_grad)
            self.optimizer.step()
            with torch.no_grad():
                for p, main in zip(self.params, mains, strict=True):
                    p.copy_(main)
            return True, float(norm), None

    def get_forward_backward_func() -> Any:
        def run(*, forward_step_func: Any, data_iterator: Any, model: Any, num_microbatches: int,
                seq_length: int, micro_batch_size: int, forward_only: bool = False) -> list[Any]:  # fmt: skip
            chunk, store = model[0], []
            for _ in range(num_microbatches):
                output, loss_func = forward_step_func(data_iterator, chunk)
                loss, num_tokens, reduced = loss_func(output)
                loss /= torch.clamp(num_tokens, min=1)
                loss /= num_microbatches
                store.append(reduced)
                if not forward_only:
                    torch.autograd.backward(chunk.config.grad_scale_func(loss))
            if not forward_only:
                chunk.config.finalize_model_grads_func([chunk])
            return store

        return run

    ps = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: True,
        get_tensor_model_parallel_world_size=lambda: 1,
        get_pipeline_model_parallel_world_size=lambda: 1,
        **dict.fromkeys(
            ("get_tensor_model_parallel_rank", "get_pipeline_model_parallel_rank", "get_data_parallel_rank"),
            lambda: 0,
        ),
        get_data_parallel_world_size=lambda: 1,
        **dict.fromkeys(
            ("get_tensor_model_parallel_group", "get_pipeline_model_parallel_group",
             "get_data_parallel_group", "get_model_parallel_group"),
            lambda: torch.distributed.group.WORLD,
        ),
    )  # fmt: skip
    modules = {
        "megatron.core.parallel_state": ps,
        "megatron.core.tensor_parallel": types.SimpleNamespace(
            random=types.SimpleNamespace(initialize_rng_tracker=lambda **kwargs: None),
            vocab_parallel_cross_entropy=overwriting_ce,
        ),
        "megatron.core.distributed": types.SimpleNamespace(
            DistributedDataParallel=DistributedDataParallel,
            DistributedDataParallelConfig=_Config,
            finalize_model_grads=finalize_model_grads,
        ),
        "megatron.core.models.gpt": types.SimpleNamespace(
            GPTModel=GPTModel,
            gpt_layer_specs=types.SimpleNamespace(get_gpt_layer_local_spec=lambda **kwargs: None),
        ),
        "megatron.core.optimizer": types.SimpleNamespace(
            OptimizerConfig=_Config, get_megatron_optimizer=Optimizer
        ),
        "megatron.core.transformer": types.SimpleNamespace(TransformerConfig=_Config),
        "megatron.core.transformer.module": types.SimpleNamespace(Float16Module=Float16Module),
        "megatron.core.pipeline_parallel": types.SimpleNamespace(
            get_forward_backward_func=get_forward_backward_func
        ),
    }
    core = types.SimpleNamespace(parallel_state=ps, tensor_parallel=modules["megatron.core.tensor_parallel"])
    for name, module in {
        "megatron": types.SimpleNamespace(core=core),
        "megatron.core": core,
        **modules,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def one_rank_group() -> Any:
    """A 1-rank gloo process group (the trainer actor's group of trainers)."""
    import socket

    dist = torch.distributed
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("aggregation", "minibatches"),
    [("token-mean", 1), ("seq-mean-token-mean", 2)],
    ids=["token", "seq-2mini"],
)
def test_adapter_trains_like_the_native_trainer(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any, aggregation: str, minibatches: int
) -> None:
    """Same weights, log-probs, loss, gradient norm and update direction as the native trainer
    (CPU, BF16): the loss scaling, micro-batching, right alignment and vocabulary masking."""
    from workers.engines.megatron.trainer import MegatronTrainer
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer
    from workers.models.tokenizer import ByteTokenizer
    from workers.weight_sync.payload import fp8_weight_names

    tok = ByteTokenizer()
    spec = parse_spec(
        {
            "model": {"tiny": TWO_LAYER_MODEL, "init_seed": 3},
            "precision": {"recipe": "bf16"},
            "rollout": {"group_size": 4},
            "algorithm": {"loss_aggregation": aggregation, "minibatches": minibatches},
            "optimizer": {"micro_batch_size": 3, "lr": 1e-3},  # 8 rows: micro-batches of 3, 3, 2
            "resources": {"trainer_engine": "megatron", "gpus_per_trainer": 1},
        }
    )
    install_fake_megatron(monkeypatch, spec, tok.vocab_size)
    native = NativeTrainer(spec, tok.vocab_size)
    meg = MegatronTrainer(spec, tok.vocab_size, "cpu")
    start = meg.state_dict()["model"]
    assert start.keys() == native.model.state_dict().keys()
    assert all(torch.equal(v, native.model.state_dict()[k]) for k, v in start.items())
    gen = NativeGenerator(spec, tok.vocab_size, tok.eos_id, tok.pad_id)
    gen.load_weights(meg.export_weights(fp8_weight_names(gen.model)))
    prompts = [tok.encode(p) for p in ("1+1=", "12+345=", "Calculate 7 + 8. ", "9*9=")] * 2
    batch = gen.generate(prompts, 6, 1.0, 1.0, 0)
    mask = batch.response_mask
    lp = meg.logprobs(batch, 0.9)
    assert float(((lp - native.logprobs(batch, 0.9)).abs() * mask).max()) < 1e-2
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    ours, theirs = meg.train_step(batch, rewards, 1.0), native.train_step(batch, rewards, 1.0)
    assert ours.stats.keys() == theirs.stats.keys()
    assert ours.stats["train/tokens"] == theirs.stats["train/tokens"] == float(mask.sum())
    for key in ("train/loss", "is/weight_mean", "train/advantage_abs_mean"):
        assert abs(ours.stats[key] - theirs.stats[key]) < 1e-3, key
    # a wrong loss scale (micro-batches, minibatch units) would move the norm by a whole factor
    assert abs(ours.stats["train/grad_norm"] / theirs.stats["train/grad_norm"] - 1) < 0.02
    assert float(((ours.logprobs_old - theirs.logprobs_old).abs() * mask).max()) < 1e-2
    after, native_after = meg.state_dict()["model"], native.model.state_dict()
    moved = agree = 0
    for name, w in after.items():
        big = (native_after[name] - start[name]).abs() > 0.5 * spec.optimizer.lr
        moved += int(big.sum())
        agree += int((torch.sign(w - start[name]) == torch.sign(native_after[name] - start[name]))[big].sum())
    assert moved > 0 and agree / moved > 0.98, (agree, moved)
    payload = meg.export_weights(())
    assert all(torch.equal(payload[k], v.to(torch.bfloat16)) for k, v in after.items())
    assert abs(meg.sft_step(batch) - native.sft_step(batch)) < 1e-2


def test_adapter_kv_scales_match_the_native_calibration(
    monkeypatch: pytest.MonkeyPatch, one_rank_group: Any
) -> None:
    """The K/V scales sent to vLLM: those the native calibration
    (:mod:`workers.engines.native.kv_calibration`, real tokens of left-padded rows) computes on the
    trainer's updated weights."""
    from workers.engines.megatron.trainer import MegatronTrainer
    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.kv_calibration import kv_scale_payload, observe_kv
    from workers.engines.native.trainer import NativeTrainer
    from workers.fp8.kv_cache import KvScaleCalibrator
    from workers.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    data: dict[str, Any] = {
        "model": {"tiny": TWO_LAYER_MODEL, "init_seed": 4},
        "precision": {"recipe": "bf16"},
        "rollout": {"group_size": 4},
        "optimizer": {"micro_batch_size": 3},
    }
    plain = parse_spec(data)
    spec = parse_spec(
        {
            **data,
            "precision": {"recipe": "bf16", "fp8_kv_cache": True},
            "resources": {"trainer_engine": "megatron", "gpus_per_trainer": 1, "generator_engine": "vllm",
                          "gpus_per_generator": 1},
        }
    )  # fmt: skip
    install_fake_megatron(monkeypatch, spec, tok.vocab_size)
    meg = MegatronTrainer(spec, tok.vocab_size, "cpu")
    gen = NativeGenerator(plain, tok.vocab_size, tok.eos_id, tok.pad_id)
    before = meg.export_weights(())  # nothing calibrated yet: every scale 1.0
    assert all(float(v) == 1.0 for k, v in before.items() if k.endswith(("k_scale", "v_scale")))
    gen.load_weights({k: v for k, v in before.items() if not k.endswith(("k_scale", "v_scale"))})
    batch = gen.generate(
        [tok.encode(p) for p in ("1+1=", "12+345=", "Calculate 7 + 8. ", "9*9=")], 6, 1.0, 1.0, 0
    )
    meg.train_step(batch, torch.tensor([1.0, 0.0, 0.0, 1.0]), 1.0)
    payload = meg.export_weights(())
    native = NativeTrainer(plain, tok.vocab_size)
    native.model.load_state_dict(meg.state_dict()["model"])  # the updated weights
    calibrator = KvScaleCalibrator(2)
    observe_kv(native.model, batch, calibrator, 3)
    expected = kv_scale_payload(calibrator.scales())
    assert expected.keys() <= payload.keys()
    for name, scale in expected.items():
        assert payload[name].dim() == 0 and payload[name].dtype == torch.float32
        torch.testing.assert_close(payload[name], scale, rtol=2e-2, atol=0)

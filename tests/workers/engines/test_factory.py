"""Engine factories, refusals that name what to do, and where actors go on one shared GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob import JobSpec, SpecError, parse_spec
from tests.helpers import TINY_MODEL
from workers.engines import factory
from workers.engines.factory import (
    EngineUnavailable,
    build_generator,
    build_trainer,
    check_engines,
    engine_for,
)
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TINY = {"tiny": TINY_MODEL}


def gpu_spec(engine: str) -> JobSpec:
    """A job on ``engine``; BF16, since the tiny model has no whole 128x128 FP8 blocks for vLLM."""
    field = "generator_engine" if engine == "vllm" else "trainer_engine"
    return parse_spec(
        {
            "model": TINY,
            "precision": {"recipe": "bf16"},
            "resources": {field: engine, "gpus_per_generator": 1, "gpus_per_trainer": 1},
        }
    )


def test_native_engines_by_default() -> None:
    spec = parse_spec({"model": TINY})
    check_engines(spec)
    gen = build_generator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id)
    trainer = build_trainer(spec, TOK.vocab_size)
    assert isinstance(gen, NativeGenerator) and isinstance(trainer, NativeTrainer)
    # what the actors call, through the protocols
    assert gen.fp8_weight_names() and gen.weight_bytes > 0 and gen.audit.rows
    assert trainer.weight_bytes > 0 and trainer.audit.rows


@pytest.mark.parametrize(
    "engine,role,field,packages",
    [
        ("vllm", "generator", "generator_engine", ["vllm"]),
        ("megatron", "trainer", "trainer_engine", ["megatron-core", "transformer-engine[pytorch]"]),
    ],
)
def test_a_missing_engine_names_the_package_and_the_image(
    engine: str, role: str, field: str, packages: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factory, "_installed", lambda module: False)
    spec = gpu_spec(engine)
    assert engine_for(spec, role) == engine
    other = "trainer" if role == "generator" else "generator"
    assert engine_for(spec, other) == "native"
    with pytest.raises(EngineUnavailable) as info:
        check_engines(spec)
    message = str(info.value)
    assert f"resources.{field}={engine}" in message and "worker image" in message
    assert all(p in message for p in packages) and f"resources.{field}=native" in message
    with pytest.raises(EngineUnavailable):
        if role == "generator":
            build_generator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id)
        else:
            build_trainer(spec, TOK.vocab_size)


def test_megatron_on_the_cpu_needs_megatron_core_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU Megatron-Core runs its local layer spec: Transformer Engine (CUDA only) is not
    asked for."""
    spec = parse_spec(
        {"model": TINY, "precision": {"recipe": "bf16"}, "resources": {"trainer_engine": "megatron"}}
    )
    monkeypatch.setattr(factory, "_installed", lambda module: module != "transformer_engine")
    check_engines(spec)
    monkeypatch.setattr(factory, "_installed", lambda module: False)
    with pytest.raises(EngineUnavailable) as info:
        check_engines(spec)
    assert "megatron-core" in str(info.value) and "transformer-engine" not in str(info.value)


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_adapters_are_not_imported_with_workers() -> None:
    import subprocess
    import sys

    code = (
        "import sys, workers.job.driver, workers.job.actor_group, workers.rl.protocol, workers.rl.step, "
        "workers.job.ray_workers, workers.engines.factory; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'megatron', 'transformer_engine') "
        "or m in ('workers.engines.vllm.generator', 'workers.engines.megatron.trainer', "
        "'workers.engines.megatron.model', 'workers.engines.megatron.schedule', "
        "'workers.engines.megatron.kv')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_share_gpu_needs_one_gpu_per_actor() -> None:
    with pytest.raises(SpecError, match="share_gpu needs gpus_per_generator: 1 and gpus_per_trainer: 1"):
        parse_spec({"resources": {"share_gpu": True}})


def test_share_gpu_splits_the_gpu_and_uses_gloo() -> None:
    from workers.job.ray_cluster import actor_options, collective_backend

    shared = parse_spec(
        {"resources": {"share_gpu": True, "gpus_per_generator": 1, "gpus_per_trainer": 1, "trainers": 3}}
    )
    assert actor_options(shared, "training")["num_gpus"] == 0.25  # 3 trainers + 1 generator
    assert actor_options(shared, "generation")["num_gpus"] == 0.25
    assert collective_backend(shared) == "gloo"  # NCCL refuses two ranks on one GPU
    tp2 = {"generator_engine": "vllm", "gpus_per_generator": 2, "generator_tensor_parallel_size": 2}
    own = parse_spec({"resources": {**tp2, "gpus_per_trainer": 1}})
    assert collective_backend(own) == "nccl" and actor_options(own, "generation")["num_gpus"] == 2
    assert collective_backend(parse_spec({})) == "gloo"  # CPUs


def test_cpu_actors_start_with_glibc_malloc_tunables_and_gpu_actors_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workers.job.ray_cluster import CPU_MALLOC_TUNABLES, actor_options

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("FP8RL_CPU_MALLOC", raising=False)
    cpu = parse_spec({})
    want = {"env_vars": {"GLIBC_TUNABLES": CPU_MALLOC_TUNABLES}}
    assert actor_options(cpu, "training")["runtime_env"] == want
    assert actor_options(cpu, "generation")["runtime_env"] == want
    gpu = parse_spec({"resources": {"gpus_per_generator": 1}})  # a GPU generator, a CPU trainer
    assert "runtime_env" not in actor_options(gpu, "generation")
    assert actor_options(gpu, "training")["runtime_env"] == want
    shared = parse_spec({"resources": {"share_gpu": True, "gpus_per_generator": 1, "gpus_per_trainer": 1}})
    assert "runtime_env" not in actor_options(shared, "training")
    monkeypatch.setenv("FP8RL_CPU_MALLOC", "default")  # off: glibc's own settings
    assert "runtime_env" not in actor_options(cpu, "training")
    monkeypatch.setenv("FP8RL_CPU_MALLOC", "tuned")
    monkeypatch.setenv(
        "GLIBC_TUNABLES", "glibc.malloc.arena_max=2"
    )  # the user's own: inherited, not replaced
    assert "runtime_env" not in actor_options(cpu, "training")
    monkeypatch.setenv("FP8RL_CPU_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="FP8RL_CPU_MALLOC='jemalloc': use tuned"):
        actor_options(cpu, "training")


def test_a_model_the_engines_cannot_run_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factory, "_installed", lambda module: True)  # the packages are not the problem
    # head_dim 32 with 2 KV heads: k_proj has 64 rows, not a whole 128-row block for vLLM
    small = parse_spec(
        {
            "model": {"tiny": {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}},
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1},
        }
    )
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.*64"):
        check_engines(small)
    small.precision.recipe = "bf16"  # no FP8 layer in vLLM: nothing to refuse
    check_engines(small)
    # a sliding-window model for Megatron, read from its config only
    from transformers import Qwen2Config

    Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=64,
    ).save_pretrained(tmp_path)
    sliding = parse_spec(
        {
            "model": {"name": str(tmp_path), "pretrained": False},
            "tokenizer": {"kind": "bytes"},
            "resources": {"trainer_engine": "megatron", "gpus_per_trainer": 1},
        }
    )
    with pytest.raises(ValueError, match=r"sliding-window attention.*trainer_engine: native"):
        check_engines(sliding)

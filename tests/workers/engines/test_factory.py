"""Engine factories, refusals that name what to do, and where actors go on one shared GPU."""

from __future__ import annotations

import pytest

from rljob import JobSpec, SpecError, parse_spec
from workers.engines import factory
from workers.engines.factory import (
    EngineUnavailable,
    build_generator,
    build_trainer,
    check_engines,
    engine_for,
)
from workers.engines.native_generator import NativeGenerator
from workers.engines.native_trainer import NativeTrainer
from workers.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TINY = {
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
}


def gpu_spec(engine: str) -> JobSpec:
    return parse_spec({"model": TINY, "resources": {"engine": engine, "gpus_per_generator": 1}})


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
    "engine,role,packages",
    [
        ("vllm", "generator", ["vllm"]),
        ("megatron", "trainer", ["megatron-core", "transformer-engine[pytorch]"]),
    ],
)
def test_a_missing_engine_names_the_package_and_the_image(
    engine: str, role: str, packages: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(factory, "_installed", lambda module: False)
    spec = gpu_spec(engine)
    assert engine_for(spec, role) == engine
    other = "trainer" if role == "generator" else "generator"
    assert engine_for(spec, other) == "native"
    with pytest.raises(EngineUnavailable) as info:
        check_engines(spec)
    message = str(info.value)
    assert f"resources.engine={engine}" in message and "worker image" in message
    assert all(p in message for p in packages) and "resources.engine=native" in message
    with pytest.raises(EngineUnavailable):
        if role == "generator":
            build_generator(spec, TOK.vocab_size, TOK.eos_id, TOK.pad_id)
        else:
            build_trainer(spec, TOK.vocab_size)


def test_an_installed_engine_without_an_adapter_is_refused_not_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(factory, "_installed", lambda module: True)
    with pytest.raises(EngineUnavailable, match="no vllm generator adapter yet"):
        check_engines(gpu_spec("vllm"))


def test_share_gpu_needs_one_gpu_per_actor() -> None:
    with pytest.raises(SpecError, match="share_gpu needs gpus_per_generator: 1 and gpus_per_trainer: 1"):
        parse_spec({"resources": {"share_gpu": True}})


def test_share_gpu_splits_the_gpu_and_uses_gloo() -> None:
    from workers.driver import actor_options, collective_backend

    shared = parse_spec(
        {"resources": {"share_gpu": True, "gpus_per_generator": 1, "gpus_per_trainer": 1, "trainers": 3}}
    )
    assert actor_options(shared, "training")["num_gpus"] == 0.25  # 3 trainers + 1 generator
    assert actor_options(shared, "generation")["num_gpus"] == 0.25
    assert collective_backend(shared) == "gloo"  # NCCL refuses two ranks on one GPU
    own = parse_spec({"resources": {"gpus_per_generator": 1, "gpus_per_trainer": 2}})
    assert collective_backend(own) == "nccl" and actor_options(own, "training")["num_gpus"] == 2
    assert collective_backend(parse_spec({})) == "gloo"  # CPUs

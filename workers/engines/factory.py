"""Engine factories: the one place that turns the spec's engines into a generator and a trainer.

Actors and benchmarks call :func:`build_generator` / :func:`build_trainer` and use the result
through the :class:`~workers.engines.protocols.Generator` / ``Trainer`` protocols, so nothing else
branches on the engine.

- ``resources.generator_engine``: ``native`` (the torch generator of this package, CPU or GPU) or
  ``vllm`` (:mod:`workers.engines.vllm.generator`);
- ``resources.trainer_engine``: ``native`` (CPU or GPU) or ``megatron`` (Megatron-Core +
  Transformer Engine on GPUs, Megatron-Core alone on the CPU, :mod:`workers.engines.megatron.trainer`).

An engine whose packages are not installed fails when the job starts (:func:`check_engines`,
called by the driver before Ray does any work) with a message naming the field, the missing
package and the image that has it. It never falls back to the native engine silently. The
adapters are imported only here, lazily: ``import workers`` needs neither vLLM nor Megatron.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from rljob.spec import JobSpec
from workers.engines.batching import StopIds
from workers.engines.protocols import Generator, Trainer

if TYPE_CHECKING:
    import torch

    from workers.engines.native.generator import NativeGenerator
    from workers.engines.native.trainer import NativeTrainer

# engine -> (the spec field that selects it, [(import name, pip package)])
ENGINES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "vllm": ("generator_engine", [("vllm", "vllm")]),
    "megatron": (
        "trainer_engine",
        [("megatron.core", "megatron-core"), ("transformer_engine", "transformer-engine[pytorch]")],
    ),
}
WORKER_IMAGE = "the fp8rl GPU worker image (docker/worker.Dockerfile; the chart's image.worker)"


class EngineUnavailable(RuntimeError):
    """The job asks for an engine this installation cannot run."""


def engine_for(spec: JobSpec, role: str) -> str:
    """The engine that serves ``role`` (``generator`` | ``trainer``): native, vllm or megatron."""
    if role == "generator":
        return spec.resources.generator_engine
    if role == "trainer":
        return spec.resources.trainer_engine
    raise ValueError(f"role {role!r}: expected generator or trainer")


def check_model(spec: JobSpec) -> None:
    """Refuse, before anything starts, a job the chosen engines cannot run (ValueError naming the
    layer or field and what to change): vLLM's limits on GPU and CPU
    (:func:`workers.engines.vllm.config.check_vllm`), Megatron's supported models. Reads the
    model's config only (no weights)."""
    if engine_for(spec, "generator") == "native" and engine_for(spec, "trainer") == "native":
        return
    from workers.engines.models import model_config

    hf_config = model_config(spec, 256)  # the vocabulary does not change any checked shape
    if engine_for(spec, "generator") == "vllm":
        from workers.engines.vllm.config import check_vllm

        check_vllm(hf_config, spec)
    if engine_for(spec, "trainer") == "megatron":
        from workers.engines.megatron.config import check_supported

        check_supported(hf_config)


def check_engines(spec: JobSpec) -> None:
    """Raise :class:`EngineUnavailable` unless every engine the job asks for can run here (and
    ValueError for a model they cannot run: :func:`check_model`)."""
    check_model(spec)
    for role in ("generator", "trainer"):
        engine = engine_for(spec, role)
        if engine == "native":
            continue
        field, packages = ENGINES[engine]
        if engine == "megatron" and spec.resources.gpus_per_trainer == 0:
            # on the CPU Megatron-Core runs its local layer spec: Transformer Engine needs CUDA
            packages = [(module, pkg) for module, pkg in packages if module != "transformer_engine"]
        missing = [pkg for module, pkg in packages if not _installed(module)]
        if missing:
            raise EngineUnavailable(
                f"resources.{field}={engine}: the {role} engine needs {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed here. Run the job in "
                f"{WORKER_IMAGE}, which has it, or set resources.{field}=native."
            )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def build_generator(
    spec: JobSpec,
    vocab_size: int,
    eos: StopIds,
    pad_id: int,
    device: str = "cpu",
    max_prompt_tokens: int | None = None,
) -> Generator:
    """The generator the spec asks for, on ``device``. ``max_prompt_tokens`` (the job's longest
    prompt) sizes vLLM's sequences and KV cache; None: as long as the model allows. ``eos``: the
    id, or every id, that ends a response (the tokenizer's ``eos_ids``)."""
    if engine_for(spec, "generator") == "vllm":
        check_engines(spec)
        from workers.engines.vllm.generator import VllmGenerator

        return VllmGenerator(spec, vocab_size, eos, pad_id, device, max_prompt_tokens)
    from workers.engines.native.generator import NativeGenerator

    return NativeGenerator(spec, vocab_size, eos, pad_id, device)


def build_trainer(
    spec: JobSpec, vocab_size: int, device: str = "cpu", dp_group: object = None, rank: int = 0
) -> Trainer:
    """The trainer the spec asks for, on ``device`` (``dp_group``: the native trainers'
    data-parallel group; ``rank``: this trainer's rank among the trainers, for Megatron)."""
    if engine_for(spec, "trainer") == "megatron":
        check_engines(spec)
        from workers.engines.megatron.trainer import MegatronTrainer

        return MegatronTrainer(spec, vocab_size, device, rank)
    from workers.engines.native.trainer import NativeTrainer

    return NativeTrainer(spec, vocab_size, device, dp_group)


def native_trainer(
    spec: JobSpec, vocab_size: int, state: dict[str, torch.Tensor] | None = None, device: str = "cpu"
) -> NativeTrainer:
    """A native trainer holding the master weights ``state`` (None: the spec's initial ones)."""
    from workers.engines.native.trainer import NativeTrainer

    trainer = NativeTrainer(spec, vocab_size, device)
    if state is not None:
        try:
            trainer.model.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"--checkpoint: its weights do not fit the spec's model ({err})") from None
    return trainer


def native_pair(
    spec: JobSpec,
    vocab_size: int,
    eos: StopIds,
    pad_id: int,
    state: dict[str, torch.Tensor] | None = None,
    device: str = "cpu",
) -> tuple[NativeTrainer, NativeGenerator]:
    """:func:`native_trainer` and a native generator loaded from it, as after a weight sync: the
    pair the offline tools (``bench mismatch``, ``bench gradients``) run."""
    trainer = native_trainer(spec, vocab_size, state, device)
    return trainer, native_generator(spec, trainer, vocab_size, eos, pad_id, device)


def native_generator(
    spec: JobSpec, trainer: NativeTrainer, vocab_size: int, eos: StopIds, pad_id: int, device: str = "cpu"
) -> NativeGenerator:
    """A native generator built from ``spec`` and loaded from ``trainer``, as after a weight sync."""
    from workers.engines.native.generator import NativeGenerator
    from workers.weight_sync.payload import fp8_weight_names

    gen = NativeGenerator(spec, vocab_size, eos, pad_id, device)
    gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
    return gen

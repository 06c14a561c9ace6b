"""Engine factories: the one place that turns ``resources.engine`` into a generator and a trainer.

Actors and benchmarks call :func:`build_generator` / :func:`build_trainer` and use the result
through the :class:`~workers.engines.protocols.Generator` / ``Trainer`` protocols, so nothing else
branches on the engine. ``resources.engine``:

- ``native``: the torch engines of this package, for generation and training (CPU or GPU);
- ``vllm``: vLLM generation (native training);
- ``megatron``: Megatron-Core + Transformer Engine training (native generation).

An engine whose packages are not installed fails when the job starts (:func:`check_engines`,
called by the driver before Ray does any work) with a message naming the engine, the missing
package and the image that has it. It never falls back to the native engine silently.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from rljob.spec import JobSpec
from workers.engines.protocols import Generator, Trainer

if TYPE_CHECKING:
    import torch

    from workers.engines.native_generator import NativeGenerator
    from workers.engines.native_trainer import NativeTrainer

# engine -> (role it serves, [(import name, pip package)])
ENGINES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "vllm": ("generator", [("vllm", "vllm")]),
    "megatron": (
        "trainer",
        [("megatron.core", "megatron-core"), ("transformer_engine", "transformer-engine[pytorch]")],
    ),
}
WORKER_IMAGE = "the fp8rl GPU worker image (docker/worker.Dockerfile; the chart's image.worker)"


class EngineUnavailable(RuntimeError):
    """The job asks for an engine this installation cannot run."""


def engine_for(spec: JobSpec, role: str) -> str:
    """``native``, ``vllm`` or ``megatron``: the engine that serves ``role`` (generator|trainer)."""
    engine = spec.resources.engine
    return engine if engine != "native" and ENGINES[engine][0] == role else "native"


def check_engines(spec: JobSpec) -> None:
    """Raise :class:`EngineUnavailable` unless every engine the job asks for can run here."""
    engine = spec.resources.engine
    if engine == "native":
        return
    role, packages = ENGINES[engine]
    missing = [pkg for module, pkg in packages if not _installed(module)]
    if missing:
        raise EngineUnavailable(
            f"resources.engine={engine}: the {role} engine needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed here. Run the job in {WORKER_IMAGE}, "
            "which has it, or set resources.engine=native."
        )
    raise EngineUnavailable(
        f"resources.engine={engine}: {', '.join(p for _, p in packages)} installed, but this fp8rl "
        f"release has no {engine} {role} adapter yet; set resources.engine=native."
    )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def build_generator(
    spec: JobSpec, vocab_size: int, eos_id: int, pad_id: int, device: str = "cpu"
) -> Generator:
    """The generator the spec asks for, on ``device``."""
    if engine_for(spec, "generator") != "native":
        check_engines(spec)
    from workers.engines.native_generator import NativeGenerator

    return NativeGenerator(spec, vocab_size, eos_id, pad_id, device)


def build_trainer(spec: JobSpec, vocab_size: int, device: str = "cpu", dp_group: object = None) -> Trainer:
    """The trainer the spec asks for, on ``device`` (``dp_group``: the data-parallel group)."""
    if engine_for(spec, "trainer") != "native":
        check_engines(spec)
    from workers.engines.native_trainer import NativeTrainer

    return NativeTrainer(spec, vocab_size, device, dp_group)


def native_trainer(
    spec: JobSpec, vocab_size: int, state: dict[str, torch.Tensor] | None = None, device: str = "cpu"
) -> NativeTrainer:
    """A native trainer holding the master weights ``state`` (None: the spec's initial ones)."""
    from workers.engines.native_trainer import NativeTrainer

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
    eos_id: int,
    pad_id: int,
    state: dict[str, torch.Tensor] | None = None,
    device: str = "cpu",
) -> tuple[NativeTrainer, NativeGenerator]:
    """:func:`native_trainer` and a native generator loaded from it, as after a weight sync: the
    pair the offline tools (``bench mismatch``, ``bench gradients``) run."""
    from workers.engines.native_generator import NativeGenerator
    from workers.fp8.export import fp8_weight_names

    trainer = native_trainer(spec, vocab_size, state, device)
    gen = NativeGenerator(spec, vocab_size, eos_id, pad_id, device)
    gen.load_weights(trainer.export_weights(fp8_weight_names(gen.model)))
    return trainer, gen

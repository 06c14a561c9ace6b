"""Ray actor shells around the engines: the only place where engines meet Ray and torch.distributed.

Each actor joins the job's process group and the weights' transport as
:mod:`workers.weight_sync.transport` says (the one module that chooses it): the native pair's
broadcast over the job's group, or the weight channel of a job with vLLM or Megatron-Core, which
trainer 0 and the generators open after setup (:meth:`TrainerWorker.join_weight_channel`).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from rljob.spec import JobSpec
from workers.engines.factory import build_generator, build_trainer
from workers.engines.protocols import Generator, Rollouts, Trainer, TrainStats
from workers.rl.faults import provoke
from workers.rl.protocol import Generated
from workers.weight_sync import transport
from workers.weight_sync.broadcast import CollectiveWeightSync
from workers.weight_sync.contract import kv_cache_dtype, sent_report


def _threads(spec: JobSpec) -> None:
    torch.set_num_threads(spec.resources.threads(os.cpu_count() or 1))


def _device(gpus: int) -> str:
    if gpus > 0 and torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray shows each actor its own GPUs, numbered from 0
        return "cuda"
    return "cpu"


class _Member:
    """What trainers and generators share: their rank and the communicator."""

    def __init__(self, spec_json: str, rank: int, world_size: int) -> None:
        self.spec = JobSpec.model_validate_json(spec_json)
        self.rank, self.world_size = rank, world_size
        self.sync: CollectiveWeightSync | None = None
        self.dp_group: Any = None
        self.armed: str | None = None  # a fault drill for this actor's next step call (workers.rl.faults)
        _threads(self.spec)

    def arm_fault(self, kind: str) -> None:
        """Provoke fault drill ``kind`` inside the next ``generate`` / ``train_step``."""
        self.armed = kind

    def _drill(self, engine: Any) -> None:
        kind, self.armed = self.armed, None
        if kind is not None:
            provoke(kind, engine)

    def free_address(self) -> str:
        """A ``tcp://ip:port`` on this node for the process group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return f"tcp://{ip}:{port}"

    def _join(self, init_method: str, backend: str) -> None:
        joined = transport.join(self.spec, self.rank, self.world_size, init_method, backend)
        self.sync, self.dp_group = joined.sync, joined.dp_group


class TrainerWorker(_Member):
    def __init__(self, spec_json: str, rank: int, world_size: int, vocab_size: int) -> None:
        super().__init__(spec_json, rank, world_size)
        self.vocab_size = vocab_size

    def setup(self, init_method: str, backend: str) -> dict[str, Any]:
        device = _device(self.spec.resources.gpus_per_trainer)
        self._join(init_method, backend)
        self.engine: Trainer = build_trainer(self.spec, self.vocab_size, device, self.dp_group, self.rank)
        return {**self.engine.audit.to_dict(), "table": self.engine.audit.format()}

    def join_weight_channel(self, address: str, world_size: int) -> None:
        """Trainer 0 opens the NCCL weight channel as its sender (rank 0)."""
        if self.rank == 0:
            self.sync = transport.open_sender(address, world_size, self.engine.device)

    def sft_step(self, batch: Rollouts) -> float:
        return self.engine.sft_step(batch)

    def calibrate_kv(self, batch: Rollouts) -> None:
        self.engine.calibrate_kv(batch)

    def train_step(self, batch: Rollouts, rewards: torch.Tensor) -> TrainStats:
        self._drill(self.engine)
        return self.engine.train_step(batch, rewards, self.spec.rollout.temperature)

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-module outputs for one token, the trainer's way (:mod:`workers.engines.layer_diff`)."""
        return self.engine.trace_token(prompt, response)

    def send_weights(self, fp8_names: list[str]) -> dict[str, Any]:
        """Every trainer exports (Megatron gathers its shards to rank 0); trainer 0 sends, and
        reports what it sent (:func:`~workers.weight_sync.contract.sent_report`)."""
        payload = self.engine.export_weights(fp8_names)
        if self.rank != 0:
            return {}
        assert self.sync is not None
        result = self.sync.sync_weights(payload)
        report = sent_report(payload, kv_cache_dtype(self.spec.precision.fp8_kv_cache))
        return {"bytes": result.bytes, "seconds": result.seconds, "version": result.version, "report": report}

    def save(self, directory: str) -> None:
        """Every trainer takes part (Megatron gathers); trainer 0 writes ``trainer.pt``."""
        state = self.engine.state_dict()
        if self.rank == 0:
            torch.save(state, Path(directory) / "trainer.pt")

    def load(self, directory: str) -> None:
        state = torch.load(Path(directory) / "trainer.pt", map_location=self.engine.device, weights_only=True)
        self.engine.load_state_dict(state)


class GeneratorWorker(_Member):
    def __init__(
        self,
        spec_json: str,
        rank: int,
        world_size: int,
        vocab_size: int,
        eos_ids: list[int],
        pad_id: int,
        max_prompt_tokens: int | None = None,
    ) -> None:
        super().__init__(spec_json, rank, world_size)
        self.vocab_size, self.eos_ids, self.pad_id = vocab_size, eos_ids, pad_id
        self.max_prompt_tokens = max_prompt_tokens

    def setup(self, init_method: str, backend: str) -> dict[str, Any]:
        device = _device(self.spec.resources.gpus_per_generator)
        self._join(init_method, backend)
        self.engine: Generator = build_generator(
            self.spec, self.vocab_size, self.eos_ids, self.pad_id, device, self.max_prompt_tokens
        )
        return {**self.engine.audit.to_dict(), "table": self.engine.audit.format()}

    def fp8_weight_names(self) -> list[str]:
        """The weights this generator holds in FP8 (what the trainer must send as FP8)."""
        return self.engine.fp8_weight_names()

    def join_weight_channel(self, address: str, first_rank: int, world_size: int) -> None:
        """Join the NCCL weight channel (vLLM or Megatron jobs) as ranks ``first_rank..``."""
        self.engine.join_weight_channel(address, first_rank, world_size)

    def receive_weights(self) -> dict[str, Any]:
        """Receive one version; report what the generator now holds (the precision contract)."""
        result = transport.receive(self.engine, self.sync)
        return {
            "bytes": result.bytes,
            "seconds": result.seconds,
            "version": result.version,
            "report": self.engine.weight_report(),
        }

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-module outputs for one token, the generator's way
        (:mod:`workers.engines.layer_diff`)."""
        return self.engine.trace_token(prompt, response)

    def generate(self, prompts: list[list[int]], seed: int, temperature: float | None = None) -> Generated:
        """Rollouts, and the bytes this generator holds: KV cache (at the end) and weights.

        ``temperature`` overrides ``rollout.temperature`` (validation; 0 = greedy)."""
        r = self.spec.rollout
        temp = r.temperature if temperature is None else temperature
        started = time.time()
        self._drill(self.engine)
        out = self.engine.generate(prompts, r.max_new_tokens, temp, r.top_p, seed)
        return Generated(out, self.engine.kv_cache_bytes, self.engine.weight_bytes, started, time.time())


class ModelGraderWorker:
    """A ``model`` grader's model on an actor of its own (``workers.tasks.model_scorer``): its
    memory and CPU (or GPU) time are not the driver's."""

    def __init__(self, grader_json: str, gpus: int) -> None:
        from pydantic import TypeAdapter

        from rljob.graders import ModelGrader
        from workers.tasks.model_scorer import ModelScorer

        grader = TypeAdapter(ModelGrader).validate_json(grader_json)
        self.scorer = ModelScorer(grader, _device(gpus))

    def score(self, texts: list[str]) -> list[float | None]:
        return self.scorer.score(texts)

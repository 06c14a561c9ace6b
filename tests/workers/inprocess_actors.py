"""The step's actors in this one process, without Ray: :class:`InProcessActors` implements
:class:`~workers.rl.protocol.StepActors` over one native trainer and ``G`` native generators, so
the tests run :mod:`workers.rl.step` as the driver does, minus the transport.

What the Ray actors run concurrently runs here one after another (one trainer: no data-parallel
group to all-reduce over); ``start_generate`` generates at once, with the weights the generators
hold then, as a Ray generator does before any call made after it. The weight sync is the wire
format without its collective: trainer 0's export is packed into the same uint8 buckets by the same manifest
(:mod:`workers.weight_sync.broadcast`), and each generator loads what it unpacks from them, so the bytes a
generator computes with went through exactly what a broadcast moves; only ``torch.distributed``
is left out (``tests/workers/weight_sync/test_broadcast.py`` runs the broadcast itself over gloo).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from rljob.spec import JobSpec
from workers.engines.layer_diff import Trace
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.trainer import NativeTrainer
from workers.engines.protocols import Rollouts, TrainStats
from workers.models.tokenizer import Tokenizer
from workers.rl.protocol import Generated, WeightTransfer
from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES, manifest_of, pack, unpack
from workers.weight_sync.contract import kv_cache_dtype, sent_report


class Done:
    """A generation already done (:class:`~workers.rl.protocol.PendingRollouts`)."""

    def __init__(self, out: list[Generated]) -> None:
        self.out = out

    def result(self) -> list[Generated]:
        return self.out


class InProcessActors:
    """One native trainer and ``spec.resources.generators`` native generators on the CPU."""

    def __init__(self, spec: JobSpec, tok: Tokenizer, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        res = spec.resources
        if res.trainers != 1 or res.trainer_engine != "native" or res.generator_engine != "native":
            raise ValueError("in-process actors: one native trainer and native generators only")
        self.spec, self.bucket_bytes = spec, bucket_bytes
        self.trainer = NativeTrainer(spec, tok.vocab_size, "cpu")
        self.generators = [
            NativeGenerator(spec, tok.vocab_size, tok.eos_ids, tok.pad_id, "cpu")
            for _ in range(res.generators)
        ]
        self.fp8_names = self.generators[0].fp8_weight_names()

    @property
    def num_trainers(self) -> int:
        return 1

    @property
    def num_generators(self) -> int:
        return len(self.generators)

    def generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> list[Generated]:
        return self.start_generate(chunks, seeds, temperature).result()

    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> Done:
        r = self.spec.rollout
        temp = r.temperature if temperature is None else temperature
        out = []
        for g, chunk, seed in zip(self.generators, chunks, seeds, strict=True):
            if chunk:
                started = time.time()
                rollouts = g.generate(chunk, r.max_new_tokens, temp, r.top_p, seed)
                out.append(Generated(rollouts, g.kv_cache_bytes, g.weight_bytes, started, time.time()))
        return Done(out)

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> list[TrainStats]:
        (part,), (reward,) = parts, rewards
        # an ExactMismatchError leaves as raised: trainer_index 0, the one trainer
        return [self.trainer.train_step(part, reward, self.spec.rollout.temperature)]

    def sft_step(self, parts: list[Rollouts]) -> float:
        (part,) = parts
        return self.trainer.sft_step(part)

    def calibrate_kv(self, parts: list[Rollouts]) -> None:
        (part,) = parts
        self.trainer.calibrate_kv(part)

    def trace_token(self, trainer: int, prompt: torch.Tensor, response: torch.Tensor) -> tuple[Trace, Trace]:
        assert trainer == 0
        return self.generators[0].trace_token(prompt, response), self.trainer.trace_token(prompt, response)

    def send_and_receive_weights(self) -> WeightTransfer:
        payload = self.trainer.export_weights(self.fp8_names)
        manifest = manifest_of(payload)
        buckets = pack(payload, manifest, self.bucket_bytes)
        for g in self.generators:  # each unpacks its own copy, as each receiver of a broadcast does
            g.load_weights(unpack(buckets, manifest, self.bucket_bytes))
        report = sent_report(payload, kv_cache_dtype(self.spec.precision.fp8_kv_cache))
        nbytes = sum(b.numel() for b in buckets)
        return WeightTransfer(nbytes, report, [g.weight_report() for g in self.generators])

    def save(self, directory: Path) -> None:
        torch.save(self.trainer.state_dict(), Path(directory) / "trainer.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(Path(directory) / "trainer.pt", map_location="cpu", weights_only=True)
        self.trainer.load_state_dict(state)

"""What the CPU tests of the real vLLM engine share: the tiny job, a running generator that is shut
down afterwards (with any process vLLM left), and trainer 0's end of the weight channel, run on a
thread of the test process (rank 0, gloo) while vLLM's worker receives as rank 1."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rljob import JobSpec, parse_spec
from workers.engines.native.trainer import NativeTrainer
from workers.engines.vllm.generator import VllmGenerator
from workers.models.tokenizer import ByteTokenizer
from workers.weight_sync.channel import WeightChannel
from workers.weight_sync.data import Payload, SyncResult

TOK = ByteTokenizer()
# hidden 128, 4 heads of 32 (FP8 KV on vLLM's CPU needs head_dim % 32 == 0), 2 KV heads, 2 layers
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
MAX_PROMPT_TOKENS = 32
# log p of every token under the dummy weights vLLM starts with (logits ~0 over the 272 ids)
VOCAB = 272


def cpu_spec(fp8_kv_cache: bool, max_new_tokens: int) -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": TINY},
            "precision": {"recipe": "bf16", "fp8_kv_cache": fp8_kv_cache},
            "rollout": {"max_new_tokens": max_new_tokens, "prompts_per_step": 32, "group_size": 2},
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 0},
        }
    )


def sharpened_trainer(spec: JobSpec) -> NativeTrainer:
    """A trainer whose matrices are 3x the initialisation (std 0.06, about 0.7/sqrt(hidden)):
    log-probs well away from uniform, while BF16 rounding still moves them by well under 1%."""
    trainer = NativeTrainer(spec, TOK.vocab_size)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return trainer


@contextmanager
def running_generator(
    spec: JobSpec,
    eos: int | tuple[int, ...] = TOK.eos_id,
    vocab_size: int = TOK.vocab_size,
    pad_id: int = TOK.pad_id,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> Iterator[VllmGenerator]:
    """A CPU ``VllmGenerator`` (the byte tokenizer's ids unless given); afterwards vLLM is shut
    down and any process it started and left behind is killed (only those: the children of this
    process that were not there before)."""
    import psutil  # type: ignore[import-untyped]  # vLLM's dependency

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    gen = VllmGenerator(spec, vocab_size, eos, pad_id, "cpu", max_prompt_tokens)
    try:
        yield gen
    finally:
        gen.shutdown()
        del gen
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in left:
            p.kill()
        psutil.wait_procs(left, timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Sender:
    """Trainer 0 of a two-rank weight channel, on a thread: each call runs the trainer's side while
    the generator runs its own on the calling thread, as trainer and generator actors would."""

    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.channel = WeightChannel(self.address, 0, 2, "cpu", timeout_s=120)

    def _alongside(self, trainer_side: Any, generator_side: Any) -> Any:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                trainer_side()
            except BaseException as err:
                errors.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            out = generator_side()
        finally:
            thread.join(timeout=120)
        if errors:
            raise errors[0]
        return out

    def join(self, gen: VllmGenerator, device: str | None = None) -> None:
        """Open the channel; vLLM's worker joins as rank 1 (``device``: where it receives)."""
        self._alongside(
            self.channel.init_communicator, lambda: gen.join_weight_channel(self.address, 1, 2, device)
        )

    def sync(self, gen: VllmGenerator, payload: Payload) -> SyncResult:
        """One version, sent by the trainer and received by vLLM; the generator's result."""
        result: SyncResult = self._alongside(lambda: self.channel.sync_weights(payload), gen.receive_weights)
        return result


def mult_prob_error(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """``token_mult_prob_error`` of two ``[B, L]`` log-prob tensors: mean over valid tokens of
    ``exp(|a - b|)`` (1.0: identical), written out here rather than taken from the code under test."""
    return float(((a - b).abs().exp() * mask).sum() / mask.sum())


def plain(value: Any) -> bool:
    """Whether ``value`` is plain data (what msgspec carries unchanged): no tensor anywhere."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return False

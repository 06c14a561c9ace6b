"""The one place that chooses how weights travel (workers/weight_sync/transport.py): which jobs
take the weight channel, how many ranks a generator takes in it, and how a generator receives
over either transport. The transports themselves: test_broadcast.py, test_channel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rljob import parse_spec
from workers.weight_sync.data import Payload, SyncResult
from workers.weight_sync.transport import receive, uses_weight_channel, weight_receivers


def spec_with(**resources: Any) -> Any:
    return parse_spec({"precision": {"recipe": "bf16"}, "resources": resources})


def test_the_weight_channel_is_for_vllm_and_megatron_jobs() -> None:
    assert not uses_weight_channel(spec_with())
    assert uses_weight_channel(spec_with(generator_engine="vllm", gpus_per_generator=1))
    assert uses_weight_channel(spec_with(trainer_engine="megatron", gpus_per_trainer=1))
    tp2 = spec_with(
        generator_engine="vllm", gpus_per_generator=2, generator_tensor_parallel_size=2, generators=3
    )
    assert weight_receivers(tp2) == 2
    assert weight_receivers(spec_with(trainer_engine="megatron", gpus_per_trainer=1)) == 1
    assert weight_receivers(spec_with()) == 1


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[Payload] = []
        self.received = 0

    def load_weights(self, payload: Payload) -> None:
        self.loaded.append(payload)

    def receive_weights(self) -> SyncResult:
        self.received += 1
        return SyncResult(version=7, bytes=10, seconds=0.1, buckets=1)


class _Broadcast:
    def __init__(self, payload: Payload | None) -> None:
        self.payload = payload

    def sync_weights(self, payload: Payload | None) -> SyncResult:
        assert payload is None  # a receiver sends nothing
        return SyncResult(version=3, bytes=4, seconds=0.2, buckets=1, payload=self.payload)


def test_a_generator_receives_over_the_broadcast_or_through_its_engine() -> None:
    engine = _Engine()
    payload = {"w": torch.ones(2)}
    result = receive(engine, _Broadcast(payload))  # type: ignore[arg-type]
    assert result.version == 3 and engine.loaded == [payload] and engine.received == 0
    result = receive(engine, None)  # the weight channel: the engine holds its end
    assert result.version == 7 and engine.received == 1 and len(engine.loaded) == 1
    with pytest.raises(RuntimeError, match="no payload"):
        receive(engine, _Broadcast(None))  # type: ignore[arg-type]

"""The weight channel of vLLM/Megatron jobs, on CPU: its rank layout, address parsing, refusals,
and the wire format over a broadcast primitive shaped like vLLM's (``broadcast_obj`` on the
store, ``broadcast`` of tensors), here a thread-backed loopback between one sender and two
receivers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from workers.engines.weight_channel import StatelessNcclWeightSync, channel_ranks, split_address
from workers.fp8.quant import Fp8Tensor, quantize
from workers.weight_sync import CollectiveWeightSync, SyncResult


def test_rank_layout_and_addresses() -> None:
    # trainer 0 is rank 0; 3 generators x 2 tensor-parallel workers follow in order
    assert channel_ranks(2, 3) == (7, [1, 3, 5])
    assert channel_ranks(1, 1) == (2, [1])
    with pytest.raises(ValueError):
        channel_ranks(0, 1)
    assert split_address("tcp://10.0.0.7:29511") == ("10.0.0.7", 29511)
    assert split_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        split_address("tcp://nohost")


def test_the_channel_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StatelessNcclWeightSync("tcp://127.0.0.1:1", 0, 2, "cpu")


class _Loopback:
    """Broadcast between threads: the source writes, everyone reads after a barrier."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.box: list[Any] = [None]

    def obj(self, rank: int, value: Any) -> Any:
        if rank == 0:
            self.box[0] = value
        self.barrier.wait()
        out = self.box[0]
        self.barrier.wait()
        return out

    def tensor(self, rank: int, t: torch.Tensor) -> None:
        if rank == 0:
            self.box[0] = t.clone()
        self.barrier.wait()
        if rank != 0:
            t.copy_(self.box[0])
        self.barrier.wait()


class _Member(CollectiveWeightSync):
    def __init__(self, rank: int, loop: _Loopback) -> None:
        super().__init__(rank, torch.device("cpu"), bucket_bytes=4096)
        self.loop = loop

    def _ready(self) -> bool:
        return True

    def _broadcast_obj(self, obj: Any) -> Any:
        return self.loop.obj(self.rank, obj)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.loop.tensor(self.rank, tensor)


def test_the_wire_format_over_a_broadcast_primitive() -> None:
    w = quantize(torch.randn(256, 384), "e4m3", (128, 128))  # a [2, 3] grid of scales
    payload: dict[str, Any] = {"a.weight": w, "norm.weight": torch.randn(384).to(torch.bfloat16)}
    loop = _Loopback(3)
    results: dict[int, SyncResult] = {}

    def member(rank: int) -> None:
        results[rank] = _Member(rank, loop).sync_weights(payload if rank == 0 else None)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0].payload is None and results[0].version == 1
    assert results[0].buckets > 1  # 98 KiB of FP8 in 4 KiB buckets
    for rank in (1, 2):
        got = results[rank].payload
        assert got is not None and results[rank].bytes == results[0].bytes
        fp8 = got["a.weight"]
        assert isinstance(fp8, Fp8Tensor) and fp8.block == (128, 128)
        assert torch.equal(fp8.data.view(torch.uint8), w.data.view(torch.uint8))  # the same bytes
        assert torch.equal(fp8.scale, w.scale) and torch.equal(got["norm.weight"], payload["norm.weight"])

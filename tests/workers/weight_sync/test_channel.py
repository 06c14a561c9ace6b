"""The weight channel of vLLM/Megatron jobs, on CPU: its rank layout, address parsing, refusals,
the wire format over a broadcast primitive shaped like vLLM's (``broadcast_obj`` on the store,
``broadcast`` of tensors), here a thread-backed loopback between one sender and two receivers,
and the real gloo transport between three processes."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.quant import quantize
from workers.weight_sync.broadcast import CollectiveWeightSync
from workers.weight_sync.channel import WeightChannel, channel_ranks, split_address
from workers.weight_sync.data import SyncResult


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


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"CUDA \(NCCL\) or CPU \(gloo\)"):
        WeightChannel("tcp://127.0.0.1:1", 0, 2, "meta")
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        WeightChannel("tcp://127.0.0.1:1", 2, 2)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        WeightChannel("127.0.0.1", 1, 2)
    with pytest.raises(RuntimeError, match="init_communicator"):
        WeightChannel("tcp://127.0.0.1:1", 1, 2).sync_weights(None)


def test_a_receiver_without_its_trainer_says_whom_it_waited_for() -> None:
    channel = WeightChannel(f"tcp://127.0.0.1:{free_port()}", 1, 2, "cpu", timeout_s=1)
    with pytest.raises(RuntimeError, match=r"gloo\): rank 1 of 2 at tcp://127.0.0.1:\d+ could not join"):
        channel.init_communicator()


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


# --- the gloo transport between processes ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _payload(version: int) -> dict[str, Any]:
    """Version ``version``'s payload, the same bytes in every process that builds it (seeded):
    an FP8 weight (data + 128x128-block scales), BF16 tensors and a float32 K scale."""
    gen = torch.Generator().manual_seed(1000 + version)
    return {
        "model.layers.0.mlp.up_proj.weight": quantize(
            torch.randn(256, 384, generator=gen), "e4m3", (128, 128)
        ),
        "model.norm.weight": torch.randn(384, generator=gen).to(torch.bfloat16),
        "model.embed_tokens.weight": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
        "model.layers.0.self_attn.k_scale": torch.rand((), generator=gen, dtype=torch.float32),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(got: dict[str, Any], want: dict[str, Any]) -> bool:
    if list(got) != list(want):
        return False
    for name, w in want.items():
        g = got[name]
        if isinstance(w, Fp8Tensor):
            if not (isinstance(g, Fp8Tensor) and g.block == w.block and g.fmt == w.fmt):
                return False
            pairs = [(g.data, w.data), (g.scale, w.scale)]
        else:
            pairs = [(g, w)]
        for a, b in pairs:
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
                return False
    return True


def _member(rank: int, world: int, address: str, vllm_like_port: int, results: Any) -> None:
    """One process of the channel. Receivers first open a default process group of their own
    among themselves, as a vLLM worker holds one: the channel must neither need nor touch it."""
    try:
        if rank > 0:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{vllm_like_port}", rank=rank - 1, world_size=world - 1
            )
        channel = WeightChannel(address, rank, world, "cpu", bucket_bytes=64 * 1024, timeout_s=60)
        channel.init_communicator()
        seen = []
        for version in (1, 2):
            result = channel.sync_weights(_payload(version) if rank == 0 else None)
            # a receiver checks against the payload it builds itself from the seed, not a copy
            ok = rank == 0 or (result.payload is not None and _same_bytes(result.payload, _payload(version)))
            seen.append((result.version, result.buckets, result.bytes, ok))
        if rank > 0:
            dist.barrier()  # the default group still works after the channel's traffic
            dist.destroy_process_group()
        results.put((rank, seen))
    except Exception as err:  # the parent reports it
        results.put((rank, repr(err)))


@pytest.mark.slow
def test_gloo_channel_between_three_processes_delivers_the_same_bytes() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    address, other = f"tcp://127.0.0.1:{free_port()}", free_port()
    procs = [ctx.Process(target=_member, args=(r, 3, address, other, results)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get() for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(isinstance(v, list) for v in got.values()), got
    # bytes of one version on the wire: 256x384 FP8 + 2x3 float32 scales + 384 + 300x64 BF16 + a
    # float32 K scale, each tensor padded to a multiple of 16 bytes (the scales 24 -> 32, the K scale 4 -> 16)
    nbytes = 256 * 384 + 32 + 384 * 2 + 300 * 64 * 2 + 16
    for rank in range(3):
        assert [(v, n) for v, _, n, _ in got[rank]] == [(1, nbytes), (2, nbytes)]
        assert all(ok for *_, ok in got[rank]), f"rank {rank} received other bytes than were sent"
        # 64 KiB buckets: the 96 KiB FP8 weight travels alone, the other 38 KiB together
        assert all(buckets == 2 for _, buckets, _, _ in got[rank])

"""Weight sync: packing is lossless, and a broadcast between two real processes (gloo) delivers
tensors identical byte for byte, FP8 data, scales and BF16 alike, over several buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing import start_processes  # type: ignore[attr-defined]

from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.quant import quantize
from workers.weight_sync.broadcast import BroadcastWeightSync, bucket_sizes, manifest_of, pack, unpack


def payload(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.mlp.up_proj.weight": quantize(torch.randn(256, 192, generator=g), "e4m3", (128, 128)),
        "layers.0.input_layernorm.weight": torch.randn(192, generator=g).to(torch.bfloat16),
        "layers.0.self_attn.q_proj.weight": quantize(torch.randn(64, 64, generator=g), "e4m3", None),
        "lm_head.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "lm_head.bias": torch.randn(300, generator=g),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, Fp8Tensor):
        return (
            isinstance(b, Fp8Tensor)
            and a.block == b.block
            and a.fmt.name == b.fmt.name
            and a.data.dtype == b.data.dtype
            and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and torch.equal(a.scale, b.scale)
        )
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 1 << 30])
def test_pack_unpack_round_trip(seed: int, bucket_bytes: int) -> None:
    sent = payload(seed)
    manifest = manifest_of(sent)
    buckets = pack(sent, manifest, bucket_bytes)
    assert [b.numel() for b in buckets] == bucket_sizes(manifest, bucket_bytes)
    # bytes on the wire, counted by hand: FP8 1 B/element + 4 B/scale, BF16 2 B, float32 4 B, each
    # tensor padded to a multiple of 16 bytes (only the tensorwise scale needs it: 4 -> 16)
    expected = (256 * 192 + 4 * 2 * 2) + 2 * 192 + (64 * 64 + 16) + 2 * 300 * 64 + 4 * 300
    assert sum(b.numel() for b in buckets) == expected
    if bucket_bytes == 1:
        assert len(buckets) == len(sent)  # each tensor alone
    got = unpack(buckets, manifest, bucket_bytes)
    assert list(got) == list(sent) and all(same(sent[k], got[k]) for k in sent)


def test_sender_must_pass_a_payload_and_init_first() -> None:
    sync = BroadcastWeightSync(0, 1, "tcp://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="init_communicator"):
        sync.sync_weights(payload(0))


def _member(rank: int, init_file: str, seed: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    sync = BroadcastWeightSync(rank, 2, f"file://{init_file}", "gloo", bucket_bytes=8192, timeout_s=120)
    sync.init_communicator()
    try:
        for version in (1, 2):
            result = sync.sync_weights(payload(seed + version) if rank == 0 else None)
            assert result.version == version
            if rank == 1:
                torch.save(  # copies: the received tensors are views of the buckets, of several dtypes
                    {
                        k: (v.data.view(torch.uint8).clone(), v.scale.clone())
                        if isinstance(v, Fp8Tensor)
                        else v.clone()
                        for k, v in (result.payload or {}).items()
                    },
                    Path(out_dir) / f"v{version}.pt",
                )
                torch.save(
                    {"bytes": result.bytes, "buckets": result.buckets}, Path(out_dir) / f"s{version}.pt"
                )
    finally:
        sync.shutdown()


@pytest.mark.slow  # over 3 s on 2 idle cores (tests/conftest.py: tiers)
def test_broadcast_between_two_processes_delivers_identical_tensors(seed: int, tmp_path: Path) -> None:
    init_file = tmp_path / "rendezvous"
    start_processes(
        _member, args=(str(init_file), seed, str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    for version in (1, 2):
        sent = payload(seed + version)
        got = torch.load(tmp_path / f"v{version}.pt", weights_only=True)
        assert list(got) == list(sent)
        for name, value in sent.items():
            if isinstance(value, Fp8Tensor):
                data, scale = got[name]
                assert torch.equal(data, value.data.view(torch.uint8)) and torch.equal(scale, value.scale)
            else:
                assert got[name].dtype == value.dtype and torch.equal(got[name], value)
        stats = torch.load(tmp_path / f"s{version}.pt", weights_only=True)
        assert stats["buckets"] > 1 and stats["bytes"] == sum(
            b.numel() for b in pack(sent, manifest_of(sent), 8192)
        )


def test_unpack_stays_on_the_buckets_device_and_checks_the_plan(seed: int) -> None:
    sent = payload(seed)
    manifest = manifest_of(sent)
    buckets = pack(sent, manifest, 4096)
    got = unpack(buckets, manifest, 4096)
    tensors = [v.data if hasattr(v, "data") and not isinstance(v, torch.Tensor) else v for v in got.values()]
    assert all(t.device == buckets[0].device for t in tensors)
    # each entry is a view into its bucket, no copy, starting at a multiple of 16 bytes (aligned for
    # its dtype and for cuBLAS): the FP8 data and scales alike
    parts = [p for v in got.values() for p in ((v.data, v.scale) if isinstance(v, Fp8Tensor) else (v,))]
    bases = {b.untyped_storage().data_ptr() for b in buckets}
    assert all(t.untyped_storage().data_ptr() in bases for t in parts)
    assert all(t.data_ptr() % 16 == 0 for t in parts) and len(parts) == 7
    with pytest.raises(RuntimeError, match="different bucket sizes"):
        unpack(buckets, manifest, 1 << 30)

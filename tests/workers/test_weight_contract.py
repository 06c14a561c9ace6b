"""The precision contract's checksum and KV-cache dtype rule, against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from workers import weight_contract as wc
from workers.weight_contract import KvHeld, WeightReport, checksum, compare, kv_dtype_name


def test_checksum_is_position_weighted_over_the_bytes() -> None:
    # bytes 1, 2, 3 at positions 0, 1, 2: 1*1 + 2*2 + 3*3 = 14; reversed: 3*1 + 2*2 + 1*3 = 10
    assert int(checksum(torch.tensor([1, 2, 3], dtype=torch.uint8))) == 14
    assert int(checksum(torch.tensor([3, 2, 1], dtype=torch.uint8))) == 10
    # a bfloat16 1.0 is the bytes 0x80, 0x3F (little-endian): 128*1 + 63*2 = 254
    assert int(checksum(torch.ones(1, dtype=torch.bfloat16))) == 254


def test_checksum_in_chunks_equals_the_whole_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (70_000,), dtype=torch.uint8)  # positions past 65521 wrap
    weights = [1 + i % 65521 for i in range(data.numel())]
    expected = sum(b * w for b, w in zip(data.tolist(), weights, strict=True))  # plain Python ints
    monkeypatch.setattr(wc, "_CHUNK", 4096)  # 18 chunks, the last one partial
    assert int(checksum(data)) == expected


def _report(kv_dtype: str) -> WeightReport:
    return WeightReport(weights={}, kv=KvHeld(dtype=kv_dtype, k_scales=[], v_scales=[]))


def test_kv_cache_dtypes_compare_by_format() -> None:
    assert kv_dtype_name("fp8") == kv_dtype_name("fp8_e4m3") == "float8_e4m3fn"
    assert kv_dtype_name("fp8_e5m2") == "float8_e5m2" and kv_dtype_name("torch.bfloat16") == "bfloat16"
    assert compare(_report("fp8"), _report("float8_e4m3fn")).ok
    assert compare(_report("bfloat16"), _report("bfloat16")).ok
    # an E5M2 cache is FP8 too, but not the format the spec asks for
    assert compare(_report("fp8"), _report("float8_e5m2")).mismatches == [
        "KV cache: the spec asks for fp8, the generator holds float8_e5m2"
    ]
    assert not compare(_report("float8_e4m3fn"), _report("bfloat16")).ok

"""The weight-sync checksums of many tensors in one GPU launch (Triton).

A weight report (:mod:`workers.weight_sync.contract`) checksums every tensor of a payload: the data
and the scales of each FP8 weight, every BF16 tensor. One tensor at a time, torch takes about ten
small kernels for each (the position weights, the column sums, the products, the tail), so the
report of a 1B model's payload was ~2300 launches on each side of a sync, about half of its
weight-sync time on an H200 (docs/fp8-numerics.md). Here every tensor of a device is summed by one
launch (and one ``index_add_`` of its programs' partial sums), with the same integer
:func:`~workers.weight_sync.contract.checksum` gives:

    checksum(t) = sum_i byte_i * (1 + i mod 65521)     over t's bytes in memory order

Each program takes ``CHUNK`` consecutive bytes of one tensor (``owner[p]`` names it, its row of
``table`` gives its address, length and first program), multiplies each byte by its weight, and
writes its sum. Integer sums are exact in any order, so the result is the torch one bit for bit
(tested under Triton's interpreter; ``tests/workers/test_gpu_data_plane.py`` on a GPU). Off unless
``FP8RL_CHECKSUM=triton`` until a GPU has run it. Imported only where it runs: CUDA, or the CPU
under Triton's interpreter (tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from workers.fp8.dispatch import to_device

MODULUS = 65521  # workers.weight_sync.contract's (that module does not import Triton)
CHUNK = 1 << 16  # bytes per program
BLOCK = 4096  # bytes per step of a program
FIELDS = 3  # a table row: the tensor's address, its bytes, its first program


@triton.jit
def _checksum_many(
    table_ptr, owner_ptr, partial_ptr, MODULUS: tl.constexpr, FIELDS: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
) -> None:  # fmt: skip
    """``partial[p]``: the weighted sum of program ``p``'s ``CHUNK`` bytes of tensor ``owner[p]``.

    A lane's sum stays below 2^31 (CHUNK / BLOCK steps of at most 255 * 65521), so the lanes add
    in int32 and only their total is int64."""
    p = tl.program_id(0)
    row = table_ptr + tl.load(owner_ptr + p) * FIELDS
    base = tl.load(row).to(tl.pointer_type(tl.uint8))
    n = tl.load(row + 1)
    start = (p - tl.load(row + 2)) * CHUNK  # int64: this program's first byte in its tensor
    phase = (start % MODULUS).to(tl.int32)  # that byte's position modulo 65521
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(0, CHUNK, BLOCK):
        at = start + k + i
        b = tl.load(base + at, mask=at < n, other=0).to(tl.int32)
        acc += b * ((phase + k + i) % MODULUS + 1)  # < 255 * 65522 per step
    tl.store(partial_ptr + p, tl.sum(acc.to(tl.int64), axis=0))


def checksum_many(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)]`` int64 on their device (one CUDA device, or the CPU under the
    interpreter): :func:`workers.weight_sync.contract.checksum` of each, without a host sync.

    A tensor that is not contiguous is made so first (its logical order, as ``checksum`` reads
    it). The table of addresses travels to the device from pinned memory, without waiting."""
    if not tensors:
        raise ValueError("checksum_many: no tensors")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"checksum_many: tensors on several devices ({devices}); one call per device")
    flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    sizes = np.array([f.numel() for f in flats], dtype=np.int64)
    programs = -(-sizes // CHUNK)  # [S]: 0 for an empty tensor (its checksum stays 0)
    first = np.concatenate(([0], np.cumsum(programs)[:-1]))
    total = int(programs.sum())
    out = torch.zeros(len(flats), dtype=torch.int64, device=device)
    if total == 0:
        return out
    table = np.stack([np.array([f.data_ptr() for f in flats], dtype=np.int64), sizes, first], axis=1)
    owner = np.repeat(np.arange(len(flats), dtype=np.int64), programs)  # [P]: each program's tensor
    host = torch.from_numpy(np.concatenate((table.reshape(-1), owner)))
    on_device = to_device(host, device)
    rows, owners = on_device[: table.size], on_device[table.size :]
    partial = torch.empty(total, dtype=torch.int64, device=device)
    grid: Any = (total,)
    _checksum_many[grid](rows, owners, partial, MODULUS=MODULUS, FIELDS=FIELDS, CHUNK=CHUNK, BLOCK=BLOCK)
    return out.index_add_(0, owners, partial)

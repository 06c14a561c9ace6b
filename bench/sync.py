"""``fp8rl bench sync``: the weight sync's FP8 payload against BF16, and against a raw broadcast.

Two processes over torch.distributed (NCCL between two GPUs when there are two; gloo otherwise):
rank 0 builds a trainer of the preset model and sends its weight-sync payload with
:class:`~workers.weight_sync.BroadcastWeightSync`, rank 1 receives and unpacks it on its device.
Payloads: ``bf16`` (a ``bf16`` job: every weight in BF16) and ``fp8`` (an ``fp8-e2e`` job: decoder
linears as FP8 data + float32 block scales). The baseline, measured in the same run, is one raw
``torch.distributed.broadcast`` of a byte tensor of the same size: ``sync / raw`` is what the
manifest, packing and unpacking cost on top of moving the bytes. Seconds are the receiver's
(median of ``repeat`` after a warm-up), GB/s = payload bytes / seconds.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import bench_spec

PAYLOADS = (("bf16", "bf16"), ("fp8", "fp8-e2e"))


@dataclass(frozen=True)
class SyncRow:
    payload: str
    bytes: int
    sync_s: float
    raw_s: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.sync_s / 1e9

    @property
    def raw_gb_per_s(self) -> float:
        return self.bytes / self.raw_s / 1e9


def _member(rank: int, model: str, backend: str, init: str, repeat: int, out: str) -> None:
    from workers.engines.factory import build_trainer
    from workers.tokenizer import ByteTokenizer
    from workers.weight_sync import BroadcastWeightSync

    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_num_threads(1)
    sync = BroadcastWeightSync(rank, 2, init, backend, timeout_s=600)
    sync.init_communicator()

    def wait() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    rows = []
    try:
        for name, recipe in PAYLOADS:
            payload: dict[str, Any] | None = None
            if rank == 0:
                spec = bench_spec(model, recipe, dev)
                payload = build_trainer(spec, ByteTokenizer().vocab_size, str(dev)).export_weights()
            times, raw = [], []
            nbytes = 0
            for i in range(repeat + 1):
                wait()
                result = sync.sync_weights(payload if rank == 0 else None)
                nbytes = result.bytes
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                wait()
                t0 = time.perf_counter()
                dist.broadcast(buf, src=0)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                raw_s = time.perf_counter() - t0
                if i > 0:
                    times.append(result.seconds)
                    raw.append(raw_s)
            rows.append(SyncRow(name, nbytes, statistics.median(times), statistics.median(raw)))
    finally:
        sync.shutdown()
    if rank == 1:
        Path(out).write_text(json.dumps([asdict(r) for r in rows]))


def run(model: str = "tiny", device: str = "auto", repeat: int = 3) -> tuple[str, list[SyncRow]]:
    from torch.multiprocessing.spawn import spawn

    gpus = torch.cuda.device_count() if device in ("auto", "cuda") else 0
    if device == "cuda" and gpus < 2:
        backend, note = "gloo", f"{gpus} GPU(s): NCCL needs two ranks on two GPUs, so gloo over host memory"
    elif gpus >= 2:
        backend, note = "nccl", f"NCCL between cuda:0 and cuda:1 ({torch.cuda.get_device_name(0)})"
    else:
        backend, note = "gloo", "gloo on the CPU, one thread per process"
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/init"
        out = f"{tmp}/rows.json"
        spawn(_member, args=(model, backend, init, repeat, out), nprocs=2, join=True)  # type: ignore[no-untyped-call]
        rows = [SyncRow(**r) for r in json.loads(Path(out).read_text())]
    return note, rows


def format_table(note: str, rows: list[SyncRow], model: str) -> str:
    base = rows[0]
    lines = [
        f"transport: {note}   model: {model}",
        f"{'payload':<8} {'MiB':>9} {'sync s':>9} {'GB/s':>7} {'raw s':>9} {'raw GB/s':>9} "
        f"{'sync/raw':>9} {'bytes vs bf16':>14} {'time vs bf16':>13}",
    ]
    for r in rows:
        lines.append(
            f"{r.payload:<8} {r.bytes / 2**20:>9.2f} {r.sync_s:>9.4f} {r.gb_per_s:>7.2f} {r.raw_s:>9.4f} "
            f"{r.raw_gb_per_s:>9.2f} {r.sync_s / r.raw_s:>8.2f}x {r.bytes / base.bytes:>13.2f}x "
            f"{r.sync_s / base.sync_s:>12.2f}x"
        )
    return "\n".join(lines)


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    note, rows = run(model, device, **options)
    return format_table(note, rows, model)

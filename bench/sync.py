"""``fp8rl bench sync``: the weight sync's FP8 payload against BF16, and against a raw broadcast.

Two processes over torch.distributed (NCCL between two GPUs when there are two; gloo otherwise):
rank 0 builds a trainer of the model (a preset, or ``smollm2`` / a Hugging Face directory: the
real model as ``examples/smollm2-addition.yaml`` runs it) and sends its weight-sync payload with
:class:`~workers.weight_sync.BroadcastWeightSync`; rank 1 builds a generator, receives, unpacks
and loads it, as the product's workers do (:mod:`workers.job.ray_workers`).
Payloads: ``bf16`` (a ``bf16`` job: every weight in BF16) and ``fp8`` (an ``fp8-e2e`` job: decoder
linears as FP8 data + float32 block scales). The baseline, measured in the same run, is one raw
``torch.distributed.broadcast`` of a byte tensor of the same size: ``sync / raw`` is what the
manifest, packing and unpacking cost on top of moving the bytes. Seconds are the receiver's
(median of ``repeat`` after a warm-up), GB/s = payload bytes / seconds.

A second table times one whole update end to end, barrier to barrier: the trainer's export, the
sync, the generator's load, and the precision contract (:mod:`workers.weight_sync.contract`: the
trainer's report of what it sent and the generator's of what it holds, compared), with each
side's phases.
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

from bench.common import bench_spec, real_model_dir, real_spec

PAYLOADS = (("bf16", "bf16"), ("fp8", "fp8-e2e"))


@dataclass(frozen=True)
class SyncRow:
    payload: str
    bytes: int
    sync_s: float  # the receiver's sync_weights: manifest, buckets over the wire, unpacked
    raw_s: float
    # one whole update as the product runs it, barrier to barrier (median): the trainer's export,
    # the sync, the generator's load and both sides' precision-contract reports, compared
    end_to_end_s: float = 0.0
    export_s: float = 0.0  # the trainer's export_weights
    load_s: float = 0.0  # the generator's load_weights (its held report's checksums included)
    report_s: float = 0.0  # the trainer's sent_report (checksums of what it sent)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.sync_s / 1e9

    @property
    def raw_gb_per_s(self) -> float:
        return self.bytes / self.raw_s / 1e9


def _spec(model: str, recipe: str, dev: torch.device) -> Any:
    path = real_model_dir(model)
    return bench_spec(model, recipe, dev) if path is None else real_spec(path, recipe, dev)


def _vocab(model: str) -> int:
    from workers.models.tokenizer import ByteTokenizer, HfTokenizer

    path = real_model_dir(model)
    return ByteTokenizer().vocab_size if path is None else HfTokenizer(str(path)).vocab_size


def _member(rank: int, model: str, backend: str, init: str, repeat: int, out: str) -> None:
    from workers.engines.factory import build_generator, build_trainer
    from workers.weight_sync.broadcast import BroadcastWeightSync
    from workers.weight_sync.contract import compare, kv_cache_dtype, sent_report

    dev = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_num_threads(1)
    sync = BroadcastWeightSync(rank, 2, init, backend, timeout_s=600)
    sync.init_communicator()
    vocab = _vocab(model)

    def wait() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    rows = []
    try:
        for name, recipe in PAYLOADS:
            spec = _spec(model, recipe, dev)
            kv_dtype = kv_cache_dtype(spec.precision.fp8_kv_cache)
            engine: Any = (
                build_trainer(spec, vocab, str(dev))
                if rank == 0
                else build_generator(spec, vocab, [0], 0, str(dev))
            )
            box: list[Any] = [engine.fp8_weight_names() if rank == 1 else None]
            dist.broadcast_object_list(box, src=1)  # the generator's FP8 layers, as the driver asks
            fp8_names = box[0]
            phases = ("sync", "raw", "e2e", "export", "load", "report")
            times: dict[str, list[float]] = {k: [] for k in phases}
            nbytes, held = 0, None
            for i in range(repeat + 1):
                wait()
                t0 = time.perf_counter()
                t: dict[str, float] = {}
                if rank == 0:
                    payload = engine.export_weights(fp8_names)
                    t["export"] = time.perf_counter() - t0
                    result = sync.sync_weights(payload)
                    t1 = time.perf_counter()
                    sent = sent_report(payload, kv_dtype)
                    t["report"] = time.perf_counter() - t1
                    box = [sent]
                else:
                    result = sync.sync_weights(None)
                    assert result.payload is not None
                    t1 = time.perf_counter()
                    engine.load_weights(result.payload)
                    held = engine.weight_report()
                    t["load"] = time.perf_counter() - t1
                    box = [None]
                dist.broadcast_object_list(box, src=0)  # the trainer's report, to compare with
                if rank == 1:
                    assert held is not None
                    compare(box[0], held).raise_if_failed()
                wait()
                t["e2e"] = time.perf_counter() - t0
                t["sync"] = result.seconds
                nbytes = result.bytes
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                wait()
                t0 = time.perf_counter()
                dist.broadcast(buf, src=0)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t["raw"] = time.perf_counter() - t0
                if i > 0:
                    for k, v in t.items():
                        times[k].append(v)
            # each rank knows its own phases: gather them on the receiver
            mine = {k: statistics.median(v) for k, v in times.items() if v}
            both: list[Any] = [None, None]
            dist.all_gather_object(both, mine)
            # the receiver's wall times; each side's own phases
            med = {**both[0], **both[1]}
            rows.append(
                SyncRow(
                    name,
                    nbytes,
                    both[1]["sync"],
                    both[1]["raw"],
                    both[1]["e2e"],
                    med["export"],
                    med["load"],
                    med["report"],
                )
            )
            del engine
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
    lines += [
        "",
        "one whole update (barrier to barrier: export, sync, load, contract reports compared)",
        f"{'payload':<8} {'end-to-end s':>13} {'export s':>9} {'sync s':>9} {'load s':>9} {'report s':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r.payload:<8} {r.end_to_end_s:>13.4f} {r.export_s:>9.4f} {r.sync_s:>9.4f} "
            f"{r.load_s:>9.4f} {r.report_s:>9.4f}"
        )
    lines.append(
        "load: the generator's load_weights with its held report (checksums); report: the trainer's "
        "sent_report, which runs while the generator loads"
    )
    return "\n".join(lines)


def report(model: str = "tiny", device: str = "auto", **options: Any) -> str:
    """``run`` and ``format_table``: what ``fp8rl bench`` prints."""
    note, rows = run(model, device, **options)
    return format_table(note, rows, model)

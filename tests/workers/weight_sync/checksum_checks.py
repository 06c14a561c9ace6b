"""Checks of the one-launch checksums (workers/weight_sync/triton_checksum.py) that need Triton's
interpreter, switched on before Triton is imported: ``test_checksum_kernel.py`` runs this module in
a fresh interpreter with ``TRITON_INTERPRET=1``
(``python -m tests.workers.weight_sync.checksum_checks``)."""

from __future__ import annotations

import torch

from tests.workers.switches import switched_on
from tests.workers.weight_sync.test_contract import python_checksum
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.quant import quantize


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def kernel_is_the_python_checksum() -> None:
    """Against a plain Python loop over each tensor's bytes: lengths at and around the modulus
    (65521) and a program's chunk (65536), several programs to one tensor (so a program starts at
    a position that is not a multiple of 65521), an empty and a 0-d tensor, a transposed view
    (summed in its logical order), every byte value, FP8 data and its scales, all in one launch."""
    from workers.weight_sync.triton_checksum import CHUNK, MODULUS, checksum_many

    g = torch.Generator().manual_seed(5)

    def octets(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)

    w = quantize(torch.randn(256, 384, generator=g), "e4m3", (128, 128))
    tensors = [
        octets(1),
        octets(MODULUS - 1),
        octets(MODULUS),
        octets(MODULUS + 1),
        octets(CHUNK),
        octets(3 * CHUNK + 17),
        torch.full((CHUNK + 5,), 255, dtype=torch.uint8),
        torch.empty(0, dtype=torch.bfloat16),
        torch.tensor(-1.5),
        torch.randn(96, 80, generator=g).to(torch.bfloat16).t(),
        w.data,
        w.scale,
    ]
    got = checksum_many(tensors).tolist()
    want = [python_checksum(as_bytes(t)) for t in tensors]
    assert got == want, [(i, a, b) for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    print("ok kernel_is_the_python_checksum")


def a_report_with_the_switch_is_the_report_without_it() -> None:
    """``received_weights`` with ``FP8RL_CHECKSUM=triton`` (one launch) gives the report the torch
    checksums give, weight by weight, for a payload of FP8 weights and BF16 tensors."""
    from workers.weight_sync.contract import batched_checksums, received_weights

    g = torch.Generator().manual_seed(6)
    payload: dict[str, Fp8Tensor | torch.Tensor] = {
        "q.weight": quantize(torch.randn(384, 256, generator=g), "e4m3", (128, 128)),
        "norm.weight": torch.randn(256, generator=g).to(torch.bfloat16),
        "embed.weight": torch.randn(300, 256, generator=g).to(torch.bfloat16),
    }
    holds = {"q.weight": "fp8", "norm.weight": "bfloat16", "embed.weight": "bfloat16"}
    assert not batched_checksums(torch.device("cpu"))
    torch_report = received_weights(payload, holds)
    with switched_on("FP8RL_CHECKSUM"):
        assert batched_checksums(torch.device("cpu"))  # the interpreter runs it
        triton_report = received_weights(payload, holds)
    assert triton_report == torch_report
    assert torch_report["q.weight"]["scale"] != 0 and torch_report["norm.weight"]["scale"] == 0
    print("ok a_report_with_the_switch_is_the_report_without_it")


if __name__ == "__main__":
    kernel_is_the_python_checksum()
    a_report_with_the_switch_is_the_report_without_it()

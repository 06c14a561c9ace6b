"""Compile a Triton kernel for an H100 (SM90) on a machine without a GPU: Triton's own compiler and
the ptxas it ships, down to a cubin. What only a GPU can show (speed, the hardware's rounding) it
does not; what it does show is that the kernel's GPU branch type-checks, lowers and assembles for
the device in hand, and what it compiles to (the tensor-core instructions, register spills)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4) -> str:
    """The PTX of ``fn`` compiled (to a cubin) for SM90: ``signature`` types every argument
    (``"constexpr"`` for the ``constexprs``)."""
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=SM90, options={"num_warps": num_warps}
    )
    assert kernel.asm.get("cubin"), "ptxas produced no cubin"
    ptx: str = kernel.asm["ptx"]
    return ptx


def ptxas_spills(ptx: str, tmp: Path) -> tuple[int, int]:
    """``(registers per thread, spill bytes stored + loaded)`` of ``ptx`` assembled for SM90 by the
    ptxas Triton ships (``-v``): spills are decided by ptxas, after the PTX, so the PTX alone
    cannot show them."""
    from triton.backends.nvidia.compiler import get_ptxas

    src = tmp / "kernel.ptx"
    src.write_text(ptx)
    cmd = [get_ptxas(90).path, "-v", "-arch=sm_90a", str(src), "-o", str(tmp / "kernel.cubin")]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spill is not None, log
    return regs, int(spill.group(1)) + int(spill.group(2))

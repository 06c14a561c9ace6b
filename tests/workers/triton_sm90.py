"""Compile a Triton kernel for an H100 (SM90) on a machine without a GPU: Triton's own compiler and
the ptxas it ships, down to a cubin. What only a GPU can show (speed, the hardware's rounding) it
does not; what it does show is that the kernel's GPU branch type-checks, lowers and assembles for
the device in hand, and what it compiles to (the tensor-core instructions, register spills)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
# the disassembler Triton ships beside ptxas
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _compile(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int, fp_fusion: bool
) -> Any:
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    options = {"num_warps": num_warps, "enable_fp_fusion": fp_fusion}
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(source, target=SM90, options=options)
    assert kernel.asm.get("cubin"), "ptxas produced no cubin"
    return kernel


def compile_sm90(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4, fp_fusion: bool = True
) -> str:
    """The PTX of ``fn`` compiled (to a cubin) for SM90: ``signature`` types every argument
    (``"constexpr"`` for the ``constexprs``); ``fp_fusion`` as the launch's ``enable_fp_fusion``."""
    ptx: str = _compile(fn, signature, constexprs, num_warps, fp_fusion).asm["ptx"]
    return ptx


@dataclass(frozen=True)
class Resources:
    """What a thread of the compiled kernel holds, as ptxas allocated it (read from the cubin)."""

    registers: int
    stack: int  # bytes of the thread's stack frame: registers spilled to local memory live there
    warps: int

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM90 multiprocessor can hold at once by registers alone (65,536 of them,
        allocated per warp in units of 256)."""
        per_warp = -(-self.registers * 32 // 256) * 256
        return 65536 // (per_warp * self.warps)


def resources_sm90(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4
) -> Resources:
    """The registers and stack of ``fn`` compiled for SM90 as :func:`compile_sm90` compiles it,
    read from the cubin by the ``cuobjdump`` Triton ships (its ``REG`` and ``STACK``)."""
    cubin = _compile(fn, signature, constexprs, num_warps, True).asm["cubin"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, out
    return Resources(int(found.group(1)), int(found.group(2)), num_warps)

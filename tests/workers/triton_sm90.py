"""Compile a Triton kernel for an H100 (SM90) on a machine without a GPU: Triton's own compiler and
the ptxas it ships, down to a cubin. What only a GPU can show (speed, the hardware's rounding) it
does not; what it does show is that the kernel's GPU branch type-checks, lowers and assembles for
the device in hand, and what it compiles to (the tensor-core instructions, register spills)."""

from __future__ import annotations

from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(
    fn: Any, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4, fp_fusion: bool = True
) -> str:
    """The PTX of ``fn`` compiled (to a cubin) for SM90: ``signature`` types every argument
    (``"constexpr"`` for the ``constexprs``); ``fp_fusion`` as the launch's ``enable_fp_fusion``."""
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    options = {"num_warps": num_warps, "enable_fp_fusion": fp_fusion}
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    kernel = triton.compile(source, target=SM90, options=options)
    assert kernel.asm.get("cubin"), "ptxas produced no cubin"
    ptx: str = kernel.asm["ptx"]
    return ptx

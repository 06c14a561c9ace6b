"""FP8 numerics for fp8rl: formats, scaled quantization, blockwise GEMM, FP8 linear layers,
model conversion with a per-layer audit, FP8 KV-cache scales. (Weights as a weight-sync payload:
:mod:`workers.weight_sync.payload`.)

Usable on its own::

    from workers.fp8 import quantize, fp8_matmul, Fp8Linear, convert_model

    w = quantize(weight, "e4m3", block=(128, 128))      # Fp8Tensor: .data, .scale, .dequantize()
    x = quantize(acts, "e4m3", block=(1, 128))
    y = fp8_matmul(x, w.t())                            # float32 accumulation
    audit = convert_model(hf_model, "fp8-e2e", keep_bf16=1)
    print(audit.format())
"""

from rljob.algorithms import RECIPES
from workers.fp8.convert import AuditRow, Fp8Audit, convert_model
from workers.fp8.dispatch import PROFILES, DeviceProfile, GemmPlan, parse_profile, plan_gemm, simulate
from workers.fp8.formats import E4M3, E5M2, Fp8Format, get_format
from workers.fp8.fp8_tensor import BLOCK_128x128, Fp8Tensor, TILE_1x128
from workers.fp8.guard import FiniteGuard, NonFiniteError, finite_guard
from workers.fp8.kv_cache import KvScaleCalibrator, KvScales, abs_percentile, quantize_kv
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.matmul import fp8_matmul, matmul_emulated, matmul_scaled_mm, plan_for
from workers.fp8.quant import cast_to_fp8, quantize

__all__ = [
    "E4M3",
    "E5M2",
    "PROFILES",
    "RECIPES",
    "AuditRow",
    "BLOCK_128x128",
    "DeviceProfile",
    "FiniteGuard",
    "Fp8Audit",
    "Fp8Format",
    "Fp8Linear",
    "Fp8LinearConfig",
    "Fp8Tensor",
    "GemmPlan",
    "KvScaleCalibrator",
    "KvScales",
    "NonFiniteError",
    "TILE_1x128",
    "abs_percentile",
    "cast_to_fp8",
    "convert_model",
    "finite_guard",
    "fp8_matmul",
    "get_format",
    "matmul_emulated",
    "matmul_scaled_mm",
    "parse_profile",
    "plan_for",
    "plan_gemm",
    "quantize",
    "quantize_kv",
    "simulate",
]

"""``fp8rl bench decode-attention``: the Triton decode attention, BF16 against the E4M3 cache, at
the batch and context shapes of the GPU plan: GPU time per call (CUDA-graph replay, as
:mod:`bench.kernels`), the cache bytes it reads per second, and its error against float64
attention over the same cache, head by head, beside the error of PyTorch's SDPA (what the eager
decode and the trainer run) on the same inputs.

The error columns answer whether the kernel loses precision: if its largest error is no larger
than SDPA's on most heads, a test bound it misses measures FP8 amplification downstream (an
E4M3-quantized ``o_proj`` input moves by an E4M3 step when a BF16 ulp crosses a rounding
boundary), not the kernel. Needs Triton: CUDA, or the interpreter (``TRITON_INTERPRET=1``) on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.kernels import time_calls
from workers.engines.native import decode_attention as da
from workers.fp8.kv_cache import quantize_kv

# (sequences, query heads, KV heads, context): the 1B preset at 1024 x 256 and 64 x 1024/2048,
# Llama-3-8B's heads at 256 x 2048 (GPU plan, section 4)
SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (1024, 16, 8, 160),
    (64, 16, 8, 1056),
    (64, 16, 8, 2080),
    (256, 32, 8, 2064),
)
HEAD_DIM = 128
SETS = 2  # operand sets cycled through (more bytes than the L2 holds)
CHECKED = 64  # sequences compared with float64 (its K/V repeated per query head: 17 GB at 256 x 2064)


@dataclass(frozen=True)
class Row:
    shape: tuple[int, int, int, int]
    cache: str  # bf16 | e4m3
    us: float | None
    cache_bytes: int  # K and V read per call
    kernel_err: list[float]  # per query head: max |out - float64| over sequences and dims
    sdpa_err: list[float]

    @property
    def gbs(self) -> float | None:
        return None if self.us is None else self.cache_bytes / (self.us * 1e-6) / 1e9

    @property
    def worse_heads(self) -> int:
        """Heads where the kernel's largest error exceeds SDPA's."""
        return sum(k > s for k, s in zip(self.kernel_err, self.sdpa_err, strict=True))


def inputs(b: int, hq: int, hkv: int, t: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries and a cache with decode's layout: every position up to ``t`` written, the first few
    of each row left padding (a left-padded prompt)."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where it is used: GBs at these shapes
    q = torch.randn(b, hq, HEAD_DIM, generator=g, device=device).bfloat16()
    k = torch.randn(b, hkv, t, HEAD_DIM, generator=g, device=device).bfloat16()
    v = torch.randn(b, hkv, t, HEAD_DIM, generator=g, device=device).bfloat16()
    pad = torch.randint(0, min(8, t - 1), (b, 1), generator=g, device=device)
    seen = torch.arange(t, device=device)[None, :] >= pad
    return q, k, v, seen


def e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's bytes by the calibrator's rule (workers.fp8.kv_cache: a power-of-two scale
    above the amax), and the scale."""
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax().float() / 448.0)))
    return quantize_kv(x, scale).data, scale


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, scaling: float
) -> torch.Tensor:
    """PyTorch's attention over the same BF16 cache, K/V repeated to the query heads, a bool mask."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], kk, vv, attn_mask=seen[:, None, None, :], scale=scaling
    )
    return out[:, :, 0, :]


def per_head_max_err(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """``[B, H, D]`` against ``[B, H, D]`` float64: each head's largest absolute error."""
    return [float(x) for x in (out.double() - ref).abs().amax(dim=(0, 2))]


def measure(shape: tuple[int, int, int, int], cache: str, device: torch.device, replays: int = 10) -> Row:
    b, hq, hkv, t = shape
    scaling = HEAD_DIM**-0.5
    sets = []
    for s in range(SETS if device.type == "cuda" else 1):
        q, k, v, seen = inputs(b, hq, hkv, t, device, seed=s)
        ks = vs = None
        if cache == "e4m3":
            (k, ks), (v, vs) = e4m3(k), e4m3(v)
        sets.append((q, k, v, seen, ks, vs))
    q, k, v, seen, ks, vs = sets[0]
    length = torch.tensor([t], device=device)
    out = da.decode_attention(q, k, v, seen, length, scaling, ks, vs)[:CHECKED]
    q, k, v, seen = q[:CHECKED], k[:CHECKED], v[:CHECKED], seen[:CHECKED]
    ref = da.reference(q, k, v, seen, t, scaling, ks, vs)
    k_bf, v_bf = k, v  # the BF16 values SDPA reads: the cache's own, or its dequantization
    if ks is not None and vs is not None:
        k_bf, v_bf = (k.float() * ks).bfloat16(), (v.float() * vs).bfloat16()
    row_err, sdpa_err = per_head_max_err(out, ref), per_head_max_err(sdpa(q, k_bf, v_bf, seen, scaling), ref)
    us = None
    if device.type == "cuda":
        lens = [torch.tensor([t], device=device) for _ in sets]
        calls = [
            lambda s=s, n=n: da.decode_attention(s[0], s[1], s[2], s[3], n, scaling, s[4], s[5])
            for s, n in zip(sets, lens, strict=True)
        ]
        us = time_calls(device, calls, replays)
    cache_bytes = 2 * b * hkv * t * HEAD_DIM * sets[0][1].element_size()  # K and V of every sequence
    return Row(shape, cache, us, cache_bytes, row_err, sdpa_err)


def format_table(device: str, rows: list[Row]) -> str:
    lines = [
        f"device: {device}   head_dim {HEAD_DIM}   errors: each head's max |out - float64| over the first "
        f"{CHECKED} sequences; the worst head shown",
        f"{'B':>5} {'Hq/Hkv':>6} {'ctx':>5} {'cache':>5} {'us':>9} {'GB/s':>7} {'vs bf16':>7} "
        f"{'kernel err':>10} {'sdpa err':>10} {'heads kernel > sdpa':>20}",
    ]
    bf16_us = {r.shape: r.us for r in rows if r.cache == "bf16"}
    for r in rows:
        b, hq, hkv, t = r.shape
        base = bf16_us.get(r.shape)
        ratio = f"{r.us / base:.2f}" if r.us and base else "-"
        us = f"{r.us:9.1f}" if r.us is not None else f"{'-':>9}"
        gbs = f"{r.gbs:7.0f}" if r.gbs is not None else f"{'-':>7}"
        worse = f"{r.worse_heads} of {len(r.kernel_err)}"
        lines.append(
            f"{b:>5} {f'{hq}/{hkv}':>6} {t:>5} {r.cache:>5} {us} {gbs} {ratio:>7} "
            f"{max(r.kernel_err):10.2e} {max(r.sdpa_err):10.2e} {worse:>20}"
        )
    lines.append("vs bf16: this cache's time over the BF16 cache's at the same shape (below 1: faster)")
    return "\n".join(lines)


def report(
    device: str,
    shapes: tuple[tuple[int, int, int, int], ...] = SHAPES,
    caches: tuple[str, ...] = ("bf16", "e4m3"),
) -> str:
    from bench.common import device_name, pick_device

    dev = pick_device(device)
    for c in caches:
        if c not in ("bf16", "e4m3"):
            raise ValueError(f"--caches {c!r}: bf16 or e4m3")
    rows = []
    for shape in shapes:
        for c in caches:
            rows.append(measure(shape, c, dev))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return format_table(device_name(dev), rows)

"""Static-shape decoding, captured in a CUDA graph: the native generator's fast path on a GPU.

An eager decode step is one Hugging Face forward issued layer by layer from Python: at the batch
sizes of RL rollouts its time is the host's, not the GPU's (``docs/gpu-checks.md``). Here every
tensor of a decode step keeps its shape, strides and storage from step to step, so the step is
captured once in a CUDA graph and replayed: one launch per token instead of hundreds.

- :class:`StaticKvCache` preallocates K and V for ``prompt + max_new_tokens`` positions per layer
  (BF16, or E4M3 with per-layer scales) and writes each new token in place at a position held on
  the device (``index_copy_``); attention reads the whole buffer, the positions not yet written
  (and the prompts' left padding) masked out.
- The mask is a ``[B, T]`` "seen" buffer, one column switched on per step; position ids, the last
  token, "finished" and the outputs (tokens, log-probs, valid flags) are buffers written in place
  at a step counter on the device.
- ``FP8RL_KV_WRITE`` (on CUDA unless ``torch``) writes each step's E4M3 K/V in one Triton
  launch; beside the Triton attention (``FP8RL_DECODE_ATTENTION=triton``) RoPE joins that launch
  (:func:`~workers.engines.native.decode_attention.fuse_rope`, bit for bit Hugging Face's).
- Sampling is the eager path's exponential race (:func:`sample_top_p`; with
  ``FP8RL_SAMPLING=triton`` its three-launch kernel) with its generator registered on the graph,
  so a replay draws fresh numbers and ``manual_seed`` re-seeds it.
- One capture per (batch, prompt length rounded up to 16, new tokens, temperature, top-p),
  reused across RL steps (prompt batches of one job have the same shape); the few most recent
  shapes are kept (:attr:`StaticDecoder.max_graphs`).
- FP8 weights: weight sync writes new weights into the storage the graph reads
  (:meth:`~workers.fp8.linear.Fp8Linear.load_fp8_weight` copies in place), and the FP8 quantizer's
  NaN/inf guard is a buffer of the graph's own, re-armed before and read once after the replays.
  The prefill's guard is read there too: the host waits for the GPU once per generate, after it
  has issued all of the generate's work (a NaN in the prefill is still the one reported).

Without graphs (``use_graphs=False``: CPU, tests) the same step runs eagerly: the static path's
reference against the dynamic-cache loop in :mod:`workers.engines.native.generator`, which stays
the reference and the CPU default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from workers.engines.batching import StopIds, positions, stop_ids
from workers.engines.models import BOOL_MASKS, attention_mask_4d
from workers.engines.native import decode_attention
from workers.engines.native.sampling import AllFinished, next_token, stops
from workers.engines.native.sampling import enabled as sampling_enabled
from workers.engines.native.sampling import log_softmax as plain_log_softmax
from workers.fp8.dispatch import to_device
from workers.fp8.formats import to_float32
from workers.fp8.guard import FiniteGuard, finite_guard, use_guard
from workers.fp8.kv_cache import KvScaleCalibrator, KvScales, quantize_kv

PROMPT_MULTIPLE = 16  # prompts are left-padded to a multiple of this: fewer distinct graph shapes


def fused_kv_write(device: torch.device) -> bool:
    """``FP8RL_KV_WRITE``: ``triton`` (one launch per K or V per layer and step,
    :mod:`workers.fp8.triton_kv`; CUDA, or the CPU under Triton's interpreter) or ``torch``
    (quantize, then ``index_copy_``). Unset: ``triton`` on CUDA where Triton is installed (an H200
    measured it bit for bit and faster, 2026-11-29), ``torch`` elsewhere. Asked for where it cannot
    run, it logs why once and the torch path runs."""
    from workers.fp8.dispatch import triton_switch

    return triton_switch(
        "FP8RL_KV_WRITE", "torch", "triton", device, "the torch KV-cache write", on_cuda_when_unset=True
    )


class StaticKvCache(DynamicCache):
    """K and V of every layer in preallocated ``[B, H_kv, T, D]`` buffers, written in place.

    ``decoding`` False (the prefill): ``update`` writes positions ``[0, P)`` and returns them;
    calibrates an FP8 cache's per-layer scales on them (as :class:`~workers.fp8.kv_cache.Fp8KvCache`
    does), into scale buffers of fixed address. ``decoding`` True: ``update`` writes one position,
    :attr:`index` (a device tensor the step advances), and returns the whole buffers (an FP8
    cache dequantized: the same values the dynamic FP8 cache gives).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        length: int,
        dtype: torch.dtype,
        device: torch.device,
        fp8: bool = False,
    ) -> None:
        super().__init__()
        store = torch.float8_e4m3fn if fp8 else dtype
        shape = (batch, kv_heads, length, head_dim)
        # zeros, not empty: a masked position still enters attention as weight 0 x value, and
        # uninitialised memory may hold NaN bit patterns (0 x NaN is NaN)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.dtype, self.length, self.fp8 = dtype, length, fp8
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # next decode position
        self.prompt_len = self.extra_padding = 0
        self.decoding = False
        self.calibrator = KvScaleCalibrator(num_layers) if fp8 else None
        self.fixed = False  # scales set by use_scales (else calibrated on each prefill)
        self.raw = False  # decode: return the stored buffers as they are (the Triton attention reads them)
        # FP8RL_KV_WRITE (on CUDA unless torch): each E4M3 decode write in one launch (workers.fp8.triton_kv)
        self.fused_write = fp8 and fused_kv_write(device)
        self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
        self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=device)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.prompt_len  # the host's count (positions come from position_ids)

    def use_scales(self, scales: KvScales | None) -> None:
        """Fixed per-layer scales (the trainer's, received with the weights), copied into the
        scale buffers (their addresses stay: graphs hold them); ``None``: calibrate each prefill."""
        if not self.fp8:
            return
        self.fixed = scales is not None
        if scales is not None:
            self.k_scale.copy_(scales.k)
            self.v_scale.copy_(scales.v)

    def start(self, prompt_len: int, extra_padding: int = 0) -> None:
        """Before a prefill of ``prompt_len`` positions whose first ``extra_padding`` are padding
        the caller added (the FP8 scales are calibrated without them, as the dynamic cache,
        which never sees them, calibrates)."""
        if prompt_len >= self.length:
            raise ValueError(f"prompt of {prompt_len} positions leaves no room in a cache of {self.length}")
        self.prompt_len, self.extra_padding, self.decoding = prompt_len, extra_padding, False
        if self.calibrator is not None and not self.fixed:
            self.calibrator.reset()
        self.index.fill_(prompt_len)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = self.k[layer_idx], self.v[layer_idx]
        if not self.decoding:
            p = key_states.shape[2]
            if self.calibrator is not None and not self.fixed:
                e = self.extra_padding
                self.calibrator.observe(layer_idx, key_states[:, :, e:], value_states[:, :, e:])
                ks, vs = self.calibrator.layer_scales(layer_idx)
                self.k_scale[layer_idx].copy_(ks)
                self.v_scale[layer_idx].copy_(vs)
            k_buf[:, :, :p].copy_(self._store(key_states, self.k_scale[layer_idx]))
            v_buf[:, :, :p].copy_(self._store(value_states, self.v_scale[layer_idx]))
            return (
                self._read(k_buf[:, :, :p], self.k_scale[layer_idx]),
                self._read(v_buf[:, :, :p], self.v_scale[layer_idx]),
            )
        for buf, x, scale in ((k_buf, key_states, self.k_scale), (v_buf, value_states, self.v_scale)):
            if self.fused_write:
                from workers.fp8.triton_kv import write_kv

                write_kv(x, scale[layer_idx], self.index, buf)
                continue
            new = self._store(x, scale[layer_idx])
            if self.fp8:  # index_copy_ has no FP8 kernel on every device: copy the bytes
                buf, new = buf.view(torch.uint8), new.view(torch.uint8)
            buf.index_copy_(2, self.index, new)
        if self.raw:
            return k_buf, v_buf
        return self._read(k_buf, self.k_scale[layer_idx]), self._read(v_buf, self.v_scale[layer_idx])

    def _store(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return quantize_kv(x, scale).data if self.fp8 else x

    def _read(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # the dynamic FP8 cache's arithmetic: float32 product, then the model's dtype
        return (to_float32(data) * scale).to(self.dtype) if self.fp8 else data

    @property
    def nbytes(self) -> int:
        held = sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
        return held + (self.k_scale.numel() + self.v_scale.numel()) * 4 * self.fp8


@dataclass(frozen=True)
class DecodeShape:
    """What one capture is specific to."""

    batch: int
    prompt_len: int  # after rounding up to PROMPT_MULTIPLE
    new_tokens: int
    temperature: float
    top_p: float
    eos_ids: tuple[int, ...]
    pad_id: int


class _Session:
    """The buffers (and the graph) of one :class:`DecodeShape`."""

    def __init__(self, shape: DecodeShape, cache: StaticKvCache, device: torch.device) -> None:
        b, n = shape.batch, shape.new_tokens
        self.shape, self.cache = shape, cache
        self.seen = torch.zeros(b, cache.length, dtype=torch.bool, device=device)  # [B, T]
        self.tok = torch.zeros(b, dtype=torch.long, device=device)  # last sampled token
        self.next_pos = torch.zeros(b, dtype=torch.long, device=device)
        self.finished = torch.zeros(b, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        self.logps = torch.zeros(b, n, dtype=torch.float32, device=device)
        self.valid = torch.zeros(b, n, dtype=torch.bool, device=device)
        # [S], made once; pinned + non-blocking: a pageable copy would make the host wait
        self.stop = to_device(torch.tensor(shape.eos_ids, dtype=torch.long), device)
        no_rng = device.type == "meta"  # a shape-only dry run has no generator
        self.gen = None if no_rng else torch.Generator(device=device)
        self.guard = FiniteGuard()  # the graph's own NaN/inf codes (see the module docstring)
        self.graph: Any = None


class StaticDecoder:
    """Samples with a :class:`StaticKvCache`, one decode step per graph replay (see the module
    docstring). ``model`` is the generator's policy; ``log_softmax`` its log-softmax."""

    max_graphs = 4

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        use_graphs: bool,
        fp8_kv_cache: bool,
        log_softmax: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        cfg: Any = model.config
        self.model, self.device, self.use_graphs, self.fp8_kv = model, device, use_graphs, fp8_kv_cache
        self.log_softmax = log_softmax
        self.num_layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        # the Triton decode attention (workers/engines/native/decode_attention.py) where enabled:
        # decode steps read the cache up to its length; everything else stays on SDPA
        self.kernel_attention = decode_attention.enabled(device)
        if self.kernel_attention:
            cfg._attn_implementation = decode_attention.ATTENTION_NAME
        self.impl = str(cfg._attn_implementation)
        self.dtype = model.get_input_embeddings().weight.dtype  # type: ignore[operator]
        # FP8RL_KV_WRITE=triton beside the Triton attention: a decode step's RoPE and K/V write in
        # one launch (decode_attention.fuse_rope; BF16 or E4M3 cache); tests may turn it off
        self.fused_rope = (
            self.kernel_attention
            and self.dtype == torch.bfloat16
            and fused_kv_write(device)
            and decode_attention.fuse_rope(model) > 0
        )
        # FP8RL_SAMPLING=triton: each step's sampling in three launches (plain log-softmax only)
        self.fused_sampling = log_softmax is plain_log_softmax and sampling_enabled(device)
        self.sessions: OrderedDict[DecodeShape, _Session] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests and benchmarks read it)

    def _session(self, shape: DecodeShape) -> _Session:
        s = self.sessions.pop(shape, None)
        if s is None:
            while len(self.sessions) >= self.max_graphs:
                self.sessions.popitem(last=False)  # the oldest shape's graph and buffers go
            length = shape.prompt_len + shape.new_tokens
            cache = StaticKvCache(
                self.num_layers, shape.batch, self.kv_heads, self.head_dim, length, self.dtype,
                self.device, self.fp8_kv,
            )  # fmt: skip
            cache.raw = self.kernel_attention
            s = _Session(shape, cache, self.device)
        self.sessions[shape] = s  # most recent last
        return s

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        eos: StopIds,
        pad_id: int,
        kv_scales: KvScales | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :meth:`NativeGenerator.generate_on_device` returns, for left-padded ``ids``/``attn``;
        an FP8 cache uses ``kv_scales`` (the trainer's), or without them calibrates on the prefill."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be positive")
        extra = -ids.shape[1] % PROMPT_MULTIPLE  # more left padding: a shared prompt length
        ids = torch.nn.functional.pad(ids, (extra, 0), value=pad_id)
        attn = torch.nn.functional.pad(attn, (extra, 0), value=0)
        b, p = ids.shape
        s = self._session(
            DecodeShape(b, p, max_new_tokens, float(temperature), float(top_p), stop_ids(eos), pad_id)
        )
        if s.gen is not None:
            s.gen.manual_seed(seed)
        cache = s.cache
        cache.use_scales(kv_scales)
        cache.start(p, extra)
        # the prefill and the first token, eagerly; their guard is read at the end with the loop's
        with finite_guard(check=False) as prefill_guard:
            pos = positions(attn)  # [B, P]
            out = self.model(
                input_ids=ids,
                attention_mask=attention_mask_4d(attn, p, self.dtype, self.impl),
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position samples: no [B, P, V] logits
            )
            s.seen.zero_()
            s.seen[:, :p].copy_(attn.bool())
            s.next_pos.copy_(pos[:, -1] + 1)
            s.finished.zero_()
            s.step.zero_()
            s.valid.zero_()
            self._sample(s, out.logits[:, -1, :])
        cache.decoding = True
        done, all_finished = 1, AllFinished(self.device)
        all_finished.post(s.finished)
        s.guard.rearm(self.device)
        with use_guard(s.guard):
            while done < max_new_tokens and not all_finished:
                if self.use_graphs and s.graph is None:
                    side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):
                        self._step(s)  # a real step, run eagerly as the capture's warm-up
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    self._capture(s)
                elif s.graph is not None:
                    s.graph.replay()
                else:
                    self._step(s)
                done += 1
                all_finished.post(s.finished)
        mask = s.valid[:, :done].float()
        out = s.tokens[:, :done].clone(), mask, s.logps[:, :done] * mask
        # the host's reads, after every launch of the generate: the prefill's NaN/inf first
        prefill_guard.check()
        s.guard.check()
        return out

    def _capture(self, s: _Session) -> None:
        """Capture one step of ``s`` (its first step ran eagerly on a side stream just before, as
        warm-up: libraries allocate their workspaces and compile their kernels outside capture)."""
        graph = torch.cuda.CUDAGraph()
        if s.gen is not None:
            graph.register_generator_state(s.gen)
        with torch.cuda.graph(graph):
            self._step(s)
        s.graph = graph
        self.captures += 1

    def _step(self, s: _Session) -> None:
        """One decode step, every tensor static: feed the last token, sample the next."""
        cache = s.cache
        s.seen.index_fill_(1, cache.index, True)
        mask = s.seen[:, None, None, :]  # [B, 1, 1, T]
        if self.impl not in BOOL_MASKS:  # additive, as attention_mask_4d builds it for eager attention
            zero = torch.zeros((), dtype=self.dtype, device=mask.device)
            mask = torch.where(mask, zero, torch.finfo(self.dtype).min)
        kernel = decode_attention.active(cache, s.seen, self.fused_rope) if self.kernel_attention else None
        with kernel or nullcontext():
            out = self.model(
                input_ids=s.tok[:, None],
                attention_mask=mask,
                position_ids=s.next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
        self._sample(s, out.logits[:, -1, :])
        cache.index.add_(1)
        s.next_pos.add_(1)

    def _sample(self, s: _Session, logits: torch.Tensor) -> None:
        """The eager loop's sampling, its results written at the step counter."""
        shape = s.shape
        tok, logp = next_token(
            logits, shape.temperature, shape.top_p, s.gen, s.finished, shape.pad_id, self.log_softmax,
            self.fused_sampling,
        )  # fmt: skip
        s.valid.index_copy_(1, s.step, (~s.finished)[:, None])
        s.logps.index_copy_(1, s.step, logp[:, None])
        s.tokens.index_copy_(1, s.step, tok[:, None])
        s.finished.logical_or_(stops(tok, s.stop))
        s.tok.copy_(tok)
        s.step.add_(1)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the most recently used session's cache."""
        return next(reversed(self.sessions.values())).cache.nbytes if self.sessions else 0

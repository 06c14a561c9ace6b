"""The native generator: batched sampling with a KV cache on a Hugging Face Llama/Qwen2 in torch.

Weights are BF16 (as vLLM serves them); under ``fp8-gen`` and ``fp8-e2e`` the decoder linears are
:class:`~workers.fp8.linear.Fp8Linear` holding only the FP8 weights the trainer sends (data +
scales; the high-precision copy is dropped), used unchanged.

FP8 KV cache: keys and values are stored as E4M3 bytes with one scale per layer for K and one
for V: the trainer's, received with the weights (calibrated before the first rollout and after
every update, :mod:`workers.fp8.kv_cache`), or, before any update carried them (the offline tools),
calibrated on each batch's prefill. Attention reads them dequantized (``data * scale`` in
float32, then the model's dtype), layer by layer, so the cache holds 1 byte per element.

Under ``precision.exact`` the model is built on :mod:`workers.engines.exact`: a token's log-prob
is then bit for bit the one the trainer computes in its full-sequence forward.

Log-probs are those of the sampled token under the temperature-scaled distribution *before* top-p
filtering, the convention of vLLM's ``logprobs`` and the one the trainer reproduces. Temperature 0
is greedy decoding (argmax of the logits, for validation), its log-probs those at temperature 1.

The decode loop never waits for the GPU: sampling uses the exponential-race form of
``torch.multinomial`` (which itself reads its input back to validate it), masks are built here
(Hugging Face's SDPA mask reads the mask back), and "every row finished" is copied to pinned
host memory asynchronously and read once its CUDA event has completed, so the loop may run a
step or two past the end of the last sequence instead of stalling on every token.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rljob.spec import JobSpec
from workers.engines.batching import StopIds, left_pad, positions, stop_ids
from workers.engines.exact import is_exact
from workers.engines.exact import log_softmax as exact_log_softmax
from workers.engines.layer_diff import Trace, trace_generation
from workers.engines.models import apply_recipe, attention_mask_4d, build_policy
from workers.engines.native.rms_norm import chain_layer_adds, emit_fp8_tiles, fuse_norms
from workers.engines.native.sampling import AllFinished, next_token, stops
from workers.engines.native.sampling import enabled as sampling_enabled
from workers.engines.native.sampling import log_softmax as plain_log_softmax
from workers.engines.native.static_decode import StaticDecoder
from workers.engines.protocols import Rollouts
from workers.fp8.convert import Fp8Audit, drop_master_weights, weight_bytes
from workers.fp8.dispatch import to_device
from workers.fp8.formats import get_format
from workers.fp8.fused import fuse_projections, fuse_silu_mul, silu_mul_enabled
from workers.fp8.guard import finite_guard
from workers.fp8.kv_cache import Fp8KvCache, KvScales, kv_cache_bytes
from workers.weight_sync.broadcast import CollectiveWeightSync
from workers.weight_sync.contract import (
    dtype_name,
    is_kv_scale,
    kv_cache_dtype,
    kv_scale_tensors,
    received_weights,
)
from workers.weight_sync.data import KvHeld, Payload, SyncResult, WeightReport
from workers.weight_sync.payload import fp8_weight_names, load_weights


class NativeGenerator:
    """Generator protocol on a torch model (CPU or one GPU)."""

    def __init__(
        self, spec: JobSpec, vocab_size: int, eos: StopIds, pad_id: int, device: str = "cpu"
    ) -> None:
        self.spec, self.pad_id, self.device = spec, pad_id, torch.device(device)
        self.eos_ids = stop_ids(eos)  # a response ends at any of them
        # on the device once: the decode loop compares each token with them without a copy
        self.stop = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self.model = build_policy(spec, vocab_size, torch.bfloat16, self.device)
        self.model.requires_grad_(False)
        self.audit: Fp8Audit = apply_recipe(self.model, spec.precision, "generator")
        # FP8RL_RMS_NORM=triton: every RMSNorm in one kernel, as the trainer's (rms_norm.py)
        self.fused_norms = fuse_norms(self.model, self.device)
        # and in an FP8 generator the layers' norms write their output's 1x128 tiles for q/k/v and
        # gate/up in the same pass (the bytes their quantizer would make)
        self.emitting_norms = emit_fp8_tiles(self.model) if self.fused_norms else 0
        # and each layer's closing add runs in the next norm's kernel (no add kernel of its own)
        self.chained_adds = chain_layer_adds(self.model) if self.fused_norms else 0
        drop_master_weights(self.model)  # FP8 layers keep their FP8 weight only
        # q/k/v and gate/up as one FP8 GEMM each on a GPU (same bytes; workers/fp8/fused.py); the
        # CPU keeps one emulated GEMM per layer (its results stay those of earlier runs)
        self.fused_groups = (
            fuse_projections(self.model) if self.device.type == "cuda" and not is_exact(self.model) else 0
        )
        # FP8RL_SILU_MUL=triton: the MLP's SiLU, product and down-projection quantizer in one pass
        fuse_mlps = self.fused_groups and silu_mul_enabled(self.device)
        self.fused_mlps = fuse_silu_mul(self.model) if fuse_mlps else 0
        # FP8RL_SAMPLING=triton: each decode step's sampling in three launches (not row-exact)
        self.fused_sampling = not is_exact(self.model) and sampling_enabled(self.device)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.kv_cache_bytes = 0
        self.kv_scales: KvScales | None = None  # the FP8 KV cache's, as received with the weights
        self.channel: CollectiveWeightSync | None = None
        self._report: WeightReport | None = None
        self.static = self._static_decoder()

    def _static_decoder(self) -> StaticDecoder | None:
        """The graph-captured decode loop where ``rollout.decode`` asks for it (auto: on CUDA)."""
        mode = self.spec.rollout.decode
        if mode == "graph" and self.device.type != "cuda":
            raise ValueError(
                f"rollout.decode: graph needs a CUDA GPU, and this generator runs on {self.device}; "
                "use auto (graphs on CUDA, eager elsewhere) or eager"
            )
        if mode == "eager" or (mode == "auto" and self.device.type != "cuda") or is_exact(self.model):
            return None
        return StaticDecoder(
            self.model, self.device, True, self.spec.precision.fp8_kv_cache, plain_log_softmax
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes the model's weights hold on their device (FP8 data + scales for FP8 layers)."""
        return weight_bytes(self.model)

    def fp8_weight_names(self) -> list[str]:
        return fp8_weight_names(self.model)

    def load_weights(self, payload: Payload) -> None:
        both = kv_scale_tensors(payload)  # on the device: nothing read back
        if both is not None:  # the trainer's K/V-cache scales: fixed until the next update (module docstring)
            k, v = both.to(self.device).unbind()
            self.kv_scales = KvScales(k, v, get_format("e4m3"))
        load_weights(self.model, {n: t for n, t in payload.items() if not is_kv_scale(n)})
        self._report = self._held(payload)

    def _held(self, payload: Payload) -> WeightReport:
        """What the model holds after loading ``payload``: each weight's received bytes and the
        precision its layer computes with (an ``Fp8Linear``'s weight: ``fp8``; else the dtype of
        the parameter it was copied into), and the K/V-cache scales it holds (none before any
        update carried them: the cache then calibrates its own on each prefill)."""
        params = dict(self.model.named_parameters())
        fp8 = set(fp8_weight_names(self.model))
        holds = {n: "fp8" if n in fp8 else dtype_name(params[n].dtype) for n in payload if n in params}
        held = self.kv_scales
        k, v = ([], []) if held is None else torch.stack([held.k, held.v]).tolist()  # one read
        kv = KvHeld(dtype=kv_cache_dtype(self.spec.precision.fp8_kv_cache), k_scales=k, v_scales=v)
        return WeightReport(weights=received_weights(payload, holds), kv=kv)

    def weight_report(self) -> WeightReport:
        if self._report is None:
            raise RuntimeError("weight_report: no weights were loaded yet")
        return self._report

    def join_weight_channel(self, address: str, first_rank: int, world_size: int) -> None:
        from workers.weight_sync.channel import WeightChannel

        self.channel = WeightChannel(address, first_rank, world_size, self.device)
        self.channel.init_communicator()

    def receive_weights(self) -> SyncResult:
        if self.channel is None:
            raise RuntimeError("receive_weights: join_weight_channel() first")
        result = self.channel.sync_weights(None)
        assert result.payload is not None
        self.load_weights(result.payload)
        result.payload = None  # loaded: do not keep a second copy alive
        return result

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> Trace:
        """Every module's output at the query predicting ``response[-1]`` after ``prompt``, computed
        as :meth:`generate` does (prefill, then decode steps; :mod:`workers.engines.layer_diff`)."""
        cache = self._new_cache()
        return trace_generation(self.model, prompt, response, cache)

    def _new_cache(self) -> DynamicCache:
        """A batch's KV cache: FP8 with the received scales (or its own per prefill), or BF16."""
        if not self.spec.precision.fp8_kv_cache:
            return DynamicCache()
        return Fp8KvCache(self.num_layers, self.kv_scales)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> Rollouts:
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_id)  # [B, P]
        ids, mask, logps = self.generate_on_device(
            to_device(prompt_ids, self.device),
            to_device(prompt_mask, self.device),
            max_new_tokens,
            temperature,
            top_p,
            seed,
        )
        return Rollouts(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=ids.cpu(),
            response_mask=mask.cpu(),
            logprobs=logps.cpu(),
        )

    @torch.no_grad()
    def generate_on_device(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample from left-padded ``ids``/``attn [B, P]`` on the model's device (``temperature``
        0: greedy, ``top_p`` and ``seed`` unused).

        Returns ``(response_ids [B, L] int64, response_mask [B, L] float32, logprobs [B, L]
        float32)`` on the device, without a host sync until the guards' reads at the end.
        """
        if self.static is not None:
            out = self.static.generate(
                ids, attn, max_new_tokens, temperature, top_p, seed, self.eos_ids, self.pad_id, self.kv_scales
            )
            self.kv_cache_bytes = self.static.kv_cache_bytes
            return out
        # on the meta device (a shape-only dry run: tests prove the loop never reads back) there
        # is no generator to seed
        gen = None if self.device.type == "meta" else torch.Generator(device=self.device).manual_seed(seed)
        b = ids.shape[0]
        cache = self._new_cache()
        impl = str(self.model.config._attn_implementation)
        dtype = self.model.get_input_embeddings().weight.dtype
        log_softmax = exact_log_softmax if is_exact(self.model) else plain_log_softmax
        with finite_guard():
            pos = positions(attn)  # [B, P]
            out = self.model(
                input_ids=ids,
                attention_mask=attention_mask_4d(attn, ids.shape[1], dtype, impl),
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # only the last position samples: no [B, P, V] logits
            )
            next_pos = pos[:, -1] + 1  # [B]
            tokens, logps, valid = [], [], []
            finished = torch.zeros(b, dtype=torch.bool, device=self.device)
            all_finished = AllFinished(self.device)
            for _ in range(max_new_tokens):
                tok, logp = next_token(
                    out.logits[:, -1, :], temperature, top_p, gen, finished, self.pad_id, log_softmax,
                    self.fused_sampling,
                )  # fmt: skip
                valid.append(~finished)
                logps.append(logp)
                tokens.append(tok)
                finished = finished | stops(tok, self.stop)
                all_finished.post(finished)
                if len(tokens) == max_new_tokens or all_finished:
                    break
                attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=attention_mask_4d(attn, 1, dtype, impl),
                    position_ids=next_pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                next_pos = next_pos + 1
        mask = torch.stack(valid, 1).float()  # [B, L]
        self.kv_cache_bytes = kv_cache_bytes(cache)
        return torch.stack(tokens, 1), mask, torch.stack(logps, 1) * mask

"""The Generator protocol on vLLM: block-FP8 weights, FP8 KV cache, weights from the trainer over NCCL.

Written against vLLM 0.32.0 (the worker image's pin; ``VLLM_VERSION``). One ``vllm.LLM`` lives in
the generator actor, over ``resources.generator_tensor_parallel_size`` GPUs.

- **FP8 weights as vLLM loads FP8 checkpoints.** ``quantization="fp8"`` with a block-FP8
  ``quantization_config`` (``hf_overrides``): E4M3 weights in 128x128 blocks with float32
  ``weight_scale_inv``, activations quantized dynamically (1x128). The layers the audit keeps in
  BF16 (``precision.keep_bf16_layers``) are its ``ignored_layers``; embeddings and lm_head are never
  quantized by vLLM. vLLM's DeepGEMM path would re-round the scales to powers of two
  (``VLLM_USE_DEEP_GEMM_E8M0``); it is switched off unless the job asks for power-of-two scales,
  so the generator computes with the trainer's own scales.
- **Weights.** The engine starts on dummy weights (``load_format="dummy"``); the trainer's
  payload arrives before the first rollout over the weight channel
  (:mod:`workers.engines.weight_channel`) in vLLM's worker processes (:mod:`workers.engines.vllm.worker`),
  as checkpoint-format tensors (:func:`workers.fp8.hf_checkpoint.checkpoint_tensors`): the FP8
  bytes and scales of the trainer, unchanged, loaded through vLLM's layerwise reload, which runs
  vLLM's post-load processing again and copies into the tensors CUDA graphs captured. The prefix
  cache is reset after every update (its KV was computed with the old weights).
- **FP8 KV cache.** ``kv_cache_dtype="fp8"``. vLLM 0.32 has no per-step scale calibration of its
  own, so the trainer calibrates K/V scales every step (p99.9 x 1.05 / 448 per layer) and sends
  them with the weights (``model.layers.{i}.self_attn.k_scale``).
- **Log-probs.** ``logprobs_mode="processed_logprobs"`` and ``SamplingParams(logprobs=0)``: the
  sampled token's log-softmax after temperature, what the trainer's ``log_softmax(logits / T)``
  computes. At temperature 0 (greedy) vLLM applies no temperature: log-probs at temperature 1, as
  the protocol says. With ``top_p < 1`` vLLM renormalises over the kept tokens; the native
  generator does not.

Everything above the :class:`VllmGenerator` class is pure and tested on CPU; vLLM is imported in
``__init__`` only.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from rljob.spec import JobSpec, PrecisionSpec
from workers.engines.batching import left_pad
from workers.engines.models import model_config
from workers.engines.protocols import Payload, Rollouts
from workers.fp8.convert import AuditRow, Fp8Audit
from workers.fp8.hf_checkpoint import WEIGHT_BLOCK, check_tp_partitions, quantization_config
from workers.weight_sync import SyncResult

VLLM_VERSION = "0.32.0"
WORKER_EXTENSION = "workers.engines.vllm.worker.WeightChannelExtension"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def decoder_linears(hf_config: Any) -> list[tuple[int, str, tuple[int, int]]]:
    """``(layer, HF module path, (out, in))`` of every decoder linear of a Llama/Qwen2 config."""
    hidden = int(hf_config.hidden_size)
    heads, kv_heads = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    ffn = int(hf_config.intermediate_size)
    shapes = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
    }
    out = []
    for i in range(int(hf_config.num_hidden_layers)):
        for name in _ATTENTION:
            out.append((i, f"model.layers.{i}.self_attn.{name}", shapes[name]))
        for name in _MLP:
            out.append((i, f"model.layers.{i}.mlp.{name}", shapes[name]))
    return out


def generator_layout(hf_config: Any, precision: PrecisionSpec) -> tuple[list[str], dict[str, str]]:
    """``(FP8 weight names, {BF16 linear module: reason})`` of the vLLM generator under the recipe.

    The same rule as the native generator (:func:`workers.engines.models.apply_recipe`): every
    decoder linear in FP8 under ``fp8-gen`` and ``fp8-e2e``, except the first/last
    ``keep_bf16_layers``; lm_head always BF16.
    """
    layers = int(hf_config.num_hidden_layers)
    first, last = precision.keep_bf16_layers
    fp8: list[str] = []
    bf16: dict[str, str] = {"lm_head": "lm_head stays BF16"}
    for i, module, _ in decoder_linears(hf_config):
        if precision.recipe == "bf16":
            bf16[module] = "recipe bf16: the generator runs BF16"
        elif i < first or i >= layers - last:
            bf16[module] = f"keep_bf16_layers {list(precision.keep_bf16_layers)}"
        else:
            fp8.append(f"{module}.weight")
    return fp8, bf16


def check_layout(hf_config: Any, fp8_names: Sequence[str], tp: int) -> None:
    """Refuse a layout vLLM cannot hold in block FP8 (:func:`check_tp_partitions`): every FP8
    layer's per-GPU part must be whole 128x128 blocks."""
    shapes = {f"{m}.weight": s for _, m, s in decoder_linears(hf_config) if f"{m}.weight" in set(fp8_names)}
    check_tp_partitions(shapes, tp)


def vllm_environment(precision: PrecisionSpec) -> dict[str, str]:
    """Environment of vLLM's processes: DeepGEMM must not re-round float scales to powers of two."""
    return {"VLLM_USE_DEEP_GEMM_E8M0": "1" if precision.power_of_two_scales else "0"}


def engine_kwargs(spec: JobSpec, model: str, ignored_layers: Sequence[str]) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of a job: ``model`` is a Hugging Face id or a config directory."""
    res, precision = spec.resources, spec.precision
    kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,  # prompts arrive as token ids; responses leave as token ids
        "dtype": "bfloat16",
        "tensor_parallel_size": res.generator_tensor_parallel_size,
        "seed": spec.rollout.seed,
        "load_format": "dummy",  # the trainer's weights arrive before the first rollout
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prefix_caching": True,  # a GRPO group shares its prompt; reset after each update
    }
    if precision.recipe != "bf16":
        kwargs["quantization"] = "fp8"
        kwargs["hf_overrides"] = {"quantization_config": quantization_config(list(ignored_layers))}
    if precision.fp8_kv_cache:
        kwargs["kv_cache_dtype"] = "fp8"
    return kwargs


def sampling_kwargs(
    max_new_tokens: int, temperature: float, top_p: float, seed: int, eos_id: int
) -> dict[str, Any]:
    """``vllm.SamplingParams(**kwargs)`` of one request: the sampled token's log-prob, our EOS."""
    return {
        "n": 1,
        "temperature": temperature,  # 0: greedy (vLLM then forces top_p 1)
        "top_p": top_p if temperature > 0 else 1.0,
        "top_k": 0,  # disabled
        "max_tokens": max_new_tokens,
        "seed": seed,
        "logprobs": 0,  # the sampled token only
        "stop_token_ids": [eos_id],
        "ignore_eos": False,
        "detokenize": False,
    }


def rollouts_from_outputs(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Any], pad_id: int, eos_id: int
) -> Rollouts:
    """Our :class:`Rollouts` from vLLM ``RequestOutput`` objects, one per prompt in order.

    Reads only documented fields: ``outputs[0].token_ids`` (EOS included when it stopped on it)
    and ``outputs[0].logprobs`` (per position ``{token id: Logprob(logprob=...)}``). Tokens after
    an EOS, if any, are dropped.
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    rows: list[tuple[list[int], list[float]]] = []
    for out in outputs:
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        if eos_id in ids:
            ids = ids[: ids.index(eos_id) + 1]
        if completion.logprobs is None or len(completion.logprobs) < len(ids):
            raise ValueError(
                "vLLM returned no log-prob per sampled token: SamplingParams(logprobs=0) is required"
            )
        logps = [float(completion.logprobs[t][tok].logprob) for t, tok in enumerate(ids)]
        rows.append((ids, logps))
    prompt_ids, prompt_mask = left_pad([list(p) for p in prompts], pad_id)
    width = max(1, max(len(ids) for ids, _ in rows))
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, logps) in enumerate(rows):
        n = len(ids)
        response_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, :n] = 1.0
        logprobs[i, :n] = torch.tensor(logps, dtype=torch.float32)
    return Rollouts(prompt_ids, prompt_mask, response_ids, response_mask, logprobs)


def kv_bytes_per_token(hf_config: Any, fp8_kv_cache: bool) -> int:
    """Bytes one token's K and V take over all layers (BF16, or FP8 with ``fp8_kv_cache``)."""
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)
    per_layer = 2 * int(hf_config.num_key_value_heads) * head_dim * (1 if fp8_kv_cache else 2)
    return per_layer * int(hf_config.num_hidden_layers)


def generator_audit(hf_config: Any, precision: PrecisionSpec) -> Fp8Audit:
    """The per-layer audit of the vLLM generator (what :func:`generator_layout` decides)."""
    fp8, bf16 = generator_layout(hf_config, precision)
    fp8_set = set(fp8)
    rows = []
    for _, module, (n, k) in decoder_linears(hf_config):
        if f"{module}.weight" in fp8_set:
            blocks = -(-n // WEIGHT_BLOCK[0]) * -(-k // WEIGHT_BLOCK[1])
            rows.append(
                AuditRow(
                    module,
                    "linear",
                    "fp8",
                    "vLLM block FP8 (128x128 E4M3, dynamic 1x128 activations)",
                    (n, k),
                    2 * n * k,
                    n * k + 4 * blocks,
                    {"fprop": "vllm_block_fp8"},
                )
            )
        else:
            rows.append(AuditRow(module, "linear", "bfloat16", bf16[module], (n, k), 2 * n * k, 2 * n * k))
    vocab, hidden = int(hf_config.vocab_size), int(hf_config.hidden_size)
    rows.append(
        AuditRow(
            "lm_head",
            "lm_head",
            "bfloat16",
            bf16["lm_head"],
            (vocab, hidden),
            2 * vocab * hidden,
            2 * vocab * hidden,
        )
    )
    audit = Fp8Audit(precision.recipe, rows, device="CUDA (vLLM)")
    if fp8:
        audit.formats = "E4M3 weights (128x128 blocks) and activations (1x128, dynamic)"
    return audit


class VllmGenerator:
    """Generator protocol on an in-process ``vllm.LLM`` (one GPU, or tensor parallel)."""

    def __init__(
        self, spec: JobSpec, vocab_size: int, eos_id: int, pad_id: int, device: str = "cuda"
    ) -> None:
        self.spec, self.eos_id, self.pad_id = spec, eos_id, pad_id
        self.hf_config = model_config(spec, vocab_size)
        self.fp8_names, bf16 = generator_layout(self.hf_config, spec.precision)
        check_layout(self.hf_config, self.fp8_names, spec.resources.generator_tensor_parallel_size)
        self.audit: Fp8Audit = generator_audit(self.hf_config, spec.precision)
        self.kv_cache_bytes = 0
        self._per_token = kv_bytes_per_token(self.hf_config, spec.precision.fp8_kv_cache)
        os.environ.update(vllm_environment(spec.precision))  # vLLM's processes inherit it
        model = spec.model.name
        if model is None:  # a tiny model from the spec: vLLM reads its config from a directory
            self._config_dir = tempfile.TemporaryDirectory(prefix="fp8rl-vllm-")
            self.hf_config.save_pretrained(self._config_dir.name)
            model = self._config_dir.name
        from vllm import LLM

        ignored = sorted(m for m in bf16 if m != "lm_head")
        self.llm = LLM(**engine_kwargs(self.spec, model, ignored))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on the GPUs, from the layout (FP8: data + scales; BF16: 2 per value)."""
        return sum(r.bytes_after for r in self.audit.rows)

    def fp8_weight_names(self) -> list[str]:
        return list(self.fp8_names)

    def load_weights(self, payload: Payload) -> None:
        raise RuntimeError(
            "the vLLM generator loads weights in vLLM's own processes: join_weight_channel() and "
            "receive_weights() (the driver does this for generator_engine vllm)"
        )

    def join_weight_channel(self, address: str, first_rank: int, world_size: int) -> None:
        self.llm.collective_rpc("fp8rl_join_channel", args=(address, first_rank, world_size))

    def receive_weights(self) -> SyncResult:
        results = self.llm.collective_rpc("fp8rl_receive_weights")
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        first = results[0]
        return SyncResult(
            int(first["version"]), int(first["bytes"]), float(first["seconds"]), int(first["buckets"])
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> Rollouts:
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(**sampling_kwargs(max_new_tokens, temperature, top_p, seed + i, self.eos_id))
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        rollouts = rollouts_from_outputs(prompts, outputs, self.pad_id, self.eos_id)
        tokens = int(rollouts.prompt_mask.sum()) + int(rollouts.response_mask.sum())
        self.kv_cache_bytes = tokens * self._per_token  # what the batch's sequences held at the end
        return rollouts

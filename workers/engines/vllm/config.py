"""The vLLM generator's configuration, decided from the job spec alone (pure; no vLLM import).

- **Layout** (:func:`generator_layout`, :func:`check_layout`): which decoder linears vLLM holds in
  block FP8, by the native generator's rule, and whether vLLM can cut them into 128x128 blocks.
- **Refusals** (:func:`check_vllm`): what vLLM 0.32 cannot run, said before anything starts.
  On CPU (``resources.gpus_per_generator: 0``) its block-FP8 linear kernels need Intel AMX, and
  its FP8 KV cache needs a head_dim divisible by 32 and AVX-512 or AMX
  (``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``).
- **Resources** (:func:`engine_kwargs`): ``max_model_len``, the KV-cache budget (CPU) or the
  GPU memory share, eager execution on CPU, threads (:func:`vllm_environment`).
- **Sampling** (:func:`sampling_kwargs`): the sampled token's log-prob, our EOS.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rljob.spec import JobSpec, PrecisionSpec, bf16_layer_reason
from workers.engines.batching import StopIds, stop_ids
from workers.fp8.convert import AuditRow, Fp8Audit, check_bf16_layers
from workers.fp8.hf_checkpoint import WEIGHT_BLOCK, check_tp_partitions, quantization_config

VLLM_VERSION = "0.32.0"
WORKER_EXTENSION = "workers.engines.vllm.worker.WeightChannelExtension"
TRANSFER_BACKEND = "fp8rl"  # workers.engines.vllm.transfer.BACKEND (that module imports vLLM)
KV_CACHE_FLOOR_BYTES = 64 * 2**20
GPU_MEMORY_UTILIZATION_MAX = 0.9  # vLLM's default
CPU_STEP_TOKENS = 4096  # vLLM's default token budget of one engine step
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def head_dim(hf_config: Any) -> int:
    heads = int(hf_config.num_attention_heads)
    return int(getattr(hf_config, "head_dim", None) or int(hf_config.hidden_size) // heads)


def decoder_linears(hf_config: Any) -> list[tuple[int, str, tuple[int, int]]]:
    """``(layer, HF module path, (out, in))`` of every decoder linear of a Llama/Qwen2 config."""
    hidden = int(hf_config.hidden_size)
    heads, kv_heads = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
    d = head_dim(hf_config)
    ffn = int(hf_config.intermediate_size)
    shapes = {
        "q_proj": (heads * d, hidden),
        "k_proj": (kv_heads * d, hidden),
        "v_proj": (kv_heads * d, hidden),
        "o_proj": (hidden, heads * d),
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

    The native generator's rule (:func:`rljob.spec.bf16_layer_reason`, which
    :func:`workers.engines.models.apply_recipe` follows too): every decoder linear in FP8 under
    ``fp8-gen`` and ``fp8-e2e``, except the first/last ``keep_bf16_layers`` and the ``bf16_layers``;
    lm_head always BF16.
    """
    layers = int(hf_config.num_hidden_layers)
    check_bf16_layers(precision.bf16_layers, layers)
    fp8: list[str] = []
    bf16: dict[str, str] = {"lm_head": "lm_head stays BF16"}
    for i, module, _ in decoder_linears(hf_config):
        if precision.recipe == "bf16":
            bf16[module] = "recipe bf16: the generator runs BF16"
        elif reason := bf16_layer_reason(i, layers, precision.keep_bf16_layers, precision.bf16_layers):
            bf16[module] = reason
        else:
            fp8.append(f"{module}.weight")
    return fp8, bf16


def check_layout(hf_config: Any, fp8_names: Sequence[str], tp: int) -> None:
    """Refuse a layout vLLM cannot hold in block FP8 (:func:`check_tp_partitions`): every FP8
    layer's per-GPU part must be whole 128x128 blocks."""
    shapes = {f"{m}.weight": s for _, m, s in decoder_linears(hf_config) if f"{m}.weight" in set(fp8_names)}
    check_tp_partitions(shapes, tp)


@dataclass(frozen=True)
class CpuFeatures:
    """The x86 matrix/vector extensions vLLM's CPU kernels dispatch on."""

    amx: bool
    avx512: bool

    @classmethod
    def detect(cls) -> CpuFeatures:
        """This machine's (the generator checks again on its own node: the driver's may differ)."""
        return cls(
            amx=bool(torch.cpu._is_amx_tile_supported()), avx512=bool(torch.cpu._is_avx512_supported())
        )


def check_vllm(hf_config: Any, spec: JobSpec, cpu: CpuFeatures | None = None) -> None:
    """Raise ValueError for a job vLLM 0.32 cannot run, naming the field and what to do
    (``cpu``: the CPU's features, detected when None; only read for a CPU generator)."""
    res, precision, rollout = spec.resources, spec.precision, spec.rollout
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if limit and rollout.max_new_tokens >= limit:
        raise ValueError(
            f"rollout.max_new_tokens ({rollout.max_new_tokens}) leaves no room for a prompt in the model's "
            f"{limit} positions (max_position_embeddings, vLLM's longest sequence): lower it"
        )
    fp8_names, _ = generator_layout(hf_config, precision)
    if res.gpus_per_generator == 0:
        cpu = cpu or CpuFeatures.detect()
        if fp8_names and not cpu.amx:
            raise ValueError(
                f"precision.recipe {precision.recipe}: vLLM's FP8 linear layers on CPU need Intel AMX, which "
                "this CPU lacks (resources.gpus_per_generator 0). Use precision.recipe bf16 (with "
                "precision.fp8_kv_cache true for an FP8 KV cache), resources.generator_engine native (FP8 "
                "linears on any CPU), or GPUs (resources.gpus_per_generator >= 1)"
            )
        d = head_dim(hf_config)
        if precision.fp8_kv_cache and d % 32:
            raise ValueError(
                f"precision.fp8_kv_cache: vLLM's CPU attention stores an FP8 KV cache only for a head_dim "
                f"divisible by 32; the model's is {d} (hidden_size / num_heads). Choose heads so that it is, "
                "set precision.fp8_kv_cache false, or use resources.generator_engine native"
            )
        if precision.fp8_kv_cache and not (cpu.avx512 or cpu.amx):
            raise ValueError(
                "precision.fp8_kv_cache: vLLM's CPU attention stores an FP8 KV cache only on x86 with "
                "AVX-512 or AMX, which this CPU lacks; set precision.fp8_kv_cache false or use "
                "resources.generator_engine native"
            )
    check_layout(hf_config, fp8_names, res.generator_tensor_parallel_size)


def kv_bytes_per_token(hf_config: Any, fp8_kv_cache: bool) -> int:
    """Bytes one token's K and V take over all layers (BF16, or FP8 with ``fp8_kv_cache``)."""
    per_layer = 2 * int(hf_config.num_key_value_heads) * head_dim(hf_config) * (1 if fp8_kv_cache else 2)
    return per_layer * int(hf_config.num_hidden_layers)


def max_model_len(hf_config: Any, spec: JobSpec, max_prompt_tokens: int | None = None) -> int:
    """vLLM's longest sequence: the longest prompt plus ``rollout.max_new_tokens``, within the
    model's positions (``max_prompt_tokens`` None: as long as the model allows)."""
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or 2**31 - 1
    if max_prompt_tokens is None:
        return limit
    return min(limit, max_prompt_tokens + spec.rollout.max_new_tokens)


def sequences_per_generate(spec: JobSpec) -> int:
    """The most sequences one generator gets in one call: its share of a step's prompts times the
    group size, or of the validation problems (one response each)."""
    r, gens = spec.rollout, spec.resources.generators
    most = math.ceil(r.prompts_per_step / gens) * r.group_size
    if spec.validation.interval > 0:
        most = max(most, math.ceil(spec.validation.size / gens))
    return most


def cpu_kv_cache_bytes(hf_config: Any, spec: JobSpec, model_len: int) -> int:
    """The KV cache a CPU generator reserves: every sequence of its largest call at full length,
    ``kv_bytes_per_token x max_model_len x sequences_per_generate``, and at least
    :data:`KV_CACHE_FLOOR_BYTES` (vLLM's CPU blocks hold 128 tokens each: a floor keeps a tiny job
    from running out of blocks to schedule with). vLLM needs at least one full-length sequence."""
    per_token = kv_bytes_per_token(hf_config, spec.precision.fp8_kv_cache)
    return max(KV_CACHE_FLOOR_BYTES, per_token * model_len * sequences_per_generate(spec))


def gpu_memory_utilization(weight_bytes: int, total_bytes: int) -> float:
    """The share of a GPU vLLM may take: all but room for one weight update (``2 x weight_bytes``:
    the received buckets, of which the unpacked payload is views since 2026-12-01, and as much
    again for what vLLM's loaders make of them; not lowered until a GPU run shows the peak), plus
    1 GiB for what vLLM does not count (the NCCL communicator, allocator slack); at most vLLM's
    default 0.9."""
    reserve = 2 * weight_bytes + 2**30
    share = min(GPU_MEMORY_UTILIZATION_MAX, 1.0 - reserve / total_bytes)
    if share < 0.2:
        raise ValueError(
            f"the generator's GPU ({total_bytes / 2**30:.1f} GiB) leaves vLLM {max(share, 0):.0%} of its "
            f"memory after room for a weight update ({reserve / 2**30:.1f} GiB); raise "
            "resources.generator_tensor_parallel_size or use larger GPUs"
        )
    return round(share, 3)


def vllm_environment(spec: JobSpec, device: str) -> dict[str, str]:
    """Environment of vLLM's processes (set while the engine starts, inherited by its processes).

    DeepGEMM must not re-round float scales to powers of two. On CPU, vLLM would pin its worker
    to cores of its choosing, the same ones for every engine on a node, and keep one core for its
    scheduler; instead its threads are left unpinned, as many as every actor gets
    (``ResourcesSpec.threads``; on 2 shared cores, pinned: 2.1k tokens/s, unpinned: 8.2k, the
    tests' tiny model).

    vLLM logs errors only (``VLLM_LOGGING_LEVEL``, unless the user set it): at its default it
    writes ~100 lines at start-up and warnings at every weight update that are expected here (no
    tokenizer to warm up with, RoPE buffers that an update does not carry), which would bury the
    job's own log.
    """
    env = {
        "VLLM_USE_DEEP_GEMM_E8M0": "1" if spec.precision.power_of_two_scales else "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
    }
    if device == "cpu":
        threads = spec.resources.threads(os.cpu_count() or 1)
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
    return env


def engine_kwargs(
    spec: JobSpec,
    model: str,
    ignored_layers: Sequence[str],
    *,
    device: str = "cuda",
    model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    gpu_memory: float | None = None,
    generation_config: str | None = None,
) -> dict[str, Any]:
    """The ``vllm.LLM(**kwargs)`` of a job: ``model`` is a Hugging Face id or a config directory.

    CPU: eager execution (measured with the tests' tiny model on 2 shared cores: the engine starts
    in 15-20 s against 35-41 s compiled, and generates 64 x 48 tokens at 8.2k tokens/s against
    4.1k) and an explicit KV cache (``kv_cache_bytes``, :func:`cpu_kv_cache_bytes`: vLLM otherwise
    reserves 90% of the node's memory for it, and an explicit size also skips its warm-up). This is
    the setting ``VLLM_CPU_KVCACHE_SPACE`` makes in whole GiB; exported by the user, that variable
    still wins (vLLM applies it after). CUDA: CUDA graphs, and ``gpu_memory`` of the GPU.
    ``generation_config``: a directory whose ``generation_config.json`` names the job's EOS as the
    only stop token (:func:`workers.engines.vllm.generator.write_generation_config`).
    """
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
        "weight_transfer_config": {"backend": TRANSFER_BACKEND},
        "enable_prefix_caching": True,  # a GRPO group shares its prompt; reset after each update
        "enforce_eager": device == "cpu",
    }
    if model_len is not None:
        kwargs["max_model_len"] = model_len
        if device == "cpu":
            # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when it discards
            # the sample of a seeded request whose prompt was only partly prefilled: no chunking,
            # and a step budget that takes any one sequence whole
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(CPU_STEP_TOKENS, model_len)
    if generation_config is not None:
        kwargs["generation_config"] = generation_config
    if device == "cpu" and kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if device != "cpu" and gpu_memory is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory
    if precision.recipe != "bf16":
        kwargs["quantization"] = "fp8"
        kwargs["hf_overrides"] = {"quantization_config": quantization_config(list(ignored_layers))}
    if precision.fp8_kv_cache:
        kwargs["kv_cache_dtype"] = "fp8"
    return kwargs


def sampling_kwargs(
    max_new_tokens: int, temperature: float, top_p: float, seed: int, eos: StopIds
) -> dict[str, Any]:
    """``vllm.SamplingParams(**kwargs)`` of one request: the sampled token's log-prob, our stop
    ids (``eos``: one id or every id that ends a response)."""
    return {
        "n": 1,
        "temperature": temperature,  # 0: greedy (vLLM then forces top_p 1)
        "top_p": top_p if temperature > 0 else 1.0,
        "top_k": 0,  # disabled
        "max_tokens": max_new_tokens,
        "seed": seed,
        "logprobs": 0,  # the sampled token only
        "stop_token_ids": list(stop_ids(eos)),
        "ignore_eos": False,
        "detokenize": False,
    }


def generator_audit(hf_config: Any, precision: PrecisionSpec, device: str = "cuda") -> Fp8Audit:
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
    audit = Fp8Audit(precision.recipe, rows, device="CPU (vLLM)" if device == "cpu" else "CUDA (vLLM)")
    if fp8:
        audit.formats = "E4M3 weights (128x128 blocks) and activations (1x128, dynamic)"
    return audit

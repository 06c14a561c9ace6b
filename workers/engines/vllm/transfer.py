"""fp8rl's backend of vLLM's weight-transfer API: the trainer's payload over the weight channel.

vLLM 0.32 updates weights in four calls on ``vllm.LLM``, each run by every worker
(``vllm/entrypoints/rl/offline.py``): ``init_weight_transfer_engine`` once, then per update
``start_weight_update``, ``update_weights``, ``finish_weight_update``. The worker hands each to the
``WeightTransferEngine`` its ``weight_transfer_config`` names, which it builds from a registry in
its own process (``vllm/v1/worker/gpu_worker.py``, ``load_model``). :func:`register` puts
:class:`ChannelTransferEngine` there under :data:`BACKEND`; the worker extension module
(:mod:`workers.engines.vllm.worker`), which vLLM imports in each worker before loading the model,
calls it. The calls carry plain data only (vLLM serialises their arguments with msgspec: a tensor
would arrive as a list); the weights themselves come over the weight channel.

One update, in each worker:
- ``start``: vLLM's layerwise reload (``initialize_layerwise_reload``): parameters go back to
  their checkpoint-format shapes, loaders are wrapped so each layer is processed once whole;
- ``update``: receive one version over :class:`~workers.weight_sync.channel.WeightChannel` (as
  rank ``first_rank`` + the worker's rank; gloo on CPU, NCCL on GPU), checksum what arrived
  (:func:`~workers.weight_sync.contract.received_weights`), turn it into checkpoint tensors
  (:func:`~workers.fp8.hf_checkpoint.checkpoint_tensors`: FP8 weights stay the trainer's bytes
  plus ``weight_scale_inv``) and load them with the model's ``load_weights``;
- ``finish``: ``finalize_layerwise_reload`` re-runs vLLM's post-load processing and copies into
  the tensors the kernels (and CUDA graphs) hold; then the post-load processing of tied layers
  again (below), and the K/V-cache scales (:mod:`.kv_scales`).

A tied output layer (``tie_word_embeddings``: SmolLM2, Qwen2-0.5B) shares its weight with the
embedding, so the checkpoint has no ``lm_head.weight`` and vLLM's reload loads nothing into it: it
puts the layer's old tensors back and skips its post-load processing. The shared weight does hold
the new values (the embedding's reload copies into it), but on a CPU that processing is where
vLLM packs the weight for its GEMM (``dispatch_cpu_unquantized_gemm``: oneDNN or sgl-kernel keep
their own copy), so the output layer kept computing with the weights of the engine's start (the
dummy ones): measured on SmolLM2-135M, token_mult_prob_error 2.4e4 against the trainer instead of
1.0x. :func:`tied_layers` finds such layers once, and each update processes them again.

The K/V scales the trainer calibrates (``model.layers.{i}.self_attn.k_scale``) have a parameter
to load into only when the attention layers carry a KV-cache quantization method, i.e. with a
quantization config (FP8 weights): then vLLM loads them itself. With BF16 weights there is none
(``load_weights`` refuses the name and the engine dies), so this backend writes them into the
attention layers after the reload, where the kernels read them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from workers.engines.vllm.kv_scales import AttentionLayers
from workers.fp8.hf_checkpoint import checkpoint_tensors
from workers.weight_sync.broadcast import DEFAULT_BUCKET_BYTES
from workers.weight_sync.channel import WeightChannel
from workers.weight_sync.contract import dtype_name, is_kv_scale, received_weights
from workers.weight_sync.data import HeldWeight, WeightReport

BACKEND = "fp8rl"  # the name in LLM(weight_transfer_config={"backend": BACKEND})


def register() -> None:
    """Make :data:`BACKEND` known to vLLM's engine registry in this process (idempotent)."""
    with contextlib.suppress(ValueError):  # registered already: imported before (the name is ours)
        WeightTransferEngineFactory.register_engine(BACKEND, ChannelTransferEngine)


@dataclass
class ChannelInitInfo(WeightTransferInitInfo):
    """``init_info`` of :meth:`vllm.LLM.init_weight_transfer_engine` (plain data).

    address:      the channel's ``tcp://host:port`` (trainer 0 hosts it)
    first_rank:   this generator's first rank in the channel; its worker ``r`` joins as
                  ``first_rank + r``
    world_size:   ranks in the channel (trainer 0 and every receiving worker)
    device:       where the buckets land, which picks the transport; None: the worker's device
                  (NCCL on a GPU). ``"cpu"`` sends a GPU worker's weights over gloo (a test that
                  puts the trainer on vLLM's GPU: NCCL cannot put two ranks on one GPU)
    """

    address: str
    first_rank: int
    world_size: int
    device: str | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 600.0


@dataclass
class ChannelUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of :meth:`vllm.LLM.update_weights`: the version the generator expects (the
    channel numbers versions 1, 2, ...; a generator that missed one refuses the next)."""

    version: int


def vllm_param_name(hf_name: str, packed_modules: dict[str, list[str]]) -> str:
    """The vLLM parameter a Hugging Face weight loads into, through the model's
    ``packed_modules_mapping`` (``q_proj`` -> ``qkv_proj``, ``up_proj`` -> ``gate_up_proj``)."""
    for packed, parts in packed_modules.items():
        for part in parts:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{packed}.", 1)
    return hf_name


def tied_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers holding a parameter that an earlier layer (in ``model.modules()`` order) holds
    too: a tied ``lm_head`` after ``embed_tokens``. Only those with a post-load processing step."""
    seen: set[int] = set()
    tied: list[torch.nn.Module] = []
    for layer in model.modules():
        params = [id(p) for p in layer.parameters(recurse=False)]
        if seen.intersection(params) and hasattr(
            getattr(layer, "quant_method", None), "process_weights_after_loading"
        ):
            tied.append(layer)
        seen.update(params)
    return tied


def precision_of(param: torch.Tensor) -> str:
    """``fp8`` for a float8 parameter, else its dtype's name (what :class:`HeldWeight` holds)."""
    return "fp8" if param.dtype.is_floating_point and param.dtype.itemsize == 1 else dtype_name(param.dtype)


class ChannelTransferEngine(WeightTransferEngine[ChannelInitInfo, ChannelUpdateInfo]):
    """The worker side of one generator's weight updates (see the module docstring)."""

    init_info_cls = ChannelInitInfo
    update_info_cls = ChannelUpdateInfo
    supports_draft_weight_update = False  # one model per generator

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: WeightChannel | None = None
        self.attention = AttentionLayers(model)
        self.tied = tied_layers(model)  # before any reload: it re-registers the shared tensors
        self.last_sync: dict[str, float] = {}
        self._received: dict[str, HeldWeight] = {}
        self._loaded: set[str] = set()
        self._kv: dict[str, torch.Tensor] = {}  # the last K/V scales received, which the backend applies
        self._report: WeightReport | None = None

    def init_transfer_engine(self, init_info: ChannelInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.first_rank + pc.data_parallel_index * pc.world_size + pc.rank
        channel = WeightChannel(
            init_info.address,
            rank,
            init_info.world_size,
            init_info.device or self.device,
            init_info.bucket_bytes,
            init_info.timeout_s,
        )
        channel.init_communicator()
        self.channel = channel

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._received, self._loaded = {}, set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ChannelUpdateInfo) -> None:
        if self.channel is None:
            raise RuntimeError(
                "update_weights before init_weight_transfer_engine: join the weight channel first "
                "(VllmGenerator.join_weight_channel)"
            )
        start = time.perf_counter()
        result = self.channel.sync_weights(None)
        payload, result.payload = result.payload, None
        assert payload is not None
        if result.version != update_info.version:
            raise RuntimeError(
                f"weight update: the trainer sent version {result.version}, this generator expected "
                f"{update_info.version}; it missed or repeated an update (each receive_weights() must pair "
                "with one send by trainer 0)"
            )
        self._received = received_weights(payload, {})  # checksums of the bytes as they arrived
        kv = {n: v for n, v in payload.items() if is_kv_scale(n)}
        self.attention.scales_sent |= bool(kv)
        if kv and not self.attention.loads_scales:
            self._kv = kv  # no parameter to load them into: applied after the reload (finish)
            payload = {n: v for n, v in payload.items() if n not in kv}
        tensors = checkpoint_tensors(payload)
        del payload
        model: Any = self.model  # a vLLM model: load_weights returns the parameters it loaded
        self._loaded = set(model.load_weights(list(tensors.items())))
        self.last_sync = {
            "version": result.version,
            "bytes": result.bytes,
            "seconds": time.perf_counter() - start,
            "buckets": result.buckets,
        }

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # the attention layers' post-load processing runs here and resets scales it has no
        # parameter for to 1.0: the trainer's K/V scales go in after it, the last ones received
        # when this update carried none (as vLLM keeps loaded scales when it owns them)
        finalize_layerwise_reload(self.model, self.model_config)
        for layer in self.tied:  # nothing was loaded into them, so vLLM did not process them again
            method: Any = layer.quant_method
            method.process_weights_after_loading(layer)
        if self._kv:
            self.attention.apply_scales(self._kv)
        self._report = WeightReport(weights=self._held(), kv=self.attention.held())

    def _held(self) -> dict[str, HeldWeight]:
        """The received weights with the precision of the parameter each one loaded into."""
        params = dict(self.model.named_parameters())
        packed = dict(getattr(self.model, "packed_modules_mapping", {}) or {})
        out: dict[str, HeldWeight] = {}
        for name, held in self._received.items():
            target = vllm_param_name(name, packed)
            loaded = target in self._loaded and target in params
            out[name] = HeldWeight(
                dtype=held["dtype"],
                holds=precision_of(params[target]) if loaded else "missing",
                data=held["data"],
                scale=held["scale"],
            )
        return out

    def weight_report(self) -> WeightReport:
        if self._report is None:
            raise RuntimeError("weight_report: no weight update has finished in this worker yet")
        return self._report

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.shutdown()
            self.channel = None


def worker_report(engine: Any) -> WeightReport:
    """The report of a worker's engine (``Worker.weight_transfer_engine``), or a clear error."""
    if not isinstance(engine, ChannelTransferEngine):
        raise RuntimeError(
            f"weight_report: the worker's weight-transfer engine is {type(engine).__name__}, not fp8rl's; "
            f'start vLLM with weight_transfer_config={{"backend": "{BACKEND}"}}'
        )
    return engine.weight_report()


def worker_last_sync(engine: Any) -> dict[str, float]:
    if not isinstance(engine, ChannelTransferEngine) or not engine.last_sync:
        raise RuntimeError("last_sync: no weight update has been received by fp8rl's backend in this worker")
    return dict(engine.last_sync)

"""The Megatron-Core model of one trainer rank: process groups, model, optimizer and its full state.

Megatron-Core and Transformer Engine need CUDA; they are imported inside the methods, so this
module imports anywhere (the pure parts live in :mod:`workers.engines.megatron.convert` and
:mod:`workers.engines.megatron.config`).

The model is Megatron's ``GPTModel`` with the Transformer Engine layer spec, wrapped in
``Float16Module`` (BF16 compute copies of the parameters) and Megatron's DDP; the optimizer is
Megatron's Adam with float32 main weights. Under ``fp8-e2e`` Transformer Engine runs every
decoder linear's three GEMMs in FP8 with Float8BlockScaling (E4M3, 128x128 weight blocks, 1x128
activation and gradient tiles), layer by layer as Megatron turns it on; the first/last
``keep_bf16_layers`` stay BF16. Embeddings, output layer and norms are BF16.

The full state (global Megatron names, whole tensors) goes into the sharded model with
:meth:`MegatronModel._load_megatron` (this rank's stage and tensor-parallel shard) and comes back
on trainer 0 with :meth:`MegatronModel._gather`.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.engines.megatron.config import (
    MegatronShapes,
    fp8_environment,
    gpt_model_kwargs,
    megatron_audit,
    megatron_state_shapes,
    transformer_config_kwargs,
)
from workers.engines.megatron.convert import (
    global_name,
    hf_to_megatron,
    merge_tp_shards,
    parallel_kind,
    shard_for_rank,
    stage_owned,
    stage_state,
)
from workers.engines.models import build_policy
from workers.fp8.convert import Fp8Audit
from workers.fp8.kv_cache import KvScaleCalibrator


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class MegatronModel:
    """Megatron's model and optimizer on one trainer rank (one rank per GPU; ``rank`` among the
    trainers), loaded with the native builder's weights."""

    def __init__(self, spec: JobSpec, vocab_size: int, device: str = "cuda", rank: int = 0) -> None:
        self.spec, self.rank = spec, rank
        os.environ.update(fp8_environment(spec))  # before Transformer Engine is first imported
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        self.device = self._cuda(device)
        self._init_groups(ps)
        self._check_te_scales()
        tensor_parallel.model_parallel_cuda_manual_seed(spec.model.init_seed)
        self._ce = tensor_parallel.vocab_parallel_cross_entropy
        # both engines start from the same weights: the native builder's (pretrained or seeded)
        hf_model = build_policy(spec, vocab_size, torch.float32, "cpu")
        hf_config = hf_model.config
        self.shapes = MegatronShapes.from_hf(hf_config, self.tp)
        # every parameter is loaded below: skip Megatron's own initialisation
        self.config = TransformerConfig(
            **transformer_config_kwargs(hf_config, spec), perform_initialization=False
        )
        self.gpt = GPTModel(
            self.config,
            get_gpt_layer_with_transformer_engine_spec(),
            **gpt_model_kwargs(hf_config, self.tp),
            pre_process=self.pp_rank == 0,
            post_process=self.pp_rank == self.pp - 1,
        ).to(self.device)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        self.model = DistributedDataParallel(self.config, ddp, module=Float16Module(self.config, self.gpt))
        self.config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce happens there
        opt = spec.optimizer
        # not distributed: every model parameter keeps its whole float32 copy as ``main_param``,
        # which checkpoints and exact weight loads read and write
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                clip_grad=opt.grad_clip,
                bf16=True,
                params_dtype=torch.float32,
                use_distributed_optimizer=False,
            ),
            [self.model],
        )
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.model.train()  # no dropout; one mode for log-prob and training passes
        self._load_megatron(hf_to_megatron(dict(hf_model.named_parameters()), self.shapes))
        del hf_model
        self.audit: Fp8Audit = megatron_audit(self.shapes, spec.precision, _device_name(self.device))
        self._one = torch.ones((), dtype=torch.int, device=self.device)
        # the KV-cache calibration's state (workers.engines.megatron.kv); the schedule sets the rows
        self._kv: KvScaleCalibrator | None = None
        self._kv_seen: set[int] = set()
        self._kv_rows: torch.Tensor | None = None  # the real tokens of the micro-batch being calibrated on

    # -- setup -------------------------------------------------------------------------------------

    def _cuda(self, device: str) -> torch.device:
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"the megatron trainer runs on CUDA GPUs, got device {device!r}; set "
                "resources.gpus_per_trainer: 1, or resources.trainer_engine: native"
            )
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
        return dev

    def _init_groups(self, ps: Any) -> None:
        """The trainers' process group (a 1-rank NCCL one for a lone trainer) and Megatron's groups."""
        res = self.spec.resources
        tp, pp = res.trainer_tensor_parallel_size, res.trainer_pipeline_parallel_size
        if not dist.is_initialized():
            if self.rank != 0:
                raise RuntimeError(
                    f"MegatronTrainer rank {self.rank}: torch.distributed is not initialized; the trainer "
                    "actor must join the trainers' process group first (workers.actors)"
                )
            dist.init_process_group(
                "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
        if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size() != tp
            or ps.get_pipeline_model_parallel_world_size() != pp
        ):
            ps.destroy_model_parallel()
        if not ps.model_parallel_is_initialized():
            world = dist.get_world_size()
            if world % (tp * pp):
                raise ValueError(
                    f"{world} trainers do not split into tensor x pipeline parallel groups of {tp} x {pp}; "
                    "set resources.trainers to a multiple of their product"
                )
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.tp, self.pp = tp, pp
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = ps.get_data_parallel_world_size()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        self._mp_group = ps.get_model_parallel_group()
        self._pp_ranks = dist.get_process_group_ranks(self._pp_group)
        self._mp_size = tp * pp

    def _check_te_scales(self) -> None:
        """Fail if Transformer Engine was imported before its scale setting could be chosen."""
        if self.spec.precision.recipe != "fp8-e2e":
            return
        from transformer_engine.common.recipe import Float8BlockScaling

        want = self.spec.precision.power_of_two_scales
        env = fp8_environment(self.spec)["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"]
        got = getattr(getattr(Float8BlockScaling, "fp8_quant_fwd_weight", None), "power_2_scale", want)
        if got != want:
            raise RuntimeError(
                f"Transformer Engine was imported with {'power-of-two' if got else 'float32'} block scales, "
                f"but precision.power_of_two_scales is {want}: it reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES "
                f"once, at import. Set it to {env} "
                "in the worker's environment, or build the trainer before anything imports TE"
            )

    # -- the full state ----------------------------------------------------------------------------

    @torch.no_grad()
    def _load_megatron(self, full: dict[str, torch.Tensor]) -> None:
        """Load a full Megatron state (global names): this rank's stage and shard into the BF16
        parameters and, exactly, into the float32 main weights."""
        local = stage_state(full, self.shapes, self.pp, self.pp_rank)
        params = dict(self.gpt.named_parameters())
        if set(local) != set(params):
            raise ValueError(
                f"the Megatron model's parameters differ from the mapped state: missing "
                f"{sorted(set(params) - set(local))[:5]}, unexpected {sorted(set(local) - set(params))[:5]}"
            )
        for name, p in params.items():
            value = shard_for_rank(name, local[name], self.tp_rank, self.tp, self.shapes)
            value = value.to(device=self.device, dtype=torch.float32)
            if value.shape != p.shape:
                raise ValueError(f"{name}: mapped shape {tuple(value.shape)}, model expects {tuple(p.shape)}")
            p.copy_(value)
            main = getattr(p, "main_param", None)
            if main is not None:
                main.copy_(value)

    @torch.no_grad()
    def _gather(self, master: bool) -> dict[str, torch.Tensor]:
        """The full Megatron state (global names, whole tensors) on trainer 0, ``{}`` elsewhere:
        float32 main weights (``master``) or the BF16 compute copies. Tensor-parallel shards are
        all-gathered in their group, stages send theirs to trainer 0 in :func:`stage_owned` order."""
        if self.dp_rank != 0:
            return {}
        dtype = torch.float32 if master else torch.bfloat16
        tied_copy = self.shapes.tied and self.pp > 1 and self.pp_rank == self.pp - 1
        local: dict[str, torch.Tensor] = {}
        for name, p in self.gpt.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the last stage's copy of the word embeddings
            t = (getattr(p, "main_param", p) if master else p).detach().to(dtype).contiguous()
            if self.tp > 1 and parallel_kind(name) != "replicated":
                shards = [torch.empty_like(t) for _ in range(self.tp)]
                dist.all_gather(shards, t, group=self._tp_group)
                t = merge_tp_shards(name, shards, self.shapes)
            local[global_name(name, self.shapes.layers, self.pp, self.pp_rank)] = t
        if self.tp_rank != 0:
            return {}
        if self.pp_rank != 0:
            for name in stage_owned(self.shapes, self.pp, self.pp_rank):
                dist.send(local[name], dst=self._pp_ranks[0])
            return {}
        shapes = megatron_state_shapes(self.shapes)
        for stage in range(1, self.pp):
            for name in stage_owned(self.shapes, self.pp, stage):
                local[name] = torch.empty(shapes[name], dtype=dtype, device=self.device)
                dist.recv(local[name], src=self._pp_ranks[stage])
        return local

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's BF16 parameters and their float32 main weights."""
        total = 0
        for p in self.gpt.parameters():
            main = getattr(p, "main_param", None)
            total += p.numel() * p.element_size() + (
                0 if main is None else main.numel() * main.element_size()
            )
        return total

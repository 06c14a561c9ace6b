"""The Megatron-Core model of one trainer rank: GPTModel, DDP, optimizer and the full state.

Megatron-Core (and Transformer Engine) are imported inside the methods, so this module imports
anywhere (the pure parts live in :mod:`workers.engines.megatron.convert` and
:mod:`workers.engines.megatron.config`).

The model is Megatron's ``GPTModel``, wrapped in ``Float16Module`` (BF16 compute copies of the
parameters) and Megatron's DDP; the optimizer is Megatron's Adam with float32 main weights.

- On a GPU: Transformer Engine's layer spec. Under ``fp8-e2e`` Transformer Engine runs every
  decoder linear's three GEMMs in FP8 with Float8BlockScaling (E4M3, 128x128 weight blocks, 1x128
  activation and gradient tiles), layer by layer as Megatron turns it on; the first/last
  ``keep_bf16_layers`` stay BF16. Embeddings, output layer and norms are BF16. NCCL groups.
- On a CPU (a process without CUDA): Megatron-Core's local layer spec and gloo groups, with what
  Megatron needs without CUDA from :mod:`workers.engines.megatron.without_cuda`. BF16 compute
  (Megatron's ``Float16Module`` and mixed-precision optimizer run on the CPU as they do on a GPU;
  torch's BF16 GEMMs use the CPU's BF16 instructions where it has them), or float32 when asked
  (``compute_dtype``: no ``Float16Module``, the parameters are the float32 main weights).

The full state (global Megatron names, whole tensors) goes into the sharded model with
:meth:`MegatronModel.load` (this rank's stage and tensor-parallel shard) and comes back on
trainer 0 with :meth:`MegatronModel.gather`; Adam's moments, sharded like the weights, likewise
(:meth:`MegatronModel.load_adam`, :meth:`MegatronModel.gather_adam`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.engines.megatron import without_cuda
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
from workers.engines.megatron.groups import init_groups, trainer_device
from workers.engines.models import build_policy
from workers.fp8.convert import Fp8Audit


class MegatronModel:
    """Megatron's model and optimizer on one trainer rank (``rank`` among the trainers; one per
    GPU, or one per process on the CPU), loaded with the native builder's weights."""

    def __init__(
        self,
        spec: JobSpec,
        vocab_size: int,
        device: str = "cuda",
        rank: int = 0,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.spec, self.rank, self.compute_dtype = spec, rank, compute_dtype
        self.device = trainer_device(device)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            os.environ.update(fp8_environment(spec))  # before Transformer Engine is first imported
        elif spec.precision.recipe == "fp8-e2e":  # never a silent BF16 fallback
            raise ValueError(
                "precision.recipe fp8-e2e trains with Transformer Engine's FP8 GEMMs, which need a CUDA "
                "GPU, but this trainer runs on the CPU: set precision.recipe bf16 or fp8-gen, or give the "
                "trainer a GPU (resources.gpus_per_trainer: 1)"
            )
        elif compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype {compute_dtype}: the CPU trainer computes in BF16 or float32")
        self.groups = init_groups(spec, rank, self.device)
        with self.calls():
            self._build(spec, vocab_size, on_gpu)

    def calls(self) -> contextlib.AbstractContextManager[None]:
        """The context every call into Megatron-Core runs in (:mod:`without_cuda` on the CPU)."""
        return without_cuda.megatron_calls(self.device)

    def _build(self, spec: JobSpec, vocab_size: int, on_gpu: bool) -> None:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        g, bf16 = self.groups, self.compute_dtype == torch.bfloat16
        if on_gpu:
            self._check_te_scales()
            tensor_parallel.model_parallel_cuda_manual_seed(spec.model.init_seed)
        else:
            without_cuda.rng_tracker_without_cuda()
        self.cross_entropy = tensor_parallel.vocab_parallel_cross_entropy
        # both engines start from the same weights: the native builder's (pretrained or seeded)
        hf_model = build_policy(spec, vocab_size, torch.float32, "cpu")
        hf_config = hf_model.config
        self.shapes = MegatronShapes.from_hf(hf_config, g.tp, layout="te" if on_gpu else "local")
        # every parameter is loaded below: skip Megatron's own initialisation
        self.config = TransformerConfig(
            **transformer_config_kwargs(hf_config, spec, self.compute_dtype),
            perform_initialization=False,
            **({} if on_gpu else without_cuda.CONFIG_FLAGS),
        )
        self.gpt = GPTModel(
            self.config,
            _layer_spec(on_gpu),
            **gpt_model_kwargs(hf_config, g.tp),
            pre_process=g.pp_rank == 0,
            post_process=g.pp_rank == g.pp - 1,
        ).to(self.device)
        _mark_tensor_parallel(self.gpt)  # before the optimizer copies the marks to the main weights
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=False,
            **({} if on_gpu else without_cuda.DDP_FLAGS),
        )
        module = Float16Module(self.config, self.gpt) if bf16 else self.gpt
        self.model = DistributedDataParallel(self.config, ddp, module=module)
        self.config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce happens there
        opt = spec.optimizer
        # not distributed: every model parameter keeps its whole float32 copy (``main_param``
        # with BF16; the parameter itself in float32), which checkpoints and exact loads use
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                clip_grad=opt.grad_clip,
                bf16=bf16,
                params_dtype=torch.float32,
                use_distributed_optimizer=False,
            ),
            [self.model],
        )
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.model.train()  # no dropout; one mode for log-prob and training passes
        self.load(hf_to_megatron(dict(hf_model.named_parameters()), self.shapes))
        del hf_model
        name = torch.cuda.get_device_name(self.device) if on_gpu else "CPU"
        self.audit: Fp8Audit = megatron_audit(self.shapes, spec.precision, name, self.compute_dtype)

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

    # -- training ----------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> torch.Tensor:
        """Clip and step (gradients are already reduced); the norm before clipping, 0-d float32."""
        with self.calls():
            _, norm, _ = self.optimizer.step()  # Megatron reads the norm back: once per optimizer step
        return torch.full((), float(norm or 0.0), dtype=torch.float32, device=self.device)

    # -- the full state ----------------------------------------------------------------------------

    def _shards(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's stage and tensor-parallel shard of a full Megatron state (global names), by
        local parameter name, float32 on the device."""
        g = self.groups
        local = stage_state(full, self.shapes, g.pp, g.pp_rank)
        params = dict(self.gpt.named_parameters())
        if set(local) != set(params):
            raise ValueError(
                f"the Megatron model's parameters differ from the mapped state: missing "
                f"{sorted(set(params) - set(local))[:5]}, unexpected {sorted(set(local) - set(params))[:5]}"
            )
        out = {}
        for name, p in params.items():
            value = shard_for_rank(name, local[name], g.tp_rank, g.tp, self.shapes)
            if value.shape != p.shape:
                raise ValueError(f"{name}: mapped shape {tuple(value.shape)}, model expects {tuple(p.shape)}")
            out[name] = value.to(device=self.device, dtype=torch.float32)
        return out

    @torch.no_grad()
    def load(self, full: dict[str, torch.Tensor]) -> None:
        """Load a full Megatron state (global names): this rank's stage and shard into the
        parameters and, exactly, into the float32 main weights."""
        shards = self._shards(full)
        for name, p in self.gpt.named_parameters():
            p.copy_(shards[name])
            main = getattr(p, "main_param", None)
            if main is not None:
                main.copy_(shards[name])

    @torch.no_grad()
    def gather(self, master: bool) -> dict[str, torch.Tensor]:
        """The full Megatron state (global names, whole tensors) on trainer 0, ``{}`` elsewhere:
        float32 main weights (``master``) or the compute copies (BF16, or float32 when the model
        computes in float32)."""
        if master:
            return self._gather(lambda p: getattr(p, "main_param", p), torch.float32)
        return self._gather(lambda p: p, self.compute_dtype)

    def _adam(self) -> Any:
        """The torch Adam inside Megatron's optimizer: its state is keyed by the main weights."""
        return self.optimizer.optimizer

    @torch.no_grad()
    def gather_adam(self) -> tuple[int, dict[str, dict[str, torch.Tensor]]] | None:
        """``(steps taken, {"exp_avg": full state, "exp_avg_sq": full state})`` of Adam on
        trainer 0 (``(steps, {})`` elsewhere), or ``None`` before the first step. Every trainer
        must call it (the moments are sharded like the weights)."""
        state = self._adam().state
        if not state:
            return None
        steps = int(next(iter(state.values()))["step"])

        def moment(key: str) -> Callable[[Any], torch.Tensor]:
            return lambda p: state[getattr(p, "main_param", p)][key]

        moments = {key: self._gather(moment(key), torch.float32) for key in ("exp_avg", "exp_avg_sq")}
        return steps, (moments if moments["exp_avg"] else {})

    @torch.no_grad()
    def load_adam(self, steps: int, moments: dict[str, dict[str, torch.Tensor]] | None) -> None:
        """Set Adam's state: ``moments`` (full, global names) after ``steps`` updates, or none (the
        next step starts Adam afresh)."""
        adam = self._adam()
        adam.state.clear()
        if moments is None:
            return
        shards = {key: self._shards(full) for key, full in moments.items()}
        for name, p in self.gpt.named_parameters():
            adam.state[getattr(p, "main_param", p)] = {
                "step": torch.tensor(float(steps)),  # torch's Adam keeps it as a float32 host tensor
                # copies: Adam updates them in place, and the shards may be the caller's tensors
                "exp_avg": shards["exp_avg"][name].clone(),
                "exp_avg_sq": shards["exp_avg_sq"][name].clone(),
            }

    def _gather(self, value: Callable[[Any], torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """``value(parameter)`` of every parameter as a full state (global names, whole tensors)
        on trainer 0, ``{}`` elsewhere. Tensor-parallel shards are all-gathered in their group,
        stages send theirs to trainer 0 in :func:`stage_owned` order."""
        g = self.groups
        if g.dp_rank != 0:
            return {}
        tied_copy = self.shapes.tied and g.pp > 1 and g.pp_rank == g.pp - 1
        local: dict[str, torch.Tensor] = {}
        for name, p in self.gpt.named_parameters():
            if tied_copy and name == "output_layer.weight":
                continue  # the last stage's copy of the word embeddings
            t = value(p).detach().to(dtype).contiguous()
            if g.tp > 1 and parallel_kind(name) != "replicated":
                shards = [torch.empty_like(t) for _ in range(g.tp)]
                dist.all_gather(shards, t, group=g.tp_group)
                t = merge_tp_shards(name, shards, self.shapes)
            local[global_name(name, self.shapes.layers, g.pp, g.pp_rank)] = t
        if g.tp_rank != 0:
            return {}
        if g.pp_rank != 0:
            for name in stage_owned(self.shapes, g.pp, g.pp_rank):
                dist.send(local[name], dst=g.pp_ranks[0])
            return {}
        shapes = megatron_state_shapes(self.shapes)
        for stage in range(1, g.pp):
            for name in stage_owned(self.shapes, g.pp, stage):
                local[name] = torch.empty(shapes[name], dtype=dtype, device=self.device)
                dist.recv(local[name], src=g.pp_ranks[stage])
        return local

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters and their float32 main weights (when separate)."""
        total = 0
        for p in self.gpt.parameters():
            main = getattr(p, "main_param", None)
            total += p.numel() * p.element_size() + (
                0 if main is None else main.numel() * main.element_size()
            )
        return total


def _mark_tensor_parallel(gpt: Any) -> None:
    """Mark every split parameter tensor-parallel, as Megatron's parallel layers do only while
    initialising their weights (``tensor_parallel/layers.py:_initialize_affine_weight_cpu``/
    ``_gpu``), which ``perform_initialization=False`` skips: the vocabulary-parallel embedding and
    output layer, and the local spec's linear weights, stay unmarked. Unmarked, the optimizer
    counts their gradients on tensor-parallel rank 0 only
    (``tensor_parallel.param_is_not_tensor_parallel_duplicate``), so the gradient norm, and the
    clipping that uses it, is wrong under tensor parallelism. The marks follow
    :func:`~workers.engines.megatron.convert.parallel_kind` (Megatron's GLU ``linear_fc1`` has
    stride 2: ``transformer/mlp.py:109``)."""
    for name, p in gpt.named_parameters():
        kind = parallel_kind(name)
        if kind == "replicated" or getattr(p, "tensor_model_parallel", False):
            continue
        p.tensor_model_parallel = True
        p.partition_dim = 1 if kind == "row" else 0
        p.partition_stride = 2 if kind == "fc1" else 1


def _layer_spec(on_gpu: bool) -> Any:
    """Transformer Engine's layer spec on a GPU; Megatron-Core's local one (torch modules, RMSNorm
    as ``torch.nn.RMSNorm``, separate norm modules) on the CPU, where TE cannot run."""
    from megatron.core.models.gpt import gpt_layer_specs

    if on_gpu:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")

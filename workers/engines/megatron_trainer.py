"""The Trainer protocol on Megatron-Core + Transformer Engine (tensor, pipeline and data parallel).

Megatron-Core and Transformer Engine need CUDA; they are imported inside the methods, so this
module imports anywhere (the pure parts live in :mod:`workers.engines.megatron_convert`).

The model is Megatron's ``GPTModel`` with the Transformer Engine layer spec, wrapped in
``Float16Module`` (BF16 compute copies of the parameters) and Megatron's DDP; the optimizer is
Megatron's Adam with float32 main weights. Under ``fp8-e2e`` Transformer Engine runs every
decoder linear's three GEMMs in FP8 with Float8BlockScaling (E4M3, 128x128 weight blocks, 1x128
activation and gradient tiles), layer by layer as Megatron turns it on; the first/last
``keep_bf16_layers`` stay BF16. Embeddings, output layer and norms are BF16.

The RL update is the native trainer's (:mod:`workers.engines.native_trainer`): the same
``grpo_advantages``, ``grpo_loss`` (with its importance-sampling correction) and ``loss_units``,
minibatches and micro-batches. Each micro-batch's loss is ``grpo_loss`` with the minibatch's units
summed over the data-parallel replicas; the loss function hands Megatron's schedule that loss
times (micro-batches x DP), which undoes the schedule's division by the micro-batch count and
DDP's 1/DP gradient averaging, so the update is the gradient of the whole batch, as in the
native trainer.

Sequences: Megatron's RoPE numbers positions 0..T-1 whatever the position ids, so every row is
right-aligned (:func:`~workers.engines.megatron_convert.right_align`) and causal attention
replaces the padding mask (pads come after a row's tokens).

FP8 KV cache on vLLM: after each step's update, one more forward over the step's rows observes
every layer's K (after RoPE) and V at the real tokens through pre-hooks on the core attention,
and the scales (``p99.9(|x|) x 1.05 / 448``, max-reduced over the trainers) go out with the
weights, as the native side does (:mod:`workers.engines.kv_calibration`).

Rows: the driver gives each trainer its own rows. The ranks of one model-parallel group (TP x PP)
must compute on the same rows, so they gather theirs and each replica trains on the union; every
trainer returns the log-probs of its own rows.

Departures from the native trainer, on purpose or not yet done:
- Adam moments are not checkpointed (``state_dict()["optimizer"] is None``): a resumed run
  restarts them. The supervised warm-up uses the same optimizer at ``warmup.lr`` (one set of main
  weights), not a separate AdamW.
- Main weights are float32 whatever ``precision.master_dtype`` says (Megatron's mixed-precision
  optimizer); ``bfloat16`` only makes the parameters BF16 at build time.
- No KL penalty (it needs a frozen reference model): ``algorithm.kl.coef > 0`` is refused.
"""

from __future__ import annotations

import functools
import math
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rljob.spec import JobSpec
from workers.algo.advantages import grpo_advantages
from workers.algo.grpo import grpo_loss, loss_units_tensor
from workers.engines.megatron_config import (
    MegatronShapes,
    fp8_environment,
    gpt_model_kwargs,
    megatron_audit,
    megatron_state_shapes,
    transformer_config_kwargs,
)
from workers.engines.megatron_convert import (
    global_name,
    hf_payload,
    hf_to_megatron,
    megatron_to_hf,
    merge_tp_shards,
    parallel_kind,
    response_logprobs,
    right_align,
    shard_for_rank,
    stage_layers,
    stage_owned,
    stage_state,
    token_logprobs,
)
from workers.engines.models import build_policy, fp8_config, to_device
from workers.engines.protocols import STEP_SUMS, Payload, Rollouts, TrainStats, train_stats
from workers.fp8.convert import Fp8Audit
from workers.fp8.guard import finite_guard
from workers.fp8.kv_cache import KvScaleCalibrator, kv_scale_name

ALIGN = 16  # sequence length multiple: FP8 GEMMs want the token count a multiple of 16


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type.upper()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pad(t: torch.Tensor, rows: int, left: int = 0, right: int = 0) -> torch.Tensor:
    """Zeros appended to ``rows`` rows (and ``left``/``right`` columns of a 2-D tensor)."""
    extra = rows - t.shape[0]
    if extra == left == right == 0:
        return t
    return F.pad(t, (0, extra)) if t.dim() == 1 else F.pad(t, (left, right, 0, extra))


class MegatronTrainer:
    """Trainer protocol on Megatron-Core (one rank per GPU; ``rank`` among the trainers)."""

    def __init__(self, spec: JobSpec, vocab_size: int, device: str = "cuda", rank: int = 0) -> None:
        if spec.algorithm.kl.coef > 0:
            raise ValueError(
                "algorithm.kl.coef > 0 needs a frozen reference model, which the megatron trainer does "
                "not hold; set algorithm.kl.coef: 0 or resources.trainer_engine: native"
            )
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
        self._kv: KvScaleCalibrator | None = None
        self._kv_seen: set[int] = set()
        self._kv_rows: torch.Tensor | None = None  # the real tokens of the micro-batch being calibrated on
        if spec.precision.fp8_kv_cache and spec.resources.generator_engine == "vllm":
            self._kv = KvScaleCalibrator(self.shapes.layers)
            self._install_kv_hooks()

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

    def _install_kv_hooks(self) -> None:
        first = stage_layers(self.shapes.layers, self.pp, self.pp_rank).start
        for i, layer in enumerate(self.gpt.decoder.layers):
            hook = functools.partial(self._observe_kv, first + i)
            layer.self_attention.core_attention.register_forward_pre_hook(hook, with_kwargs=True)

    def _observe_kv(self, layer: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pre-hook of TEDotProductAttention(query, key, value, ...): K after RoPE (as the cache
        stores it) and V, ``[s, b, heads, d]``, at the real tokens of the calibration pass."""
        rows = self._kv_rows
        if rows is None or self._kv is None or rows.numel() == 0:
            return
        key = args[1] if len(args) > 1 else kwargs["key"]
        value = args[2] if len(args) > 2 else kwargs["value"]
        s, b = key.shape[:2]
        self._kv.observe(
            layer,
            key.reshape(s * b, -1).index_select(0, rows),
            value.reshape(s * b, -1).index_select(0, rows),
        )
        self._kv_seen.add(layer)

    def _no_loss(self, mb: dict[str, Any], logits: torch.Tensor) -> tuple[Any, ...]:
        return self._scalar(0.0), self._one, {}

    @torch.no_grad()
    def _calibrate_kv(self, full: Rollouts, data: dict[str, torch.Tensor]) -> None:
        """KV-cache scales of the updated weights: one forward over the step's rows, observing
        the real tokens (prompt and response, not padding) of every layer's K and V."""
        if self._kv is None:
            return
        self._kv.reset()
        self._kv_seen.clear()
        lengths = (full.prompt_mask.sum(-1) + full.response_mask.sum(-1)).long().tolist()  # one read
        micros = self._micros(data, 0, len(lengths))
        for mb in micros:
            width = mb["ids"].shape[0]  # sbhd: token t of micro-batch row r is row t * width + r
            rows = [torch.arange(lengths[mb["start"] + r]) * width + r for r in range(mb["rows"])]
            mb["kv_rows"] = to_device(
                torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), self.device
            )
        try:
            self._schedule(micros, self._no_loss, forward_only=True)
        finally:
            self._kv_rows = None

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

    # -- batches -----------------------------------------------------------------------------------

    def _scalar(self, value: float) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float32, device=self.device)

    def _dp_sum(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.dp > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self._dp_group)
        return t

    def _replica_batch(
        self, batch: Rollouts, extra: list[torch.Tensor]
    ) -> tuple[Rollouts, list[torch.Tensor], slice, int]:
        """The rows of every trainer of this model-parallel group, in rank order, on the device:
        ``(rows, extra per row, this trainer's slice, its response width)``."""
        local = Rollouts(*(to_device(t, self.device) for t in batch))
        extras = [to_device(e, self.device) for e in extra]
        rows, width_p = local.prompt_ids.shape
        width_l = local.response_ids.shape[1]
        if self._mp_size == 1:
            return local, extras, slice(0, rows), width_l
        meta = torch.tensor([rows, width_p, width_l]).to(self.device)
        table = [torch.empty_like(meta) for _ in range(self._mp_size)]
        dist.all_gather(table, meta, group=self._mp_group)
        sizes = torch.stack(table).tolist()  # one read per step: the slices depend on the row counts
        counts = [s[0] for s in sizes]
        most, p, length = (max(s[i] for s in sizes) for i in range(3))
        padded = [
            _pad(local.prompt_ids, most, left=p - width_p),
            _pad(local.prompt_mask, most, left=p - width_p),
            *(_pad(t, most, right=length - width_l) for t in local[2:]),
            *(_pad(e, most) for e in extras),
        ]
        gathered = []
        for t in padded:
            parts = [torch.empty_like(t) for _ in range(self._mp_size)]
            dist.all_gather(parts, t.contiguous(), group=self._mp_group)
            gathered.append(torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)]))
        start = sum(counts[: dist.get_rank(self._mp_group)])
        return Rollouts(*gathered[:5]), gathered[5:], slice(start, start + rows), width_l

    def _data(self, full: Rollouts) -> dict[str, torch.Tensor]:
        aligned = right_align(full, ALIGN)
        return {
            "ids": aligned.ids, "targets": aligned.targets, "index": aligned.response_index,
            "mask": full.response_mask, "gen": full.logprobs,
        }  # fmt: skip

    def _micros(self, data: dict[str, torch.Tensor], start: int, stop: int) -> list[dict[str, Any]]:
        """Micro-batches of rows ``start..stop``; never none (every rank runs the schedule), and
        all of one size under pipeline parallelism (its P2P shapes are fixed); padding rows are
        zeros with mask 0."""
        mbs = self.spec.optimizer.micro_batch_size
        out = []
        for a in [*range(start, stop, mbs)] or [start]:
            b = min(a + mbs, stop)
            width = mbs if self.pp > 1 else max(b - a, 1)
            out.append({"start": a, "rows": b - a, **{k: _pad(v[a:b], width) for k, v in data.items()}})
        return out

    # -- the schedule ------------------------------------------------------------------------------

    def _schedule(
        self, micros: list[dict[str, Any]], loss_fn: Any, forward_only: bool
    ) -> list[dict[str, Any]]:
        """Megatron's forward(-backward) over ``micros``; the loss dicts (last stage; else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            self._kv_rows = mb.get("kv_rows")
            ids = mb["ids"]  # [b, T]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            logits = model(input_ids=ids, position_ids=positions, attention_mask=None)  # [b, T, V/tp]
            return logits, functools.partial(loss_fn, mb)

        if not forward_only:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        store: list[dict[str, Any]] = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=[self.model],
            num_microbatches=len(micros),
            seq_length=micros[0]["ids"].shape[1],
            micro_batch_size=micros[0]["ids"].shape[0],
            forward_only=forward_only,
        )
        return store

    def _response_logp(self, logits: torch.Tensor, mb: dict[str, Any], temperature: float) -> torch.Tensor:
        """``[b, L]`` log p(response token) from this rank's vocabulary columns ``[b, T, V/tp]``."""
        start = self.tp_rank * logits.shape[-1]  # this rank's first vocabulary column
        tok = token_logprobs(
            logits, mb["targets"], temperature, self._ce, valid_vocab=self.shapes.vocab, vocab_start=start
        )  # [b, T]
        return response_logprobs(tok, mb["index"], mb["mask"])

    def _from_last_stage(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Every stage gets the last stage's value of ``t`` (the others hold zeros)."""
        if self.pp > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self._pp_group)
        return t

    def _logp_loss(self, mb: dict[str, Any], logits: torch.Tensor, temperature: float) -> tuple[Any, ...]:
        logp = self._response_logp(logits, mb, temperature)
        return self._scalar(0.0), self._one, {"logp": logp[: mb["rows"]]}

    @torch.no_grad()
    def _forward_logprobs(self, data: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        n, length = data["mask"].shape
        micros = self._micros(data, 0, n)
        store = self._schedule(micros, functools.partial(self._logp_loss, temperature=temperature), True)
        logp = torch.zeros((n, length), dtype=torch.float32, device=self.device)
        for d, mb in zip(store, micros, strict=False):
            logp[mb["start"] : mb["start"] + mb["rows"]] = d["logp"]
        return self._from_last_stage(logp)  # [n, L]

    def _optimizer_step(self) -> torch.Tensor:
        """Clip and step (gradients are already reduced); the norm before clipping."""
        _, norm, _ = self.optimizer.step()  # Megatron reads the norm back: once per optimizer step
        return self._scalar(float(norm or 0.0))

    # -- the protocol ------------------------------------------------------------------------------

    def logprobs(self, batch: Rollouts, temperature: float) -> torch.Tensor:
        """``[B, L]`` log-probs of this trainer's rows, on the host (every trainer calls it)."""
        full, _, own, length = self._replica_batch(batch, [])
        with finite_guard():
            logp = self._forward_logprobs(self._data(full), temperature)
        return logp[own, :length].cpu()

    def train_step(self, batch: Rollouts, rewards: torch.Tensor, temperature: float) -> TrainStats:
        """One RL step; the statistics cover every trainer's rows (the native trainer's keys)."""
        logp_old, totals = self._train(batch, rewards, temperature)
        return TrainStats(logprobs_old=logp_old.cpu(), stats=train_stats(totals))

    def _grpo_loss(
        self, mb: dict[str, Any], logits: torch.Tensor, temperature: float, units: torch.Tensor, scale: int
    ) -> tuple[Any, ...]:
        logp = self._response_logp(logits, mb, temperature)  # [b, L] with grad
        old = mb["old"] if "old" in mb else logp.detach()
        out = grpo_loss(logp, old, mb["gen"], mb["adv"], mb["mask"], self.spec.algorithm, units)
        sums = torch.stack([out.loss.detach(), out.clipped_tokens, out.is_weight_sum, out.kl_sum])
        # the schedule divides by micro-batches and DDP averages over DP: ``scale`` undoes both
        return (
            out.loss * scale,
            self._one,
            {"sums": sums, "is_max": out.is_weight_max, "old": old[: mb["rows"]]},
        )

    def _train(
        self, batch: Rollouts, rewards: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        algo = self.spec.algorithm
        full, (rw,), own, length = self._replica_batch(batch, [rewards.to(torch.float32)])
        n = full.prompt_ids.shape[0]
        data = self._data(full)
        data["adv"] = grpo_advantages(rw, self.spec.rollout.group_size, algo.advantage_normalization)  # [n]
        loss_sums, is_max, grad_norm = self._scalar(0.0).repeat(4), self._scalar(0.0), self._scalar(0.0)
        seen = torch.zeros(full.logprobs.shape, dtype=torch.float32, device=self.device)  # logp_old as used
        per_mini = max(1, math.ceil(n / algo.minibatches))
        bounds = [(a, min(a + per_mini, n)) for a in range(0, n, per_mini)]
        bounds += [(n, n)] * (algo.minibatches - len(bounds))  # every replica steps as often
        with finite_guard():
            if algo.minibatches > 1:  # the weights that generated score the whole batch first
                data["old"] = self._forward_logprobs(data, temperature)
            for m0, m1 in bounds:
                units = self._dp_sum(loss_units_tensor(full.response_mask[m0:m1], algo.loss_aggregation))
                micros = self._micros(data, m0, m1)
                loss_fn = functools.partial(
                    self._grpo_loss, temperature=temperature, units=units, scale=len(micros) * self.dp
                )
                store = self._schedule(micros, loss_fn, forward_only=False)
                for d, mb in zip(store, micros, strict=False):
                    loss_sums = loss_sums + d["sums"]
                    is_max = torch.maximum(is_max, d["is_max"])
                    seen[mb["start"] : mb["start"] + mb["rows"]] = d["old"]
                grad_norm = torch.maximum(grad_norm, self._optimizer_step())
            self._calibrate_kv(full, data)
        self._from_last_stage(loss_sums)
        self._from_last_stage(is_max, dist.ReduceOp.MAX)
        self._from_last_stage(seen)
        batch_sums = torch.stack([full.response_mask.sum(), data["adv"].abs().sum(), self._scalar(float(n))])
        summed = self._dp_sum(torch.cat([loss_sums, batch_sums.to(torch.float32)]))
        is_max = self._dp_sum(is_max, dist.ReduceOp.MAX)
        totals = dict(zip(STEP_SUMS, summed.unbind(), strict=True))
        return seen[own, :length], {**totals, "is_max": is_max, "grad_norm": grad_norm}

    def _sft_loss(
        self, mb: dict[str, Any], logits: torch.Tensor, tokens: torch.Tensor, scale: int
    ) -> tuple[Any, ...]:
        loss = -self._response_logp(logits, mb, 1.0).sum() / tokens.clamp(min=1.0)
        return loss * scale, self._one, {"loss": loss.detach()}

    def sft_step(self, batch: Rollouts) -> float:
        """One supervised step at ``warmup.lr``; the mean token NLL over every trainer."""
        full, _, _, _ = self._replica_batch(batch, [])
        data = self._data(full)
        tokens = self._dp_sum(full.response_mask.sum().to(torch.float32))
        micros = self._micros(data, 0, full.prompt_ids.shape[0])
        groups = self.optimizer.param_groups
        rl_lr = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = self.spec.warmup.lr
        try:
            loss_fn = functools.partial(self._sft_loss, tokens=tokens, scale=len(micros) * self.dp)
            store = self._schedule(micros, loss_fn, forward_only=False)
            self._optimizer_step()
        finally:
            for g, lr in zip(groups, rl_lr, strict=True):
                g["lr"] = lr
        total = self._scalar(0.0)
        for d in store:
            total = total + d["loss"]
        return float(self._dp_sum(self._from_last_stage(total)))

    # -- weights and state -------------------------------------------------------------------------

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

    def _kv_scales(self) -> dict[str, torch.Tensor]:
        """Per-layer K/V scales, max-reduced over every trainer (TP ranks see different heads, PP
        stages different layers, DP replicas different rows); 1.0 where nothing was observed."""
        assert self._kv is not None
        n = self.shapes.layers
        k = torch.zeros(n, dtype=torch.float32, device=self.device)
        v = torch.zeros_like(k)
        for i in sorted(self._kv_seen):
            k[i], v[i] = self._kv.layer_scales(i)
        for t in (k, v):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        k, v = (torch.where(t > 0, t, torch.ones_like(t)) for t in (k, v))
        out = {kv_scale_name(i, "k"): k[i].clone() for i in range(n)}
        return out | {kv_scale_name(i, "v"): v[i].clone() for i in range(n)}

    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """The payload the generators load, on trainer 0 (``{}`` on the others; all must call).

        The weights are the BF16 compute copies (the float32 main weights rounded once), which is
        also what Transformer Engine quantizes in its GEMMs; ``fp8_names`` are quantized from them
        with the trainer's recipe (:func:`~workers.engines.megatron_convert.hf_payload`). With an
        FP8 KV cache on vLLM the per-layer K/V scales calibrated after the last update come along.
        """
        full = self._gather(master=False)
        kv = self._kv_scales() if self._kv is not None else {}
        if dist.get_rank() != 0:
            return {}
        payload: Payload = dict(
            hf_payload(megatron_to_hf(full, self.shapes), fp8_names, fp8_config(self.spec.precision))
        )
        payload.update(kv)
        return payload

    def state_dict(self) -> dict[str, Any]:
        """``{"model": Hugging Face-named float32 main weights, "optimizer": None}`` on trainer 0
        (an empty model elsewhere; every trainer must call it). Adam moments are not saved."""
        full = self._gather(master=True)
        model = {} if dist.get_rank() != 0 else megatron_to_hf(full, self.shapes)
        return {"model": {k: v.clone() for k, v in model.items()}, "optimizer": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load Hugging Face-named weights (this trainer's or a native one's checkpoint) on every
        trainer. The optimizer restarts: Adam moments were not saved."""
        self._load_megatron(hf_to_megatron(state["model"], self.shapes))

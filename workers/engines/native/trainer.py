"""The native trainer: log-probs of given sequences and GRPO updates on a Hugging Face model in torch.

Precision: master weights, gradients and AdamW state in ``precision.master_dtype`` (float32 by
default). The forward and backward run in BF16 between the GEMMs, exactly as the generator
computes: every forward casts the master parameters to BF16 (:func:`compute_params`), so the
residual stream, norms, attention, RoPE's cos/sin and the logits are the BF16 tensors a generator
holding the synced BF16 weights computes; only the final log-softmax is float32, in both engines.
Under ``fp8-e2e`` the decoder linears are :class:`~workers.fp8.linear.Fp8Linear` (E4M3 blockwise
on all three GEMMs by default, ``precision.fp8_format``), and the FP8 weights they computed with
are what :meth:`export_weights` sends to the generators. Under ``precision.exact`` the model is
built on :mod:`workers.engines.exact`, as the generator's is, and the log-probs of sampled tokens
equal the generator's bit for bit.

One RL step may hold several optimizer steps (``algorithm.minibatches``); each minibatch runs in
micro-batches of ``optimizer.micro_batch_size`` sequences whose gradients add up to the
minibatch's (see :mod:`workers.algo.grpo`). With several trainers (data parallel) gradients and
unit counts are summed over the trainers' process group.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.algo.advantages import grpo_advantages
from workers.algo.grpo import grpo_loss, loss_units
from workers.engines.batching import positions, spaced_rows
from workers.engines.exact import is_exact
from workers.engines.exact import log_softmax as exact_log_softmax
from workers.engines.layer_diff import ExactMismatchError, Trace, trace_forward
from workers.engines.logprobs import token_logprobs
from workers.engines.models import (
    COMPUTE_DTYPE,
    DTYPES,
    apply_recipe,
    attention_mask_4d,
    build_policy,
    compute_params,
    fp8_config,
)
from workers.engines.native.kv_calibration import kv_scale_payload, observe_kv
from workers.engines.native.rms_norm import fuse_norms
from workers.engines.protocols import Rollouts, TrainStats
from workers.engines.step_stats import STEP_SUMS, train_stats
from workers.fp8.convert import Fp8Audit, weight_bytes
from workers.fp8.dispatch import to_device
from workers.fp8.fused import fuse_for_training
from workers.fp8.guard import finite_guard
from workers.fp8.kv_cache import KvRoundingCache, KvScaleCalibrator, KvScales, calibrates_kv
from workers.fp8.weights import WeightBatch
from workers.weight_sync.data import Payload
from workers.weight_sync.payload import export_weights


def sequence_logprobs(
    model: Any,
    batch: Rollouts,
    temperature: float,
    compute_dtype: torch.dtype = COMPUTE_DTYPE,
    kv_scales: KvScales | None = None,
) -> torch.Tensor:
    """log p(response token) under ``model`` for every position: ``[B, L]`` float32 (0 where masked).

    The forward computes in ``compute_dtype`` between the GEMMs (BF16, as the generator does;
    float32 gives a float32 reference). With ``kv_scales`` attention reads K and V rounded as the
    generators' FP8 KV cache holds them (:class:`~workers.fp8.kv_cache.KvRoundingCache`). ``batch``
    may be on the host or on the model's device; the result is on the model's device.
    """
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, response_ids, response_mask = (to_device(t, device) for t in batch[:4])
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+L]
    attn = torch.cat([prompt_mask, response_mask.long()], dim=1)  # [B, P+L]
    length = response_ids.shape[1]
    impl = str(model.config._attn_implementation)
    inputs = {
        "input_ids": ids,
        "attention_mask": attention_mask_4d(attn, ids.shape[1], compute_dtype, impl),
        "position_ids": positions(attn),
        "logits_to_keep": length + 1,
        # no KV cache: Hugging Face would otherwise build one and copy every layer's K and V into it
        "use_cache": False,
    }
    if kv_scales is not None:
        inputs |= {"past_key_values": KvRoundingCache(kv_scales), "use_cache": True}
    # BF16 parameters for this pass (tied weights stay tied); the master ones get the gradients
    params = compute_params(model, compute_dtype)
    out = torch.func.functional_call(model, params, (), inputs, tie_weights=True, strict=False)
    logits = out.logits[:, :-1]  # [B, L, V]: position t predicts token t
    if is_exact(model):  # the row-exact log-softmax the exact generator takes, in one piece
        logp_all = exact_log_softmax(logits.float() / temperature)
        logp = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)
    else:  # no [B, L, V] float32 copy kept (workers/engines/logprobs.py)
        logp = token_logprobs(logits, response_ids, temperature)
    return logp * response_mask  # [B, L]


def _rows(batch: Rollouts, start: int, stop: int) -> Rollouts:
    return Rollouts(*(t[start:stop] for t in batch))


class NativeTrainer:
    """Trainer protocol on a torch model (CPU or one GPU; several with ``dp_group``)."""

    def __init__(self, spec: JobSpec, vocab_size: int, device: str = "cpu", dp_group: Any = None) -> None:
        self.spec, self.device, self.dp_group = spec, torch.device(device), dp_group
        # data-parallel replicas start equal by construction: a random init is drawn on the host
        self.model = build_policy(
            spec,
            vocab_size,
            DTYPES[spec.precision.master_dtype],
            self.device,
            init_on_host=dp_group is not None,
        )
        self.audit: Fp8Audit = apply_recipe(self.model, spec.precision, "trainer")
        # FP8RL_RMS_NORM=triton: every RMSNorm in one kernel, the generator's (rms_norm.py)
        self.fused_norms = fuse_norms(self.model, self.device)
        # q/k/v and gate/up as one FP8 GEMM each, forward and backward, on a GPU (same bytes,
        # members' own master weights; workers/fp8/fused.py); the CPU keeps one GEMM per layer
        self.fused_groups = (
            fuse_for_training(self.model) if self.device.type == "cuda" and not is_exact(self.model) else 0
        )
        # every FP8 weight quantized in one batched call after each optimizer step (workers/fp8/weights.py)
        self.fp8_weights = WeightBatch(self.model)
        self.fp8_weights.quantize()
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.ref_model: Any = None
        # a vLLM generator with an FP8 KV cache gets its K/V scales from here, every step
        self.kv_calibrator: KvScaleCalibrator | None = None
        if calibrates_kv(spec):
            self.kv_calibrator = KvScaleCalibrator(int(self.model.config.num_hidden_layers))
        self.kv_scales: KvScales | None = None
        if spec.algorithm.kl.coef > 0:  # the initial policy, frozen, for the KL penalty
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights (master weights and FP8 copies; not optimizer state)."""
        return weight_bytes(self.model)

    @property
    def kv_in_forward(self) -> KvScales | None:
        """The K/V scales the generators' FP8 cache holds, when the trainer's forward reads K and V
        as that cache does (``precision.fp8_kv_cache_in_training``); else ``None``."""
        return self.kv_scales if self.spec.precision.fp8_kv_cache_in_training else None

    # -- log-probs -------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: Rollouts, temperature: float, model: Any = None) -> torch.Tensor:
        """``[B, L]`` trainer log-probs on the host, in micro-batches, without gradients."""
        return self._logprobs(batch, temperature, model).cpu()

    @torch.no_grad()
    def _logprobs(self, batch: Rollouts, temperature: float, model: Any = None) -> torch.Tensor:
        model = model or self.model
        mbs = self.spec.optimizer.micro_batch_size
        parts = [
            sequence_logprobs(model, _rows(batch, i, i + mbs), temperature, kv_scales=self.kv_in_forward)
            for i in range(0, batch.prompt_ids.shape[0], mbs)
        ]
        return torch.cat(parts, 0)  # [B, L] on the device

    # -- updates ---------------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Reduce ``t`` (on the compute device) over the trainers, in place."""
        if self.dp_group is not None:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.dp_group)
        return t

    def _scalar(self, value: float) -> torch.Tensor:
        # a fill kernel, not a host-to-device copy (which would wait for the copy to finish)
        return torch.full((), value, dtype=torch.float32, device=self.device)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Sum gradients over the trainers, clip, step, clear; returns the norm before clipping."""
        for p in self.model.parameters():
            if p.grad is not None and self.dp_group is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.fp8_weights.quantize()  # for the next forward, weight sync and export alike
        return norm.detach().to(torch.float32)

    def train_step(self, batch: Rollouts, rewards: torch.Tensor, temperature: float) -> TrainStats:
        """One RL step on ``batch`` (``[B, ...]``, groups consecutive) with ``rewards [B]``.

        With several trainers, each passes its own rows; the statistics are those of the whole
        batch (summed over the trainers on the device), the same on every trainer.
        """
        logp_old, totals = self.train_step_on_device(batch, rewards, temperature)
        return TrainStats(logprobs_old=logp_old.cpu(), stats=train_stats(totals))

    def train_step_on_device(
        self, batch: Rollouts, rewards: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`train_step` without reading anything back: ``(logp_old [B, L], totals)`` on the
        device, the totals (0-d tensors) already reduced over the trainers."""
        algo, mbs = self.spec.algorithm, self.spec.optimizer.micro_batch_size
        advantages = grpo_advantages(rewards, self.spec.rollout.group_size, algo.advantage_normalization)
        n = batch.prompt_ids.shape[0]
        host = batch  # counts are read from the host copy; the device copy is moved once
        batch = Rollouts(*(to_device(t, self.device) for t in batch))
        advantages = to_device(advantages, self.device)
        with finite_guard():
            # One optimizer step: the training forward itself gives the "old" log-probs (same weights).
            logp_old = None if algo.minibatches == 1 else self._logprobs(batch, temperature)
            logp_ref = None if self.ref_model is None else self._logprobs(batch, temperature, self.ref_model)
            seen = torch.zeros(
                batch.logprobs.shape, dtype=torch.float32, device=self.device
            )  # logp_old as used
            zero = self._scalar(0.0)
            sums = dict.fromkeys(STEP_SUMS, zero)
            is_max, grad_norm = zero, zero
            per_mini = math.ceil(n / algo.minibatches)
            for m0 in range(0, n, per_mini):
                # the host's mask: counting it there costs the device nothing
                host_mask = host.response_mask[m0 : m0 + per_mini]
                units = self._all_reduce(self._scalar(float(loss_units(host_mask, algo.loss_aggregation))))
                mini_rows = host_mask.shape[0]
                for i in range(0, mini_rows, mbs):
                    a, b = m0 + i, min(m0 + i + mbs, m0 + mini_rows)
                    micro = _rows(batch, a, b)
                    logp = sequence_logprobs(  # [b, L] with grad
                        self.model, micro, temperature, kv_scales=self.kv_in_forward
                    )
                    old = logp.detach() if logp_old is None else logp_old[a:b]
                    seen[a:b] = old
                    out = grpo_loss(
                        logp,
                        old,
                        micro.logprobs,
                        advantages[a:b],
                        micro.response_mask,
                        algo,
                        units,
                        None if logp_ref is None else logp_ref[a:b],
                    )
                    torch.autograd.backward(out.loss)
                    sums["loss"] = sums["loss"] + out.loss.detach()
                    sums["clipped"] = sums["clipped"] + out.clipped_tokens
                    sums["is_sum"] = sums["is_sum"] + out.is_weight_sum
                    sums["kl"] = sums["kl"] + out.kl_sum
                    is_max = torch.maximum(is_max, out.is_weight_max)
                if self.spec.precision.exact and m0 == 0:  # before any update: all "old" log-probs known
                    self._check_exact(seen if logp_old is None else logp_old, batch)
                grad_norm = torch.maximum(grad_norm, self._optimizer_step(self.optimizer))
        sums["tokens"] = self._scalar(float(host.response_mask.sum()))
        sums["adv_abs_sum"] = advantages.abs().sum().to(torch.float32)
        sums["sequences"] = self._scalar(float(n))
        summed = self._all_reduce(torch.stack([sums[k] for k in STEP_SUMS]))
        is_max = self._all_reduce(is_max.clone(), dist.ReduceOp.MAX)
        self.calibrate_kv(host)  # K/V of the updated weights, for vLLM's FP8 KV cache
        totals = dict(zip(STEP_SUMS, summed.unbind(), strict=True))
        # every trainer clipped and stepped with the same summed gradient: the norm is the same
        return seen, {**totals, "is_max": is_max, "grad_norm": grad_norm}

    @torch.no_grad()
    def calibrate_kv(self, batch: Rollouts) -> None:
        """K/V-cache scales of the current weights, observed on ``batch`` (a host batch; at most
        ``precision.kv_calibration_sequences`` of its rows, evenly spaced) and max-reduced over the
        trainers; sent with the next export. A no-op unless this trainer
        calibrates for vLLM's FP8 KV cache (:func:`~workers.fp8.kv_cache.calibrates_kv`)."""
        if self.kv_calibrator is None:
            return
        self.kv_calibrator.reset()
        rows = spaced_rows(batch, self.spec.precision.kv_calibration_sequences)
        observe_kv(self.model, rows, self.kv_calibrator, self.spec.optimizer.micro_batch_size)
        scales = self.kv_calibrator.scales()
        both = self._all_reduce(torch.stack([scales.k, scales.v]), dist.ReduceOp.MAX)  # [2, layers]
        self.kv_scales = KvScales(both[0], both[1], scales.fmt)

    def _check_exact(self, logp_old: torch.Tensor, batch: Rollouts) -> None:
        """``precision.exact``: raise :class:`ExactMismatchError` (every trainer, before its update)
        if any trainer's log-prob of a sampled token differs from the generator's. Reads one flag
        back: exact mode runs on CPU only."""
        differs = (logp_old != batch.logprobs) & (batch.response_mask != 0)  # [B, L]
        flag = self._all_reduce(differs.any().to(torch.float32), dist.ReduceOp.MAX)
        if not bool(flag):
            return
        if not bool(differs.any()):
            raise ExactMismatchError(-1, -1)
        row, pos = (int(i) for i in differs.nonzero()[0])
        raise ExactMismatchError(row, pos, float(logp_old[row, pos]), float(batch.logprobs[row, pos]))

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> Trace:
        """Every module's output at the query predicting ``response[-1]`` after ``prompt``, in the
        trainer's full-sequence forward (:mod:`workers.engines.layer_diff`)."""
        return trace_forward(self.model, prompt, response, compute_params(self.model))

    def sft_step(self, batch: Rollouts) -> float:
        """One supervised step: maximise log p(reference answer). Returns the mean token NLL
        (over every trainer's tokens). The warm-up's own AdamW (``warmup.lr``) is made on first use."""
        if self.sft_optimizer is None:
            self.sft_optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.spec.warmup.lr)
        mbs = self.spec.optimizer.micro_batch_size
        tokens = self._all_reduce(self._scalar(float(batch.response_mask.sum())))
        total = self._scalar(0.0)
        with finite_guard():
            for i in range(0, batch.prompt_ids.shape[0], mbs):
                micro = _rows(batch, i, i + mbs)
                logp = sequence_logprobs(self.model, micro, 1.0)
                loss = -logp.sum() / tokens.clamp(min=1.0)
                torch.autograd.backward(loss)
                total = total + loss.detach()
            self._optimizer_step(self.sft_optimizer)
        return float(self._all_reduce(total))

    # -- weights and state -----------------------------------------------------------------------

    @torch.no_grad()
    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """What the generators load: FP8 data + scales for their FP8 layers, BF16 for the rest.

        ``fp8-e2e``: the trainer's own FP8 weights. ``fp8-gen``: ``fp8_names`` (the generators'
        FP8 layers) quantized now from the master weights. ``bf16``: everything in BF16.
        Data-parallel trainers hold the same weights: only the first one exports.
        """
        if self.dp_group is not None and dist.get_rank(self.dp_group) != 0:
            return {}
        payload = export_weights(self.model, fp8_names, fp8_config(self.spec.precision))
        out = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}
        if self.kv_scales is not None:  # float32, as vLLM keeps them (none before the first step)
            out.update(kv_scale_payload(self.kv_scales))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The weights, the optimizer, and the K/V-cache scales of the last calibration (so that
        a trainer started again from it sends the generators the scales they had)."""
        kv = self.kv_scales.state() if self.kv_scales is not None else None
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "kv_scales": kv}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.fp8_weights.quantize()
        if self.kv_calibrator is not None:  # none in a state saved before its first calibration
            self.kv_scales = KvScales.from_state(state.get("kv_scales"), self.device)

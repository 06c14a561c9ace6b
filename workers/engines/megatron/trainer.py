"""The Trainer protocol on Megatron-Core (tensor, pipeline and data parallel; GPU or CPU).

Megatron-Core and Transformer Engine are imported inside the methods, so this module imports
anywhere (the pure parts live in :mod:`workers.engines.megatron.convert`). The trainer holds its
parts as attributes, one module each: the model, optimizer and full state
(:class:`~workers.engines.megatron.model.MegatronModel`), rows, micro-batches and the schedule
(:class:`~workers.engines.megatron.schedule.MegatronSchedule`) and, with an FP8 KV cache on vLLM,
the K/V-scale calibration (:class:`~workers.engines.megatron.kv.MegatronKvCalibration`); here are
the RL and supervised steps and the weight export.

The RL update is the native trainer's (:mod:`workers.engines.native.trainer`): the same
``grpo_advantages``, ``grpo_loss`` (with its importance-sampling correction) and ``loss_units``,
minibatches and micro-batches. Each micro-batch's loss is ``grpo_loss`` with the minibatch's units
summed over the data-parallel replicas; the loss function hands Megatron's schedule that loss
times (micro-batches x DP), which undoes the schedule's division by the micro-batch count and
DDP's 1/DP gradient averaging, so the update is the gradient of the whole batch, as in the
native trainer.

Departures from the native trainer, on purpose or not yet done:
- The supervised warm-up uses the same optimizer at ``warmup.lr`` (one set of main weights and
  Adam moments), not a separate AdamW. Checkpoints hold Adam's moments by Hugging Face name, not
  torch's optimizer state: a native checkpoint's optimizer state is not loaded (Adam restarts).
- Main weights are float32 whatever ``precision.master_dtype`` says (Megatron's mixed-precision
  optimizer); ``bfloat16`` only makes the parameters BF16 at build time.
- No KL penalty (it needs a frozen reference model; the spec refuses ``algorithm.kl.coef > 0``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from rljob.spec import JobSpec
from workers.algo.advantages import grpo_advantages
from workers.algo.grpo import grpo_loss, loss_units_tensor
from workers.engines.batching import spaced_rows
from workers.engines.megatron.convert import hf_payload, hf_to_megatron, megatron_to_hf
from workers.engines.megatron.kv import MegatronKvCalibration
from workers.engines.megatron.model import MegatronModel
from workers.engines.megatron.schedule import MegatronSchedule
from workers.engines.models import fp8_config
from workers.engines.protocols import Rollouts, TrainStats
from workers.engines.step_stats import STEP_SUMS, train_stats
from workers.fp8.convert import Fp8Audit
from workers.fp8.guard import finite_guard
from workers.fp8.kv_cache import calibrates_kv
from workers.weight_sync.data import Payload


class MegatronTrainer:
    """Trainer protocol on Megatron-Core (one rank per GPU, or per process on the CPU; ``rank``
    among the trainers). ``compute_dtype``: BF16 (the job's) or float32 (a reference run)."""

    def __init__(
        self,
        spec: JobSpec,
        vocab_size: int,
        device: str = "cuda",
        rank: int = 0,
        *,
        compute_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.spec = spec
        self.model = MegatronModel(spec, vocab_size, device, rank, compute_dtype)
        self.schedule = MegatronSchedule(self.model, spec.optimizer.micro_batch_size)
        self.kv = (
            MegatronKvCalibration(self.schedule, spec.precision.fp8_kv_cache_in_training)
            if calibrates_kv(spec)
            else None
        )
        self.device: torch.device = self.model.device
        self.audit: Fp8Audit = self.model.audit

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    # -- the protocol ------------------------------------------------------------------------------

    def logprobs(self, batch: Rollouts, temperature: float) -> torch.Tensor:
        """``[B, L]`` log-probs of this trainer's rows, on the host (every trainer calls it)."""
        full, _, own, length = self.schedule.replica_batch(batch, [])
        with finite_guard():
            logp = self.schedule.forward_logprobs(self.schedule.data(full), temperature)
        return logp[own, :length].cpu()

    def train_step(self, batch: Rollouts, rewards: torch.Tensor, temperature: float) -> TrainStats:
        """One RL step; the statistics cover every trainer's rows (the native trainer's keys)."""
        logp_old, totals = self._train(batch, rewards, temperature)
        return TrainStats(logprobs_old=logp_old.cpu(), stats=train_stats(totals))

    def _grpo_loss(
        self, mb: dict[str, Any], logits: torch.Tensor, temperature: float, units: torch.Tensor, scale: int
    ) -> tuple[Any, ...]:
        logp = self.schedule.response_logp(logits, mb, temperature)  # [b, L] with grad
        old = mb["old"] if "old" in mb else logp.detach()
        out = grpo_loss(logp, old, mb["gen"], mb["adv"], mb["mask"], self.spec.algorithm, units)
        sums = torch.stack([out.loss.detach(), out.clipped_tokens, out.is_weight_sum, out.kl_sum])
        # the schedule divides by micro-batches and DDP averages over DP: ``scale`` undoes both
        return (
            out.loss * scale,
            self.schedule.one,
            {"sums": sums, "is_max": out.is_weight_max, "old": old[: mb["rows"]]},
        )

    def _train(
        self, batch: Rollouts, rewards: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        algo, sched = self.spec.algorithm, self.schedule
        full, (rw,), own, length = sched.replica_batch(batch, [rewards.to(torch.float32)])
        n = full.prompt_ids.shape[0]
        data = sched.data(full)
        data["adv"] = grpo_advantages(rw, self.spec.rollout.group_size, algo.advantage_normalization)  # [n]
        loss_sums, is_max, grad_norm = sched.scalar(0.0).repeat(4), sched.scalar(0.0), sched.scalar(0.0)
        seen = torch.zeros(full.logprobs.shape, dtype=torch.float32, device=self.device)  # logp_old as used
        per_mini = max(1, math.ceil(n / algo.minibatches))
        bounds = [(a, min(a + per_mini, n)) for a in range(0, n, per_mini)]
        bounds += [(n, n)] * (algo.minibatches - len(bounds))  # every replica steps as often
        dp = self.model.groups.dp
        with finite_guard():
            if algo.minibatches > 1:  # the weights that generated score the whole batch first
                data["old"] = sched.forward_logprobs(data, temperature)
            for m0, m1 in bounds:
                units = sched.dp_sum(loss_units_tensor(full.response_mask[m0:m1], algo.loss_aggregation))
                micros = sched.micros(data, m0, m1)
                loss_fn = functools.partial(
                    self._grpo_loss, temperature=temperature, units=units, scale=len(micros) * dp
                )
                store = sched.run(micros, loss_fn, forward_only=False)
                for d, mb in zip(store, micros, strict=False):
                    loss_sums = loss_sums + d["sums"]
                    is_max = torch.maximum(is_max, d["is_max"])
                    seen[mb["start"] : mb["start"] + mb["rows"]] = d["old"]
                grad_norm = torch.maximum(grad_norm, self.model.step())
            if self.kv is not None:  # K/V of the updated weights, for vLLM's FP8 KV cache
                self._calibrate(full)
        sched.from_last_stage(loss_sums)
        sched.from_last_stage(is_max, dist.ReduceOp.MAX)
        sched.from_last_stage(seen)
        batch_sums = torch.stack([full.response_mask.sum(), data["adv"].abs().sum(), sched.scalar(float(n))])
        summed = sched.dp_sum(torch.cat([loss_sums, batch_sums.to(torch.float32)]))
        is_max = sched.dp_sum(is_max, dist.ReduceOp.MAX)
        totals = dict(zip(STEP_SUMS, summed.unbind(), strict=True))
        return seen[own, :length], {**totals, "is_max": is_max, "grad_norm": grad_norm}

    def _sft_loss(
        self, mb: dict[str, Any], logits: torch.Tensor, tokens: torch.Tensor, scale: int
    ) -> tuple[Any, ...]:
        loss = -self.schedule.response_logp(logits, mb, 1.0).sum() / tokens.clamp(min=1.0)
        return loss * scale, self.schedule.one, {"loss": loss.detach()}

    def sft_step(self, batch: Rollouts) -> float:
        """One supervised step at ``warmup.lr``; the mean token NLL over every trainer."""
        sched = self.schedule
        full, _, _, _ = sched.replica_batch(batch, [])
        data = sched.data(full)
        tokens = sched.dp_sum(full.response_mask.sum().to(torch.float32))
        micros = sched.micros(data, 0, full.prompt_ids.shape[0])
        groups = self.model.optimizer.param_groups
        rl_lr = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = self.spec.warmup.lr
        try:
            scale = len(micros) * self.model.groups.dp
            store = sched.run(micros, functools.partial(self._sft_loss, tokens=tokens, scale=scale), False)
            self.model.step()
        finally:
            for g, lr in zip(groups, rl_lr, strict=True):
                g["lr"] = lr
        total = sched.scalar(0.0)
        for d in store:
            total = total + d["loss"]
        return float(sched.dp_sum(sched.from_last_stage(total)))

    # -- weights and state -------------------------------------------------------------------------

    def calibrate_kv(self, batch: Rollouts) -> None:
        """K/V-cache scales of the current weights, observed on ``batch`` (every trainer calls it
        with its rows; at most ``precision.kv_calibration_sequences`` of the replica's); sent with
        the next export. A no-op without an FP8 KV cache on vLLM."""
        if self.kv is None:
            return
        full, _, _, _ = self.schedule.replica_batch(batch, [])
        self._calibrate(full)

    def _calibrate(self, full: Rollouts) -> None:
        """Calibrate on at most ``precision.kv_calibration_sequences`` of a replica's rows, evenly
        spaced (the same rows on every rank of the model-parallel group: ``full`` is theirs too)."""
        assert self.kv is not None
        rows = spaced_rows(full, self.spec.precision.kv_calibration_sequences)
        self.kv.calibrate(rows, self.schedule.data(rows))

    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """The payload the generators load, on trainer 0 (``{}`` on the others; all must call).

        The weights are the compute copies (the float32 main weights rounded once to BF16), which
        is also what Transformer Engine quantizes in its GEMMs; ``fp8_names`` are quantized from
        them with the trainer's recipe (:func:`~workers.engines.megatron.convert.hf_payload`). With
        an FP8 KV cache on vLLM the per-layer K/V scales calibrated after the last update come
        along.
        """
        full = self.model.gather(master=False)
        kv = self.kv.scales() if self.kv is not None else {}
        if dist.get_rank() != 0:
            return {}
        hf = megatron_to_hf(full, self.model.shapes)
        payload: Payload = dict(hf_payload(hf, fp8_names, fp8_config(self.spec.precision)))
        payload.update(kv)
        return payload

    def trace_token(self, prompt: torch.Tensor, response: torch.Tensor) -> dict[str, torch.Tensor]:
        """Not available: Megatron-Core's modules are not the Hugging Face ones a trace names,
        so nothing would line up with a generator's trace. ``fp8rl layer-diff`` traces the native
        engines."""
        raise NotImplementedError(
            "per-module traces (fp8rl layer-diff) need the native trainer; this job's trainer is "
            "Megatron-Core (resources.trainer_engine)"
        )

    def state_dict(self) -> dict[str, Any]:
        """On trainer 0 (empty elsewhere; every trainer must call it), Hugging Face names:
        ``{"model": float32 main weights, "optimizer": {"steps": Adam's step count, "exp_avg":
        .., "exp_avg_sq": ..} (None before the first step), "kv_scales": the K/V-cache scales of
        the last calibration (None without one)}``."""
        full = self.model.gather(master=True)
        adam = self.model.gather_adam()
        if dist.get_rank() != 0:
            return {"model": {}, "optimizer": None}
        model = megatron_to_hf(full, self.model.shapes)
        optimizer = None
        if adam is not None:
            steps, moments = adam
            optimizer = {"steps": steps} | {
                key: _copy(megatron_to_hf(full, self.model.shapes)) for key, full in moments.items()
            }
        kv = self.kv.state() if self.kv is not None else None
        return {"model": _copy(model), "optimizer": optimizer, "kv_scales": kv}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load Hugging Face-named weights on every trainer: this trainer's checkpoint (Adam's
        moments too) or a native one's (whose optimizer state does not map: Adam starts afresh)."""
        shapes = self.model.shapes
        self.model.load(hf_to_megatron(state["model"], shapes))
        opt = state.get("optimizer")
        if isinstance(opt, dict) and "exp_avg" in opt:
            moments = {key: hf_to_megatron(opt[key], shapes) for key in ("exp_avg", "exp_avg_sq")}
            self.model.load_adam(int(opt["steps"]), moments)
        else:
            self.model.load_adam(0, None)
        if self.kv is not None:
            self.kv.load(state.get("kv_scales"))


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's own tensors: the gathered ones may be the live weights and moments."""
    return {k: v.clone() for k, v in state.items()}

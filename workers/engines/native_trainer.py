"""The native trainer: log-probs of given sequences and GRPO updates on a Hugging Face model in torch.

Precision: master weights and AdamW state in ``precision.master_dtype`` (float32 by default);
the forward and backward run under BF16 autocast. Under ``fp8-e2e`` the decoder linears are
:class:`~workers.fp8.linear.Fp8Linear` (E4M3 forward, E5M2 gradients), and the FP8 weights they
computed with are what :meth:`export_weights` sends to the generators.

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
from workers.engines.models import DTYPES, apply_recipe, build_policy, fp8_config
from workers.engines.protocols import Payload, Rollouts, TrainStats, positions
from workers.fp8.convert import Fp8Audit
from workers.fp8.export import export_weights


def sequence_logprobs(model: Any, batch: Rollouts, temperature: float) -> torch.Tensor:
    """log p(response token) under ``model`` for every position: ``[B, L]`` float32 (0 where masked)."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, P+L]
    attn = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)  # [B, P+L]
    length = batch.response_ids.shape[1]
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            position_ids=positions(attn).to(device),
            logits_to_keep=length + 1,
        )
    logits = out.logits[:, :-1].float() / temperature  # [B, L, V]: position t predicts token t
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.to(device)[..., None]).squeeze(-1)
    return logp * batch.response_mask.to(device)  # [B, L]


def _rows(batch: Rollouts, start: int, stop: int) -> Rollouts:
    return Rollouts(*(t[start:stop] for t in batch))


class NativeTrainer:
    """Trainer protocol on a torch model (CPU or one GPU; several with ``dp_group``)."""

    def __init__(self, spec: JobSpec, vocab_size: int, device: str = "cpu", dp_group: Any = None) -> None:
        self.spec, self.device, self.dp_group = spec, torch.device(device), dp_group
        self.model = build_policy(spec, vocab_size, DTYPES[spec.precision.master_dtype], self.device)
        self.audit: Fp8Audit = apply_recipe(self.model, spec.precision, "trainer")
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.ref_model: Any = None
        if spec.algorithm.kl.coef > 0:  # the initial policy, frozen, for the KL penalty
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)

    # -- log-probs -------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: Rollouts, temperature: float, model: Any = None) -> torch.Tensor:
        """``[B, L]`` trainer log-probs, in micro-batches, without gradients."""
        model = model or self.model
        mbs = self.spec.optimizer.micro_batch_size
        parts = [
            sequence_logprobs(model, _rows(batch, i, i + mbs), temperature).cpu()
            for i in range(0, batch.prompt_ids.shape[0], mbs)
        ]
        return torch.cat(parts, 0)

    # -- updates ---------------------------------------------------------------------------------

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> float:
        """Sum gradients over the trainers, clip, step, clear; returns the norm before clipping."""
        for p in self.model.parameters():
            if p.grad is not None and self.dp_group is not None:
                dist.all_reduce(p.grad, group=self.dp_group)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def train_step(self, batch: Rollouts, rewards: torch.Tensor, temperature: float) -> TrainStats:
        """One RL step on ``batch`` (``[B, ...]``, groups consecutive) with ``rewards [B]``."""
        algo, mbs = self.spec.algorithm, self.spec.optimizer.micro_batch_size
        advantages = grpo_advantages(rewards, self.spec.rollout.group_size, algo.advantage_normalization)
        n = batch.prompt_ids.shape[0]
        # One optimizer step: the training forward itself gives the "old" log-probs (same weights).
        logp_old = None if algo.minibatches == 1 else self.logprobs(batch, temperature)
        logp_ref = None if self.ref_model is None else self.logprobs(batch, temperature, self.ref_model)
        seen = torch.zeros_like(batch.logprobs)  # [B, L] logp_old as used
        totals = dict(loss=0.0, clipped=0.0, is_sum=0.0, is_max=0.0, kl=0.0, grad_norm=0.0)
        per_mini = math.ceil(n / algo.minibatches)
        for m0 in range(0, n, per_mini):
            mini = _rows(batch, m0, m0 + per_mini)
            units = self._all_reduce(
                torch.tensor(float(loss_units(mini.response_mask, algo.loss_aggregation)))
            )
            for i in range(0, mini.prompt_ids.shape[0], mbs):
                a, b = m0 + i, min(m0 + i + mbs, m0 + mini.prompt_ids.shape[0])
                micro = _rows(batch, a, b)
                logp = sequence_logprobs(self.model, micro, temperature)  # [b, L] with grad
                old = logp.detach().cpu() if logp_old is None else logp_old[a:b]
                seen[a:b] = old
                out = grpo_loss(
                    logp,
                    old.to(logp.device),
                    micro.logprobs.to(logp.device),
                    advantages[a:b].to(logp.device),
                    micro.response_mask.to(logp.device),
                    algo,
                    int(units.item()),
                    None if logp_ref is None else logp_ref[a:b].to(logp.device),
                )
                torch.autograd.backward(out.loss)
                totals["loss"] += float(out.loss.detach())
                totals["clipped"] += out.clipped_tokens
                totals["is_sum"] += out.is_weight_sum
                totals["is_max"] = max(totals["is_max"], out.is_weight_max)
                totals["kl"] += out.kl_sum
            totals["grad_norm"] = max(totals["grad_norm"], self._optimizer_step(self.optimizer))
        tokens = max(float(batch.response_mask.sum()), 1.0)
        stats = {
            "train/loss": totals["loss"],
            "train/grad_norm": totals["grad_norm"],
            "train/clip_fraction": totals["clipped"] / tokens,
            "train/kl": totals["kl"] / tokens,
            "is/weight_mean": totals["is_sum"] / tokens,
            "is/weight_max": totals["is_max"],
            "train/advantage_abs_mean": float(advantages.abs().mean()),
        }
        return TrainStats(logprobs_old=seen, stats=stats)

    def sft_step(self, batch: Rollouts, optimizer: torch.optim.Optimizer) -> float:
        """One supervised step: maximise log p(reference answer). Returns the mean token NLL."""
        mbs = self.spec.optimizer.micro_batch_size
        tokens = self._all_reduce(torch.tensor(float(batch.response_mask.sum())))
        total = 0.0
        for i in range(0, batch.prompt_ids.shape[0], mbs):
            micro = _rows(batch, i, i + mbs)
            logp = sequence_logprobs(self.model, micro, 1.0)
            loss = -logp.sum() / tokens.clamp(min=1.0)
            torch.autograd.backward(loss)
            total += float(loss.detach())
        self._optimizer_step(optimizer)
        return total

    # -- weights and state -----------------------------------------------------------------------

    @torch.no_grad()
    def export_weights(self, fp8_names: list[str] | tuple[str, ...] = ()) -> Payload:
        """What the generators load: FP8 data + scales for their FP8 layers, BF16 for the rest.

        ``fp8-e2e``: the trainer's own FP8 weights. ``fp8-gen``: ``fp8_names`` (the generators'
        FP8 layers) quantized now from the master weights. ``bf16``: everything in BF16.
        """
        payload = export_weights(self.model, fp8_names, fp8_config(self.spec.precision))
        return {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

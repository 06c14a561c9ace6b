"""Rows, micro-batches and Megatron's forward(-backward) schedule for the Megatron trainer.

Megatron-Core is imported inside the methods, so this module imports anywhere.

Sequences: Megatron's RoPE numbers positions 0..T-1 whatever the position ids, so every row is
right-aligned (:func:`~workers.engines.megatron.convert.right_align`) and causal attention
replaces the padding mask (pads come after a row's tokens).

Rows: the driver gives each trainer its own rows. The ranks of one model-parallel group (TP x PP)
must compute on the same rows, so they gather theirs and each replica trains on the union; every
trainer returns the log-probs of its own rows.

Loss functions follow the schedule's convention: ``loss_fn(micro-batch, logits)`` returns
``(loss, num_tokens, reduced dict)``; the schedule returns the reduced dicts (last stage; else []).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.engines.megatron import without_cuda
from workers.engines.megatron.convert import response_logprobs, right_align, token_logprobs
from workers.engines.megatron.model import MegatronModel
from workers.engines.protocols import Rollouts
from workers.fp8.dispatch import to_device

ALIGN = 16  # sequence length multiple: FP8 GEMMs want the token count a multiple of 16
LossFn = Callable[[dict[str, Any], torch.Tensor], tuple[Any, ...]]


def _pad(t: torch.Tensor, rows: int, left: int = 0, right: int = 0) -> torch.Tensor:
    """Zeros appended to ``rows`` rows (and ``left``/``right`` columns of a 2-D tensor)."""
    extra = rows - t.shape[0]
    if extra == left == right == 0:
        return t
    return F.pad(t, (0, extra)) if t.dim() == 1 else F.pad(t, (left, right, 0, extra))


class MegatronSchedule:
    """A trainer rank's batches and Megatron's schedule over them, for ``model``."""

    def __init__(self, model: MegatronModel, micro_batch_size: int) -> None:
        self.model, self.groups, self.device = model, model.groups, model.device
        self.micro_batch_size = micro_batch_size
        self.one = torch.ones((), dtype=torch.int, device=self.device)

    # -- batches -----------------------------------------------------------------------------------

    def scalar(self, value: float) -> torch.Tensor:
        # a fill kernel, not a host-to-device copy
        return torch.full((), value, dtype=torch.float32, device=self.device)

    def dp_sum(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Reduce ``t`` over the data-parallel replicas, in place."""
        if self.groups.dp > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.groups.dp_group)
        return t

    def from_last_stage(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Every stage gets the last stage's value of ``t`` (the others hold zeros)."""
        if self.groups.pp > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.groups.pp_group)
        return t

    def replica_batch(
        self, batch: Rollouts, extra: list[torch.Tensor]
    ) -> tuple[Rollouts, list[torch.Tensor], slice, int]:
        """The rows of every trainer of this model-parallel group, in rank order, on the device:
        ``(rows, extra per row, this trainer's slice, its response width)``."""
        g = self.groups
        local = Rollouts(*(to_device(t, self.device) for t in batch))
        extras = [to_device(e, self.device) for e in extra]
        rows, width_p = local.prompt_ids.shape
        width_l = local.response_ids.shape[1]
        if g.mp_size == 1:
            return local, extras, slice(0, rows), width_l
        meta = torch.tensor([rows, width_p, width_l]).to(self.device)
        table = [torch.empty_like(meta) for _ in range(g.mp_size)]
        dist.all_gather(table, meta, group=g.mp_group)
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
            parts = [torch.empty_like(t) for _ in range(g.mp_size)]
            dist.all_gather(parts, t.contiguous(), group=g.mp_group)
            gathered.append(torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)]))
        start = sum(counts[: dist.get_rank(g.mp_group)])
        return Rollouts(*gathered[:5]), gathered[5:], slice(start, start + rows), width_l

    def data(self, full: Rollouts) -> dict[str, torch.Tensor]:
        """The per-row tensors micro-batches are cut from (right-aligned ids, targets, ...)."""
        aligned = right_align(full, ALIGN)
        return {
            "ids": aligned.ids, "targets": aligned.targets, "index": aligned.response_index,
            "mask": full.response_mask, "gen": full.logprobs,
        }  # fmt: skip

    def micros(self, data: dict[str, torch.Tensor], start: int, stop: int) -> list[dict[str, Any]]:
        """Micro-batches of rows ``start..stop``; never none (every rank runs the schedule), and
        all of one size under pipeline parallelism (its P2P shapes are fixed); padding rows are
        zeros with mask 0."""
        mbs = self.micro_batch_size
        out = []
        for a in [*range(start, stop, mbs)] or [start]:
            b = min(a + mbs, stop)
            width = mbs if self.groups.pp > 1 else max(b - a, 1)
            out.append({"start": a, "rows": b - a, **{k: _pad(v[a:b], width) for k, v in data.items()}})
        return out

    # -- the schedule ------------------------------------------------------------------------------

    def run(
        self,
        micros: list[dict[str, Any]],
        loss_fn: LossFn,
        forward_only: bool,
        before_forward: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Megatron's forward(-backward) over ``micros``; the loss dicts (last stage; else []).
        ``before_forward(micro-batch)`` runs before each forward (the KV calibration's rows)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # on the CPU an explicit causal mask (see without_cuda.causal_mask); TE's attention is causal
        on_cpu = self.device.type == "cpu"

        def forward_step(data_iterator: Iterator[dict[str, Any]], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            if before_forward is not None:
                before_forward(mb)
            ids = mb["ids"]  # [b, T]
            positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            mask = without_cuda.causal_mask(ids.shape[1], ids.device) if on_cpu else None
            logits = model(input_ids=ids, position_ids=positions, attention_mask=mask)  # [b, T, V/tp]
            return logits, functools.partial(loss_fn, mb)

        if not forward_only:
            self.model.zero_grad()
        with self.model.calls():
            store: list[dict[str, Any]] = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micros),
                model=[self.model.model],
                num_microbatches=len(micros),
                seq_length=micros[0]["ids"].shape[1],
                micro_batch_size=micros[0]["ids"].shape[0],
                forward_only=forward_only,
            )
        return store

    def response_logp(self, logits: torch.Tensor, mb: dict[str, Any], temperature: float) -> torch.Tensor:
        """``[b, L]`` log p(response token) from this rank's vocabulary columns ``[b, T, V/tp]``."""
        start = self.groups.tp_rank * logits.shape[-1]  # this rank's first vocabulary column
        tok = token_logprobs(
            logits,
            mb["targets"],
            temperature,
            self.model.cross_entropy,
            valid_vocab=self.model.shapes.vocab,
            vocab_start=start,
        )  # [b, T]
        return response_logprobs(tok, mb["index"], mb["mask"])

    def _logp_loss(self, mb: dict[str, Any], logits: torch.Tensor, temperature: float) -> tuple[Any, ...]:
        logp = self.response_logp(logits, mb, temperature)
        return self.scalar(0.0), self.one, {"logp": logp[: mb["rows"]]}

    @torch.no_grad()
    def forward_logprobs(self, data: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """``[n, L]`` log-probs of every row of ``data``, on every stage."""
        n, length = data["mask"].shape
        micros = self.micros(data, 0, n)
        store = self.run(micros, functools.partial(self._logp_loss, temperature=temperature), True)
        logp = torch.zeros((n, length), dtype=torch.float32, device=self.device)
        for d, mb in zip(store, micros, strict=False):
            logp[mb["start"] : mb["start"] + mb["rows"]] = d["logp"]
        return self.from_last_stage(logp)  # [n, L]

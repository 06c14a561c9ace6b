"""Sampling shared by the native generator's decode loops (eager and graph-captured): the
exponential-race draw (in torch, or with ``FP8RL_SAMPLING=triton`` in three launches,
:mod:`workers.engines.native.triton_sample`), and "every row finished" asked without a host sync."""

from __future__ import annotations

from collections.abc import Callable

import torch


def enabled(device: torch.device) -> bool:
    """``FP8RL_SAMPLING``: ``torch`` (default until a GPU has measured it) or ``triton`` (a decode
    step's log-softmax, draw and log-prob in three launches for ``top_p = 1``, the same race on
    the same random numbers; CUDA, or the CPU under Triton's interpreter). Asked for where it
    cannot run, it logs why once and torch's path runs."""
    from workers.fp8.dispatch import triton_switch

    return triton_switch("FP8RL_SAMPLING", "torch", "triton", device, "torch's sampling")


def sample_top_p(probs: torch.Tensor, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``probs [B, V]`` restricted to the smallest set of mass >= top_p.

    ``argmax(p / E)`` with ``E ~ Exp(1)`` draws index i with probability p_i / sum(p): the same
    draw as ``torch.multinomial(p, 1)`` for the same generator state, without its host read.
    """
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V]
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        choice = _race(sorted_p, gen)  # [B] index into sorted
        return order.gather(-1, choice[:, None]).squeeze(-1)
    return _race(probs, gen)  # [B]


def _race(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    exp = torch.empty_like(probs).exponential_(1, generator=gen)  # [B, V]
    return (probs / exp).argmax(-1)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def stops(tok: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether each token of ``tok [B]`` is one of the ids in ``stop [S]``."""
    return (tok[:, None] == stop[None, :]).any(-1)


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator | None,
    finished: torch.Tensor,
    pad_id: int,
    log_softmax: Callable[[torch.Tensor], torch.Tensor] = log_softmax,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's choice from ``logits [B, V]``: ``(token [B], its log-prob [B])``.

    Temperature 0 is greedy (the argmax; log-probs at temperature 1), else a draw restricted to
    ``top_p``; rows already ``finished`` get ``pad_id``. Greedy is a host-side choice (a Python
    float), so a decode loop calling this never syncs. ``fused`` (the caller's :func:`enabled`,
    with the plain ``log_softmax``): without top-p, the Triton kernels compute it.
    """
    if fused and top_p >= 1.0:
        from workers.engines.native.triton_sample import sample_rows

        return sample_rows(logits, temperature, gen, finished, pad_id)
    logp_all = log_softmax(logits.float() / (temperature or 1.0))  # [B, V]
    tok = logp_all.argmax(-1) if temperature == 0 else sample_top_p(logp_all.exp(), top_p, gen)
    tok = torch.where(finished, torch.full_like(tok, pad_id), tok)
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


class AllFinished:
    """Whether every row has finished, asked without making the host wait for the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.value = False
        if device.type == "cuda":
            self.host = torch.zeros((), dtype=torch.bool).pin_memory()
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.pending = False

    def post(self, finished: torch.Tensor) -> None:
        if self.device.type == "cpu":
            self.value = bool(finished.all())
        elif self.device.type == "cuda" and not self.pending:
            self.host.copy_(finished.all(), non_blocking=True)
            self.event.record()
            self.pending = True

    def __bool__(self) -> bool:
        if self.device.type == "cuda" and self.pending and self.event.query():  # type: ignore[no-untyped-call]
            self.pending = False
            self.value = bool(self.host)  # host memory, already written: no wait
        return self.value

"""Where do generator and trainer first disagree? A per-layer comparison of one token.

The generator computes the log-prob of response token ``j`` from the query at the last prompt
token (``j = 0``, in the prefill) or at response token ``j - 1`` (a decode step over the KV
cache); the trainer from the same position in one full-sequence forward. :func:`trace_generation`
and :func:`trace_forward` run one sequence those two ways with a forward hook on every module and
keep each module's output at that query (one row); :func:`compare_traces` lists the modules in the
order they ran, with the largest difference of their outputs, so the first one that differs is
where the two computations part. Each trace runs on the engine that owns the model (its weights,
its FP8 layers), so engine differences show too.

Under ``precision.exact`` the trainer raises :class:`ExactMismatchError` before its update when a
log-prob differs, and the driver names the first differing layer with these traces. In the
default mode the same functions show where the mismatch that importance sampling corrects comes
from (``fp8rl layer-diff``).

A trace runs the sequence alone (batch of one, no padding); under exact mode a row's numbers do not
depend on its batch, in the default mode they may, by rounding.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers import DynamicCache

from workers.engines.models import attention_mask_4d

Trace = dict[str, torch.Tensor]  # module name -> its output at the traced query, float32 [...]


class ExactMismatchError(RuntimeError):
    """A trainer log-prob differs from the generator's under ``precision.exact``.

    ``row``/``position``: the first differing token in the trainer's own rows (``row = -1``: the
    difference is on another data-parallel trainer). Raised before any weight update, so the
    trainer still holds the weights that generated. ``trainer_index``: which trainer found it (set
    where the trainers' errors are gathered, :meth:`on_trainer`).
    """

    def __init__(self, row: int, position: int, trainer: float = 0.0, generator: float = 0.0) -> None:
        super().__init__(row, position, trainer, generator)
        self.row, self.position, self.trainer, self.generator = row, position, trainer, generator
        self.detail = ""
        self.trainer_index = 0

    def on_trainer(self, index: int) -> ExactMismatchError:
        """The same error, found by trainer ``index``."""
        self.trainer_index = index
        return self

    def with_detail(self, detail: str) -> ExactMismatchError:
        """The same error with what the per-layer comparison found."""
        self.detail = detail
        return self

    def __str__(self) -> str:
        if self.row < 0:
            return "precision.exact: another trainer found a log-prob that differs from the generator's"
        return (
            f"precision.exact: trainer log-prob {self.trainer!r} != generator log-prob {self.generator!r} "
            f"at row {self.row}, response position {self.position}"
            + (f"; {self.detail}" if self.detail else "")
            + ". Report it with the spec; set precision.exact: false to train with importance sampling"
        )


class LayerDiff(NamedTuple):
    """One module's output at the traced token, generator way against trainer way."""

    name: str
    max_abs_diff: float  # max |a - b| (inf when shapes differ)
    equal: bool  # bit for bit


def _output_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    hidden = getattr(out, "last_hidden_state", None)
    return hidden if isinstance(hidden, torch.Tensor) else None


@contextmanager
def _recording(model: nn.Module, index: int, trace: Trace) -> Iterator[None]:
    """Record every named module's output at sequence index ``index`` (dim 1) into ``trace``."""

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: Any, out: Any) -> None:
            t = _output_tensor(out)
            if t is not None and t.dim() >= 2:
                trace[name] = t[:, index].detach().float().clone()

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _call(model: Any, params: dict[str, torch.Tensor] | None, inputs: dict[str, Any]) -> Any:
    if params is None:
        return model(**inputs)
    return torch.func.functional_call(model, params, (), inputs, tie_weights=True, strict=False)


def _inputs(model: Any, ids: torch.Tensor, start: int, cache: Any = None) -> dict[str, Any]:
    """Model inputs for ``ids [1, q]`` at positions ``start ..`` after ``start`` cached tokens."""
    q = ids.shape[1]
    attn = torch.ones((1, start + q), dtype=torch.long, device=ids.device)
    impl = str(model.config._attn_implementation)
    dtype = model.get_input_embeddings().weight.dtype
    out: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": attention_mask_4d(attn, q, dtype, impl),
        "position_ids": torch.arange(start, start + q, device=ids.device)[None],
    }
    if cache is not None:
        out.update(past_key_values=cache, use_cache=True)
    else:  # the trainer's full-sequence forward keeps no cache either
        out["use_cache"] = False
    return out


@torch.no_grad()
def trace_generation(model: Any, prompt: torch.Tensor, response: torch.Tensor, cache: Any = None) -> Trace:
    """Module outputs at the query that predicts ``response[-1]``, computed as the generator does:
    ``prompt [P]`` in one prefill, then ``response[:-1]`` one decode step at a time, over ``cache``
    (default: a BF16 ``DynamicCache``; an FP8 one calibrates its scales on this prefill alone)."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt, response]).to(device)[None]  # [1, P + L]
    p, length = prompt.shape[0], response.shape[0]
    cache = DynamicCache() if cache is None else cache
    trace: Trace = {}
    if length == 1:
        with _recording(model, p - 1, trace):
            model(**_inputs(model, ids[:, :p], 0, cache))
        return trace
    model(**_inputs(model, ids[:, :p], 0, cache))
    for t in range(p, p + length - 1):
        if t == p + length - 2:
            with _recording(model, 0, trace):
                model(**_inputs(model, ids[:, t : t + 1], t, cache))
        else:
            model(**_inputs(model, ids[:, t : t + 1], t, cache))
    return trace


@torch.no_grad()
def trace_forward(
    model: Any, prompt: torch.Tensor, response: torch.Tensor, params: dict[str, torch.Tensor] | None = None
) -> Trace:
    """Module outputs at the query that predicts ``response[-1]``, computed as the trainer does: one
    forward over ``prompt + response`` (``params``: the trainer's compute-dtype parameters)."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt, response]).to(device)[None]  # [1, P + L]
    trace: Trace = {}
    with _recording(model, ids.shape[1] - 2, trace):
        _call(model, params, _inputs(model, ids, 0))
    return trace


def compare_traces(generator: Trace, trainer: Trace) -> list[LayerDiff]:
    """Every module both traces hold, in the generator's execution order."""
    out = []
    for name, a in generator.items():
        b = trainer.get(name)
        if b is None:
            continue
        if a.shape != b.shape:
            out.append(LayerDiff(name, float("inf"), False))
            continue
        out.append(LayerDiff(name, float((a - b).abs().max()), torch.equal(a, b)))
    return out


_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")  # a Hugging Face decoder layer's module name
_EMBEDDING = re.compile(r"(?:^|\.)embed_tokens$")


def relative_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (L2, float64): how far the generator's hidden state ``a`` is from the
    trainer's ``b``; 0 when both are zero."""
    a64, b64 = a.double(), b.double()
    norm = float(b64.norm())
    diff = float((a64 - b64).norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def layer_contributions(generator: Trace, trainer: Trace) -> list[float]:
    """Each decoder layer's contribution to the divergence of the two engines' hidden states at the
    traced token: ``r_i - r_(i-1)``, where ``r_i`` is the relative divergence
    (:func:`relative_divergence`) of decoder layer ``i``'s output (the residual stream after it)
    and ``r_(-1)`` that of the embeddings. The contributions add up to the last layer's divergence
    less the embeddings'; a layer that brings the two closer has a negative one. Index ``i`` is the
    layer; layers either trace lacks are left out of the count (an empty list: no decoder layer)."""
    layers: dict[int, float] = {}
    start = 0.0
    for name, a in generator.items():
        b = trainer.get(name)
        if b is None or a.shape != b.shape:
            continue
        if found := _DECODER_LAYER.search(name):
            layers[int(found.group(1))] = relative_divergence(a, b)
        elif _EMBEDDING.search(name):
            start = relative_divergence(a, b)
    out, before = [], start
    for i in range(len(layers)):
        if i not in layers:
            break
        out.append(layers[i] - before)
        before = layers[i]
    return out


def first_divergence(diffs: list[LayerDiff]) -> LayerDiff | None:
    """The first module whose outputs differ (None: every module agrees)."""
    return next((d for d in diffs if not d.equal), None)


def describe(diffs: list[LayerDiff]) -> str:
    """One line naming the first differing module, or saying that none differs."""
    first = first_divergence(diffs)
    if first is None:
        return (
            "every module's output agrees bit for bit on this token traced alone "
            "(the difference needs its batch)"
        )
    return f"first differing module: {first.name} (max |diff| {first.max_abs_diff:.3g})"

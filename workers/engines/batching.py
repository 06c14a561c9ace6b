"""Padding, splitting and joining of :class:`~workers.engines.protocols.Rollouts` batches: the
layout helpers every engine and the driver share (prompts left-padded, responses right-padded,
position ids counting real tokens only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engines.protocols import Rollouts

StopIds = int | Sequence[int]


def stop_ids(eos: StopIds) -> tuple[int, ...]:
    """Every id that ends a response, from one id or several (a chat model's end of turn and its
    generation config's EOS ids: :attr:`workers.models.tokenizer.Tokenizer.eos_ids`)."""
    ids = (eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)
    if not ids:
        raise ValueError("at least one end-of-sequence id is needed: generation could never stop")
    return ids


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and mask, each prompt right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only valid tokens: ``[B, T]`` from a ``[B, T]`` mask."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def concat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """Rollouts of several generators as one batch, re-padded to common widths."""
    if len(parts) == 1:
        return parts[0]
    p = max(r.prompt_ids.shape[1] for r in parts)
    length = max(r.response_ids.shape[1] for r in parts)

    def pad(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Rollouts(
        prompt_ids=torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),
        prompt_mask=torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),
        response_ids=torch.cat([pad(r.response_ids, length, pad_id, False) for r in parts]),
        response_mask=torch.cat([pad(r.response_mask, length, 0.0, False) for r in parts]),
        logprobs=torch.cat([pad(r.logprobs, length, 0.0, False) for r in parts]),
    )


def split_rows(batch: Rollouts, sizes: list[int]) -> list[Rollouts]:
    """Consecutive row slices of ``batch`` of the given sizes."""
    out, start = [], 0
    for n in sizes:
        out.append(Rollouts(*(t[start : start + n] for t in batch)))
        start += n
    return out


def even_split(n_groups: int, group_size: int, parts: int) -> list[int]:
    """Rows per worker when ``n_groups`` groups are shared by ``parts`` workers (groups never split)."""
    base, extra = divmod(n_groups, parts)
    return [(base + (1 if i < extra else 0)) * group_size for i in range(parts)]


def spaced_rows(batch: Rollouts, count: int) -> Rollouts:
    """At most ``count`` rows of a host batch, evenly spaced over it (row ``i * B // count``, so
    every prompt group of a step is represented, not only the first ones); the whole batch when
    ``count`` is 0 or at least its ``B`` rows."""
    n = batch.prompt_ids.shape[0]
    if count <= 0 or count >= n:
        return batch
    index = torch.tensor([i * n // count for i in range(count)], dtype=torch.long)
    return Rollouts(*(t.index_select(0, index.to(t.device)) for t in batch))

"""Plain ``transformers`` baselines for ``fp8rl bench step --model smollm2``: what a user would write
without fp8rl, on the same model, batch and threads, against which the native engines' speed is
read as a ratio measured in the same run.

- training: the model in float32 (transformers' default dtype), one no-grad forward for the
  "old" log-probs, then a forward and backward of the token-mean log-likelihood of the response
  (the log-prob pass plus forward + backward of an RL step; no optimizer step, which the native
  trainer's time includes);
- generation: ``model.generate`` in BF16 (the native generator's dtype) with the same prompts,
  sampling at temperature 1, top-p 1, the same stop ids and new-token budget.

Both keep only the logits the step needs (``logits_to_keep``), as the native engines do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.engines.batching import left_pad, positions
from workers.engines.protocols import Rollouts


def load(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


def train_pass(model: Any, batch: Rollouts) -> int:
    """The log-prob pass and one forward + backward on ``batch``; returns the response tokens."""
    ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=1)  # [B, P+L]
    attn = torch.cat([batch.prompt_mask, batch.response_mask.long()], dim=1)  # [B, P+L]
    length = batch.response_ids.shape[1]
    inputs = {"input_ids": ids, "attention_mask": attn, "position_ids": positions(attn)}
    mask = batch.response_mask  # [B, L]

    def logp() -> torch.Tensor:
        logits = model(**inputs, logits_to_keep=length + 1).logits[:, :-1]  # [B, L, V]
        return torch.log_softmax(logits.float(), -1).gather(-1, batch.response_ids[..., None])[..., 0]

    with torch.no_grad():
        logp()
    loss = -(logp() * mask).sum() / mask.sum().clamp(min=1.0)
    torch.autograd.backward(loss)
    model.zero_grad(set_to_none=True)
    return int(mask.sum())


@torch.no_grad()
def generate(
    model: Any, prompts: list[list[int]], new_tokens: int, eos: tuple[int, ...], pad: int, seed: int
) -> int:
    """``model.generate`` on left-padded ``prompts``; returns the response tokens (up to and with
    each row's first stop id, as the native generator counts them)."""
    ids, mask = left_pad(prompts, pad)  # [B, P]
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        eos_token_id=list(eos),
        pad_token_id=pad,
    )
    response = out[:, ids.shape[1] :]  # [B, <= new_tokens]
    stopped = torch.isin(response, torch.tensor(eos)).long()  # [B, L]
    before = stopped.cumsum(1) - stopped  # stops strictly before each position
    return int((before == 0).sum())

"""A ``model`` grader's model at work: texts in, one score (or None) each, a batch at a time.

- ``reward_model``: a Hugging Face sequence-classification model; a text's score is
  sigmoid(logit) with one label, or the second label's probability (softmax) with two.
- ``judge``: a causal LM asked each prompt (through its chat template when it has one), answering
  greedily in at most ``max_new_tokens``; the score is the first number of its answer mapped from
  [score_min, score_max] to [0, 1] (clipped), None when the answer holds no number.

Where it runs is the caller's choice: in the driver's process (tests, ``fp8rl grade``), or on a
Ray actor of its own in a job (``workers.job.ray_workers.ModelGraderWorker``, started by
``workers.job.grader_actors.model_scorer``), so that the model's memory and CPU time are not the
driver's.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from rljob.graders import ModelGrader

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number in ``text`` ("8/10" -> 8.0, "Score: -1.5" -> -1.5); None without one."""
    found = _NUMBER.search(text)
    return float(found.group(0)) if found else None


class ModelScorer:
    """The model of one ``model`` grader, loaded once (``device``: cpu or cuda)."""

    def __init__(self, grader: ModelGrader, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        self.grader, self.device = grader, device
        self.tok = AutoTokenizer.from_pretrained(grader.model)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        cls: Any = (
            AutoModelForSequenceClassification if grader.kind == "reward_model" else AutoModelForCausalLM
        )
        self.model = cls.from_pretrained(grader.model, dtype=torch.float32).to(device).eval()
        if grader.kind == "reward_model" and self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tok.pad_token_id

    def score(self, texts: list[str]) -> list[float | None]:
        """One score per text (module docstring), ``batch_size`` texts a forward pass."""
        out: list[float | None] = []
        size = self.grader.batch_size
        for start in range(0, len(texts), size):
            batch = texts[start : start + size]
            out += self._rewards(batch) if self.grader.kind == "reward_model" else self._judged(batch)
        return out

    @torch.no_grad()
    def _rewards(self, texts: list[str]) -> list[float | None]:
        self.tok.padding_side = "right"
        enc = self.tok(texts, return_tensors="pt", padding=True, truncation=True).to(self.device)
        logits = self.model(**enc).logits.float()  # [B, labels]
        one_label = logits.shape[-1] == 1
        probs = torch.sigmoid(logits[:, 0]) if one_label else torch.softmax(logits, dim=-1)[:, 1]  # [B]
        return [float(p) for p in probs.cpu()]

    @torch.no_grad()
    def _judged(self, prompts: list[str]) -> list[float | None]:
        g = self.grader
        if getattr(self.tok, "chat_template", None):
            chat = [[{"role": "user", "content": p}] for p in prompts]
            prompts = [
                str(self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in chat
            ]
        self.tok.padding_side = "left"  # the answers continue every prompt from the same column
        enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        ids = self.model.generate(
            **enc, max_new_tokens=g.max_new_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id
        )  # [B, prompt + new]
        answers = self.tok.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out: list[float | None] = []
        for answer in answers:
            value = first_number(answer)
            if value is None or not math.isfinite(value):
                out.append(None)
            else:
                out.append(min(1.0, max(0.0, (value - g.score_min) / (g.score_max - g.score_min))))
        return out

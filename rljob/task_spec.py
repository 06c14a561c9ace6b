"""The job spec's ``task``: where the problems come from, how a prompt is written (a template, or
the tokenizer's chat template) and how a response's answer is read and rewarded.

Re-exported by :mod:`rljob.spec` (``from rljob.spec import TaskSpec`` keeps working); the check
that needs the tokenizer's section (a chat template needs a Hugging Face tokenizer) is in
:class:`rljob.spec.JobSpec`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rljob.spec_base import MAX_SEED, StrictModel
from rljob.task_params import params_problems

AnswerFormat = Literal["auto", "last-number", "first-line", "answer-tag", "boxed"]


class TaskSpec(StrictModel):
    """Prompts and rewards: a reasoning-gym generator, or a JSONL file of {question, answer}."""

    reasoning_gym: str | None = Field(
        "basic_arithmetic",
        description="reasoning-gym dataset name (e.g. basic_arithmetic, chain_sum). The task has one "
        "source: this, or `dataset` (which replaces this default; setting both is an error).",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the reasoning-gym generator: its config's fields, except size "
        "and seed (task.size, task.seed) and any that names a file; numbers finite and at most 10x the "
        "field's default (at least 100) in magnitude, strings of at most 256 characters that are not "
        "paths (docs/job-spec.md: task.params).",
        max_length=256,
    )
    dataset: str | None = Field(
        None,
        description="JSONL file, one {question, answer} per line; replaces reasoning_gym (set only one "
        "of the two).",
    )

    @property
    def generator(self) -> str | None:
        """The reasoning-gym generator in use (None when a dataset file is used: the validator
        clears ``reasoning_gym`` then)."""
        return self.reasoning_gym

    size: int = Field(10_000, ge=1, le=10_000_000, description="Number of distinct problems generated.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the problem generator.")
    prompt_template: str = Field(
        "{question}\nAnswer: ", description="Prompt text; `{question}` is replaced by the problem."
    )
    chat_template: bool = Field(
        False,
        description="Format each prompt with the tokenizer's chat template: the rendered `prompt_template` "
        "becomes the user message, followed by the template's generation prompt (the assistant's turn). "
        "Needs tokenizer.kind huggingface and a tokenizer that has a chat template; false: the rendered "
        "`prompt_template` is the whole prompt.",
    )
    system_prompt: str | None = Field(
        None,
        description="With `chat_template`: a system message before the user message. Unset: none, or the "
        "template's own default if it writes one (SmolLM2's does).",
    )
    answer_format: AnswerFormat = Field(
        "auto",
        description="How the answer is read out of a response: `last-number` (the last number, e.g. 71 in "
        "'23 + 48 = 71.'), `first-line` (the first non-blank line), `answer-tag` (the text inside the last "
        "<answer>...</answer>), `boxed` (the content of the last \\boxed{...}); `auto`: last-number when "
        "the problem's reference answer is a number, first-line otherwise (docs/job-spec.md: answers).",
    )
    format_reward: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Added to the reward of a response whose answer could be read in `answer_format` "
        "(the tag or box is there; a number is there): reward = correctness + format_reward x readable, "
        "in [0, 1 + format_reward].",
    )

    @model_validator(mode="after")
    def _one_source(self) -> TaskSpec:
        if (
            self.dataset is not None
            and self.reasoning_gym is not None
            and "reasoning_gym" in self.model_fields_set
        ):
            raise ValueError("set only one of task.reasoning_gym and task.dataset")
        if self.dataset is not None:
            # the generator's default gives way to the dataset, in the object as in its dump, so
            # a stored spec (model_dump) validates again (it would set both explicitly)
            self.__dict__["reasoning_gym"] = None
        if self.reasoning_gym is None and self.dataset is None:
            raise ValueError("set task.reasoning_gym (a generator name) or task.dataset (a JSONL path)")
        refused = params_problems(self.reasoning_gym, self.params)
        if refused:
            raise ValueError("; ".join(f"{field}: {message}" for field, message in refused))
        if "{question}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain {question}")
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError(
                "task.system_prompt is a chat message, but task.chat_template is false; set "
                "task.chat_template: true, or remove task.system_prompt (and write any instructions "
                "into task.prompt_template)"
            )
        return self

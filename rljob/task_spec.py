"""The job spec's ``task``: where the problems come from, how a prompt is written (a template, or
the tokenizer's chat template) and how a response's answer is read and rewarded.

Re-exported by :mod:`rljob.spec` (``from rljob.spec import TaskSpec`` keeps working); the check
that needs the tokenizer's section (a chat template needs a Hugging Face tokenizer) is in
:class:`rljob.spec.JobSpec`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rljob.graders import MAX_GRADERS, AnswerFormat, AnswerGrader, GraderKind, grader_name
from rljob.spec_base import MAX_SEED, StrictModel
from rljob.task_params import params_problems

__all__ = ["AnswerFormat", "TaskSpec"]


class TaskSpec(StrictModel):
    """Prompts and rewards: a reasoning-gym generator or a data file, and the graders."""

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
        max_length=4096,
        description="Data file: JSONL (.jsonl, one object a line), Parquet (.parquet) or a Hugging Face "
        "`datasets` directory saved to disk. Each row has `question` or chat `messages`, plus any fields "
        "the graders read (`answer` for the default grader). Replaces reasoning_gym (set only one).",
    )
    validation_dataset: str | None = Field(
        None,
        max_length=4096,
        description="With `dataset`: the held-out rows come from this file (same formats), not from the "
        "end of `dataset`; validation.size of them are used.",
    )
    grader: GraderKind | None = Field(
        None, description="The grader (docs/job-spec.md: Graders). Set this or graders, not both."
    )
    graders: list[GraderKind] | None = Field(
        None,
        max_length=MAX_GRADERS,
        description="Several graders: the reward is their weighted mean (each grader's `weight`). "
        "Default (neither set): one `answer` grader from answer_format and format_reward.",
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

    max_grader_error_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A grader that fails (raises, times out, returns no number) scores that response 0 "
        "and is counted; when it fails on more than this fraction of a step's responses, the job fails "
        "with its error.",
    )

    def grader_list(self) -> list[Any]:
        """The graders that score this task: ``grader``, ``graders``, or the default ``answer``
        grader made of ``answer_format`` and ``format_reward``."""
        if self.grader is not None:
            return [self.grader]
        if self.graders is not None:
            return list(self.graders)
        return [AnswerGrader(answer_format=self.answer_format, format_reward=self.format_reward)]

    @model_validator(mode="after")
    def _graders(self) -> TaskSpec:
        if self.grader is not None and self.graders is not None:
            raise ValueError("set task.grader (one) or task.graders (a list), not both")
        if self.grader is None and self.graders is None:
            return self
        # only a value other than the default: a stored spec (model_dump) names both, at their defaults
        moved = [
            f
            for f in ("answer_format", "format_reward")
            if getattr(self, f) != type(self).model_fields[f].default
        ]
        if moved:
            raise ValueError(
                f"task.{' and task.'.join(moved)}: the default grader's settings; with task.grader(s), "
                "set them on an `answer` grader instead ({type: answer, answer_format: ...})"
            )
        names = [grader_name(g) for g in self.grader_list()]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"task.graders: two graders named {', '.join(repeated)}; give each a distinct name"
            )
        if not self.graders and self.graders is not None:
            raise ValueError("task.graders is empty: list at least one grader, or remove it")
        return self

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
        if self.validation_dataset is not None and self.dataset is None:
            raise ValueError("task.validation_dataset needs task.dataset (the training rows)")
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

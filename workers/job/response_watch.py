"""The job log's warnings about its responses: a step whose responses are mostly truncated (they hit
``rollout.max_new_tokens``) or unreadable (no answer in ``task.answer_format``), in training or
on the held-out problems, is said once per run, with what to change; such a step's reward
measures the length limit or the answer format more than the task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljob import metrics as m
from rljob.spec import JobSpec

RESPONSE_WARNING_FRACTION = 0.5  # a truncated or unreadable fraction above it is said in the log

# the fractions the log watches: key -> (which responses, what went wrong)
_WATCHED = {
    m.RESPONSE_TRUNCATED_FRACTION: ("training", "truncated"),
    m.RESPONSE_UNREADABLE_FRACTION: ("training", "unreadable"),
    m.VAL_TRUNCATED_FRACTION: ("held-out", "truncated"),
    m.VAL_UNREADABLE_FRACTION: ("held-out", "unreadable"),
}


def response_warnings(spec: JobSpec, row: Mapping[str, Any], warned: set[str]) -> list[str]:
    """The log's warnings for a metrics line: one for each of ``_WATCHED``'s fractions above
    :data:`RESPONSE_WARNING_FRACTION` that ``warned`` does not hold yet (its key is added, so a run
    says each once). Such a step's reward mostly measures the length limit or the answer format."""
    out = []
    for key, (which, problem) in _WATCHED.items():
        value = row.get(key)
        if value is None or value <= RESPONSE_WARNING_FRACTION or key in warned:
            continue
        warned.add(key)
        where = f"warning: step {row[m.STEP]}: {value:.0%} of the {which} responses"
        if problem == "truncated":
            out.append(
                f"{where} hit rollout.max_new_tokens ({spec.rollout.max_new_tokens}) without a stop id "
                f"({key} {value:.2f}) and are scored as cut off. Raise rollout.max_new_tokens, or check "
                "that the model can stop: the tokenizer's stop ids (its EOS and the eos_token_id of "
                "generation_config.json) and task.chat_template (a chat model ends its turn with a token "
                "of its own). Said once per run."
            )
        else:
            out.append(
                f"{where} gave no answer readable as task.answer_format {spec.task.answer_format} "
                f"({key} {value:.2f}) and score 0. Choose the task.answer_format that matches how the "
                "model answers (last-number, first-line, answer-tag, boxed), ask for that form in "
                "task.prompt_template or task.system_prompt, or raise rollout.max_new_tokens if the "
                "answers are cut off. Said once per run."
            )
    return out

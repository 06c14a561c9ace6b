"""The ``model`` grader on tiny Hugging Face models built here: a reward model's scores (worked by
hand where the model's last norm is zeroed: every logit 0, sigmoid 0.5; and for random weights
equal to the same model run on each text alone, unpadded), a judge's rating read from its answer
and mapped to [0, 1] (a judge whose last norm is zeroed answers its vocabulary's first token
forever: "7 7 7 ...", rated 7), a judge without a number counted as an error, and the grader on
its own Ray actor in a job (workers.job.grader_actors.model_scorer)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rljob.spec import TaskSpec
from workers.tasks.grading import Graders
from workers.tasks.model_scorer import first_number


def tokenizer(path: Path, first: str) -> None:
    """A word-level tokenizer whose id 0 is ``first`` (what a zeroed model always picks)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {first: 0}
    for word in ["[UNK]", "<pad>", "<|end|>", "7", "a", "b", "good", "bad", "x"]:
        vocab.setdefault(word, len(vocab))
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", eos_token="<|end|>", pad_token="<pad>"
    ).save_pretrained(path)


def model_dir(path: Path, kind: str, first: str = "7", labels: int = 1, zero_norm: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer(path, first)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=2, eos_token_id=3,
    )  # fmt: skip
    config.num_labels = labels  # a PretrainedConfig attribute (its typed __init__ does not name it)
    model: Any = (
        LlamaForSequenceClassification(config) if kind == "reward_model" else LlamaForCausalLM(config)
    )
    if zero_norm:
        with torch.no_grad():
            model.model.norm.weight.zero_()
    model.save_pretrained(path)
    return str(path)


class Row:
    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry, self.answer = entry, ""


def graders(grader: dict[str, Any]) -> Graders:
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": grader})
    return Graders(spec.grader_list(), lambda a, r: 0.0, max_error_fraction=1.0)


def test_first_number() -> None:
    assert [first_number(t) for t in ("8/10", "Score: -1.5 of 10", "none", "7 7 7")] == [8.0, -1.5, None, 7.0]


def test_a_reward_model_with_a_zeroed_norm_gives_one_half(tmp_path: Path) -> None:
    g = graders({"type": "model", "model": model_dir(tmp_path / "rm", "reward_model", zero_norm=True)})
    grades, _ = g.grade(["a b", "good", "bad bad x"], [Row({})] * 3)
    assert [x.reward for x in grades] == [0.5, 0.5, 0.5]  # sigmoid(0)


@pytest.mark.parametrize("labels", [1, 2])
def test_a_reward_model_scores_each_text_as_alone(tmp_path: Path, labels: int) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = model_dir(tmp_path / "rm", "reward_model", labels=labels)
    texts = ["a", "good good good b", "bad x", "7 a b a b"]  # of different lengths: padded together
    g = graders(
        {"type": "model", "model": path, "batch_size": 4, "input": "{{sample.output_text}} {{item.extra}}"}
    )
    grades, reports = g.grade(texts, [Row({"extra": "x"})] * 4)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path)
    expected = []
    for text in texts:  # one at a time, no padding: the reference
        logits = model(**tok(f"{text} x", return_tensors="pt")).logits[0].double()
        expected.append(float(torch.sigmoid(logits[0]) if labels == 1 else torch.softmax(logits, -1)[1]))
    assert [x.reward for x in grades] == pytest.approx(expected, abs=1e-5)
    assert reports["model"].errors == 0 and len(set(expected)) > 1  # the texts scored differently


def test_a_judge_is_read_and_mapped_to_0_1(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "judge", "judge", first="7", zero_norm=True)  # always answers "7"
    g = graders({"type": "model", "model": path, "kind": "judge", "prompt": "rate {{sample.output_text}}"})
    grades, _ = g.grade(["a", "b"], [Row({})] * 2)
    assert [x.reward for x in grades] == [0.7, 0.7]  # (7 - 0) / (10 - 0)
    g = graders({"type": "model", "model": path, "kind": "judge", "score_min": 5, "score_max": 9})
    grades, _ = g.grade(["a"], [Row({"question": "q"})])
    assert grades[0].reward == 0.5  # (7 - 5) / (9 - 5)


def test_a_judge_without_a_number_is_an_error(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "judge", "judge", first="good", zero_norm=True)  # answers "good good ..."
    g = graders({"type": "model", "model": path, "kind": "judge"})
    grades, reports = g.grade(["a", "b"], [Row({"question": "q"})] * 2)
    assert [x.reward for x in grades] == [0.0, 0.0] and reports["model"].errors == 2
    assert reports["model"].first_error == f"{path}: the judge's answer held no number"


@pytest.mark.slow  # a Ray cluster of one node: ~20 s
def test_the_model_grader_runs_on_a_ray_actor_of_its_own(tmp_path: Path) -> None:
    import ray

    from workers.job.grader_actors import model_scorer

    path = model_dir(tmp_path / "rm", "reward_model", zero_norm=True)
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": {"type": "model", "model": path}})
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        g = Graders(spec.grader_list(), lambda a, r: 0.0, scorer_factory=model_scorer)
        grades, _ = g.grade(["a", "b"], [Row({})] * 2)
        assert [x.reward for x in grades] == [0.5, 0.5]
        [scorer] = g._scorers.values()
        actor = scorer.actor  # type: ignore[attr-defined]
        assert ray.get(actor.score.remote(["a"])) == [0.5]  # the model lives on the actor
        g.close()  # and goes with the graders: ray.kill only asks Ray's control store, so a call
        # sent at once may still be answered; within 30 s one must fail as the actor's death
        deadline = time.monotonic() + 30.0
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.score.remote(["a"]), timeout=30.0)
                time.sleep(0.2)
    finally:
        ray.shutdown()

"""The job spec: defaults validate, every bad field is reported with its path and what is allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rljob import JobSpec, SpecError, load_spec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def problems(data: object) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(data, "test")
    return info.value.problems


def test_defaults_are_a_runnable_spec() -> None:
    spec = JobSpec()
    assert spec.precision.recipe == "fp8-e2e"
    assert spec.model.tiny is not None and spec.model.name is None
    assert spec.task.generator == "basic_arithmetic"


def test_unknown_field_is_reported_with_its_path() -> None:
    (p,) = problems({"rollout": {"tempreature": 0.7}})
    assert p.startswith("rollout.tempreature:") and "Extra inputs are not permitted" in p


def test_every_problem_is_listed_at_once() -> None:
    found = problems({"rollout": {"group_size": 0}, "precision": {"recipe": "fp9"}, "steps": -1})
    paths = sorted(p.split(":")[0] for p in found)
    assert paths == ["precision.recipe", "rollout.group_size", "steps"]
    recipe = next(p for p in found if p.startswith("precision.recipe"))
    assert "'bf16', 'fp8-gen' or 'fp8-e2e'" in recipe and "fp9" in recipe


@pytest.mark.parametrize(
    ("data", "path", "needle"),
    [
        (
            {"algorithm": {"importance_sampling": {"mode": "bogus"}}},
            "algorithm.importance_sampling.mode",
            "tis",
        ),
        (
            {"algorithm": {"importance_sampling": {"low": 3.0, "high": 2.0}}},
            "algorithm.importance_sampling",
            "low",
        ),
        ({"algorithm": {"loss_aggregation": "sum"}}, "algorithm.loss_aggregation", "token-mean"),
        ({"model": {"name": "x", "tiny": {}}}, "model", "exactly one"),
        ({"model": {"tiny": {"hidden_size": 100, "num_heads": 3}}}, "model.tiny", "multiple of num_heads"),
        (
            {"precision": {"keep_bf16_layers": [-1, 0]}},
            "precision.keep_bf16_layers.0",
            "greater than or equal to 0",
        ),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p", "less than or equal to 1"),
        ({"task": {"prompt_template": "no placeholder"}}, "task", "{question}"),
        ({"task": {"reasoning_gym": "chain_sum", "dataset": "a.jsonl"}}, "task", "only one"),
        ({"task": {"system_prompt": "Be brief."}}, "task", "task.system_prompt is a chat message"),
        (
            {"task": {"chat_template": True}},  # the default tokenizer: bytes
            "(spec)",
            "task.chat_template needs a Hugging Face tokenizer with a chat template, but tokenizer.kind",
        ),
        ({"task": {"answer_format": "json"}}, "task.answer_format", "'last-number'"),
        ({"task": {"format_reward": 1.5}}, "task.format_reward", "less than or equal to 1"),
        ({"task": {"format_reward": -0.1}}, "task.format_reward", "greater than or equal to 0"),
        ({"resources": {"engine": "vllm"}}, "resources", "split in two: set resources.generator_engine"),
        (
            {"resources": {"generator_engine": "vllm", "generator_tensor_parallel_size": 2}},
            "resources",
            "vllm on CPU (gpus_per_generator 0) runs one process per generator",
        ),
        (
            {"resources": {"generator_engine": "vllm", "gpus_per_generator": 2}},
            "resources",
            "generator_tensor_parallel_size (1) must equal gpus_per_generator (2)",
        ),
        ({"resources": {"generator_tensor_parallel_size": 2}}, "resources", "needs generator_engine vllm"),
        ({"resources": {"generator_engine": "sglang"}}, "resources.generator_engine", "'native' or 'vllm'"),
        (
            {"resources": {"trainer_engine": "megatron", "gpus_per_trainer": 2}},
            "resources",
            "set gpus_per_trainer 1 (got 2)",
        ),
        (
            {"resources": {"trainer_engine": "megatron"}, "precision": {"recipe": "fp8-e2e"}},
            "(spec)",
            "the megatron trainer on CPU (resources.gpus_per_trainer 0) runs BF16",
        ),
        (
            {
                "resources": {
                    "trainer_engine": "megatron",
                    "gpus_per_trainer": 1,
                    "trainers": 3,
                    "trainer_tensor_parallel_size": 2,
                }
            },
            "resources",
            "trainers (3) must be a multiple of",
        ),
        ({"resources": {"trainer_pipeline_parallel_size": 2}}, "resources", "need trainer_engine megatron"),
        (
            {
                "resources": {
                    "share_gpu": True,
                    "gpus_per_generator": 1,
                    "gpus_per_trainer": 1,
                    "generator_engine": "vllm",
                }
            },
            "resources",
            "share_gpu is for the native engines",
        ),
        (
            {
                "algorithm": {"kl": {"coef": 0.1}},
                "resources": {"trainer_engine": "megatron", "gpus_per_trainer": 1},
            },
            "(spec)",
            "needs a frozen reference model",
        ),
        (
            {
                "model": {"tiny": {"num_layers": 3}},
                "resources": {
                    "trainer_engine": "megatron",
                    "gpus_per_trainer": 1,
                    "trainers": 2,
                    "trainer_pipeline_parallel_size": 2,
                },
            },
            "(spec)",
            "num_layers (3) must be a multiple of resources.trainer_pipeline_parallel_size (2)",
        ),
        ({"validation": {"interval": -1}}, "validation.interval", "greater than or equal to 0"),
        ({"validation": {"size": 0}}, "validation.size", "greater than or equal to 1"),
        ({"validation": {"temperature": -0.5}}, "validation.temperature", "greater than or equal to 0"),
        ({"validation": {"temperature": 11}}, "validation.temperature", "less than or equal to 10"),
        ({"validation": {"intervall": 5}}, "validation.intervall", "Extra inputs are not permitted"),
        ({"rollout": {"max_staleness": -1}}, "rollout.max_staleness", "greater than or equal to 0"),
        (
            {"rollout": {"max_staleness": 1}, "precision": {"exact": True, "recipe": "bf16"}},
            "(spec)",
            "precision.exact is on-policy by definition, but rollout.max_staleness (1)",
        ),
    ],
)
def test_bad_field(data: dict[str, object], path: str, needle: str) -> None:
    found = problems(data)
    assert any(p.startswith(path + ":") and needle in p for p in found), found


def test_validation_is_off_by_default_and_greedy_when_on() -> None:
    v = JobSpec().validation
    assert (v.interval, v.size, v.temperature) == (0, 128, 0.0)
    on = parse_spec({"validation": {"interval": 5, "size": 16}}).validation
    assert (on.interval, on.size, on.temperature) == (5, 16, 0.0)
    # every field is described (the descriptions are the OpenAPI schema's and the CRD's)
    props = JobSpec.model_json_schema()["$defs"]["ValidationSpec"]["properties"]
    assert set(props) == {"interval", "size", "temperature", "pass_k", "pass_k_temperature"}
    assert (v.pass_k, v.pass_k_temperature) == (0, 1.0)  # pass@k off by default
    assert all(len(p.get("description", "")) > 20 for p in props.values()), props


def test_the_answer_and_chat_fields_default_to_plain_prompts_and_the_auto_format() -> None:
    task = JobSpec().task
    assert (task.chat_template, task.system_prompt, task.answer_format, task.format_reward) == (
        False,
        None,
        "auto",
        0.0,
    )
    chat = parse_spec(
        {
            "model": {"name": "/models/smol", "pretrained": False},
            "tokenizer": {"kind": "huggingface"},
            "task": {"chat_template": True, "system_prompt": "Be brief.", "answer_format": "boxed"},
        }
    ).task
    assert (chat.chat_template, chat.system_prompt, chat.answer_format) == (True, "Be brief.", "boxed")
    props = JobSpec.model_json_schema()["$defs"]["TaskSpec"]["properties"]
    for field in ("chat_template", "system_prompt", "answer_format", "format_reward"):
        assert len(props[field].get("description", "")) > 40, field


def test_dataset_replaces_the_default_generator() -> None:
    spec = parse_spec({"task": {"dataset": "problems.jsonl"}})
    assert spec.task.generator is None and spec.task.dataset == "problems.jsonl"


def test_not_a_mapping() -> None:
    assert problems([1, 2]) == ["(spec): expected a mapping of fields, got list"]


def test_load_yaml_json_and_rljob_manifest(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("steps: 3\nprecision:\n  recipe: bf16\n")
    (tmp_path / "b.json").write_text(json.dumps({"steps": 4}))
    (tmp_path / "c.yaml").write_text("kind: RLJob\nspec:\n  job:\n    steps: 5\n")
    assert load_spec(tmp_path / "a.yaml").precision.recipe == "bf16"
    assert load_spec(tmp_path / "b.json").steps == 4
    assert load_spec(tmp_path / "c.yaml").steps == 5


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "bad.yaml")


def test_examples_validate() -> None:
    # helm-values-*.yaml are chart values (tests/helm renders them), not job specs
    specs = [p for p in sorted(EXAMPLES.glob("*.yaml")) if not p.name.startswith("helm-values")]
    assert specs, "examples/ should hold job specs"
    for path in specs:
        load_spec(path)


def test_a_stored_spec_validates_again() -> None:
    """What the stores keep (model_dump) must load back to the same spec: a dataset task once
    dumped both the default generator and the dataset, which the next load refused."""
    for raw in ({"task": {"dataset": "/data/qa.jsonl"}}, {"task": {"reasoning_gym": "chain_sum"}}, {}):
        spec = JobSpec.model_validate(raw)
        again = JobSpec.model_validate(spec.model_dump(mode="json"))
        assert again == spec
        assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    spec = JobSpec.model_validate({"task": {"dataset": "/data/qa.jsonl"}})
    assert spec.task.reasoning_gym is None and spec.task.generator is None
    with pytest.raises(ValueError, match=r"set only one of task\.reasoning_gym and task\.dataset"):
        JobSpec.model_validate({"task": {"dataset": "/data/qa.jsonl", "reasoning_gym": "chain_sum"}})


@pytest.mark.parametrize(
    ("resources", "named", "fix"),
    [
        ({"gpus_per_generator": 2}, "gpus_per_generator (2) > 1 with generator_engine native", "vllm"),
        ({"gpus_per_trainer": 4}, "gpus_per_trainer (4) > 1 with trainer_engine native", "raise trainers"),
    ],
)
def test_more_than_one_gpu_per_native_actor_is_refused(
    resources: dict[str, int], named: str, fix: str
) -> None:
    """The pods would ask for N GPUs and the native actor use one of them (issue 42)."""
    (p,) = problems({"resources": resources})
    assert p.startswith("resources: ") and named in p and fix in p
    parse_spec({"resources": dict.fromkeys(resources, 1)})  # one GPU each: what the native actor uses


def test_both_native_actors_with_several_gpus_are_reported_at_once() -> None:
    (p,) = problems({"resources": {"gpus_per_generator": 3, "gpus_per_trainer": 3}})
    assert "gpus_per_generator (3) > 1" in p and "gpus_per_trainer (3) > 1" in p


def test_engines_and_parallel_sizes_that_fit() -> None:
    spec = parse_spec(
        {
            "resources": {
                "generator_engine": "vllm",
                "gpus_per_generator": 2,
                "generator_tensor_parallel_size": 2,
                "trainer_engine": "megatron",
                "gpus_per_trainer": 1,
                "trainers": 8,
                "trainer_tensor_parallel_size": 2,
                "trainer_pipeline_parallel_size": 2,
            }
        }
    )
    assert spec.resources.trainer_data_parallel_size == 2  # 8 GPUs / (TP 2 x PP 2)
    assert parse_spec({}).resources.trainer_data_parallel_size == 1

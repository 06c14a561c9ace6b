"""workers.rl.faults without a job: drills parsed (and refused with the field and the fix), the bound
on a call, what an actor's exception means, which actor a failed collective blames, and the
service's condition text from faults.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from rljob.metrics import FAULT_KEYS
from rljob.prometheus import ACTOR_RESTARTS
from rljob.spec import parse_spec
from service.local_runs import fault_condition
from tests import helpers
from workers.job.actor_group import classify
from workers.job.prom_exporter import PromExporter
from workers.rl.faults import (
    HANG_FACTOR,
    CallTimeouts,
    FaultDrill,
    InjectedFault,
    is_engine_failure,
    provoke,
)


def test_drills_parse_and_bad_ones_say_the_form() -> None:
    assert FaultDrill.parse("generator:kill@10") == FaultDrill("generator", 0, "kill", 10)
    assert FaultDrill.parse(" trainer1:hang@3 ") == FaultDrill("trainer", 1, "hang", 3)
    for bad, words in [
        ("generator:kill", "ROLE[INDEX]:KIND@STEP"),
        ("critic:kill@2", "ROLE[INDEX]:KIND@STEP"),
        ("generator:explode@2", "'explode' is not one of kill, raise, hang, engine"),
        ("trainer:engine@2", "a generator's"),
        ("generator:kill@0", "1 or more"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            FaultDrill.parse(bad)


def test_a_call_may_take_ten_times_its_kind_s_longest_recent_call_never_less_than_the_floor() -> None:
    t = CallTimeouts(floor_s=5.0, startup_s=100.0)
    assert t.bound("generate") == 100.0  # nothing seen yet: the startup bound
    t.record("generate", 0.2)
    assert t.bound("generate") == 5.0  # 10 x 0.2 = 2 s is under the floor
    t.record("generate", 1.5)
    assert t.bound("generate") == pytest.approx(15.0) == HANG_FACTOR * 1.5
    for _ in range(10):  # the 1.5 s call leaves the window of the last 10
        t.record("generate", 0.7)
    assert t.bound("generate") == pytest.approx(7.0)
    assert t.bound("train_step") == 100.0  # kinds are apart
    assert CallTimeouts(floor_s=50.0, startup_s=10.0).bound("setup") == 50.0  # the floor holds


def _task_error(cause: Exception) -> RayTaskError:
    return RayTaskError("generate", "traceback", cause)


def test_engine_failures_are_faults_and_other_exceptions_are_not() -> None:
    assert is_engine_failure(InjectedFault("x"))
    assert is_engine_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_engine_failure(_task_error(RuntimeError("NCCL error: unhandled system error")))
    dead = type("EngineDeadError", (Exception,), {})  # vLLM's, by name (vLLM may not be installed)
    assert is_engine_failure(_task_error(dead("EngineCore encountered an issue")))
    assert not is_engine_failure(_task_error(ValueError("prompt too long for max_model_len")))
    assert not is_engine_failure(FloatingPointError("non-finite loss"))


def test_a_dead_actor_is_blamed_before_a_partner_whose_collective_failed() -> None:
    """A generator dies during the weight sync: trainer 0's broadcast fails too (gloo's error),
    but the fault is the generator's."""
    calls: list[Any] = [("trainer", 0, None), ("generator", 0, None), ("generator", 1, None)]
    errors: dict[int, Exception] = {
        0: _task_error(RuntimeError("[gloo] Connection reset by peer")),
        2: ActorDiedError(),
    }
    fault = classify("weight_sync", calls, errors)
    assert fault is not None and (fault.role, fault.index, fault.call) == ("generator", 1, "weight_sync")
    assert "died" in fault.what
    # a trainer's death outranks a generator's; a plain bug is no fault at all
    both: dict[int, Exception] = {0: ActorDiedError(), 2: ActorDiedError()}
    assert (f := classify("weight_sync", calls, both)) is not None and f.role == "trainer"
    assert classify("generate", calls, {1: _task_error(KeyError("bug"))}) is None
    engine = classify("generate", calls, {1: _task_error(InjectedFault("gone"))})
    assert engine is not None and engine.index == 0 and "InjectedFault: gone" in engine.what


def test_provoke_raises_and_an_engine_drill_without_an_engine_core_says_so() -> None:
    with pytest.raises(InjectedFault, match="fault drill"):
        provoke("raise")
    with pytest.raises(InjectedFault, match="no engine core process"):
        provoke("engine", object())


def test_the_restart_bounds_and_hang_floors_are_spec_fields_with_limits() -> None:
    spec = parse_spec(helpers.tiny_spec())
    assert spec.resources.max_generator_restarts == 3 and spec.resources.max_trainer_restarts == 2
    with pytest.raises(Exception, match=r"resources\.hang_timeout_s"):
        parse_spec(helpers.tiny_spec(resources={"hang_timeout_s": 0}))


def test_restarts_are_one_prometheus_counter_with_a_role_label_exported_from_zero() -> None:
    from prometheus_client import generate_latest

    prom = PromExporter("j", "ns", "bf16")
    prom.observe({"step": 1, **dict.fromkeys(FAULT_KEYS, 0.0)})
    text = generate_latest(prom.registry).decode()
    assert f'{ACTOR_RESTARTS.name}{{job="j",namespace="ns",recipe="bf16",role="generator"}} 0.0' in text
    prom.observe({"step": 2, "faults/generator_restarts": 1.0, "faults/trainer_restarts": 0.0})
    prom.observe({"step": 3, "faults/generator_restarts": 1.0, "faults/trainer_restarts": 1.0})
    text = generate_latest(prom.registry).decode()
    assert f'{ACTOR_RESTARTS.name}{{job="j",namespace="ns",recipe="bf16",role="generator"}} 2.0' in text
    assert f'{ACTOR_RESTARTS.name}{{job="j",namespace="ns",recipe="bf16",role="trainer"}} 1.0' in text


def test_the_service_condition_names_the_last_fault_and_the_restarts_so_far(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    assert fault_condition(path) is None
    entries = [
        {"step": 16, "role": "generator", "index": 0, "what": "died (process 7 exited: killed, out of memory "
         "or crashed)", "call": "generate", "action": "replaced; step 16 generated again", "seconds": 3.25},
        {"step": 21, "role": "trainer", "index": 1, "what": "gave no answer within 600 s (hung)",
         "call": "train_step", "seconds": 12.0,
         "action": "replaced; back to the checkpoint of step 20, 0 step(s) computed again"},
    ]  # fmt: skip
    path.write_text(json.dumps(entries[0]) + "\n")
    reason, message = fault_condition(path) or ("", "")
    assert reason == "GeneratorRestarted"
    assert message == (
        "generator 0 died (process 7 exited: killed, out of memory or crashed) during generate in step 16: "
        "replaced; step 16 generated again (3.2 s); restarts so far: 1 generator, 0 trainer"
    )
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    reason, message = fault_condition(path) or ("", "")
    assert reason == "TrainerRestarted"
    assert message.startswith("trainer 1 gave no answer within 600 s (hung) during train_step in step 21")
    assert message.endswith("restarts so far: 1 generator, 1 trainer")

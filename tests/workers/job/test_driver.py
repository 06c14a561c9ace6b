"""The job driver on real local Ray: every recipe runs end to end on a tiny model, metrics are
complete and served to Prometheus, a stop checkpoints, and a resumed run repeats no step and loses
none."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rljob import JobSpec, parse_spec
from rljob.metrics import REQUIRED_KEYS, MetricsLog
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS
from workers.job.driver import RunOptions, run
from workers.models import checkpoint


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def ray_for_the_slow_tests(request: pytest.FixtureRequest) -> None:
    """Ray for the module's slow tests only: its unit-tier tests never reach it, and starting it
    (6.8 s on CI's machine) counted against the first one's 10 s (docs/development.md#tests)."""
    if request.node.get_closest_marker("slow"):
        request.getfixturevalue("ray_cluster")


def tiny_spec(recipe: str, steps: int = 2, **extra: Any) -> JobSpec:
    """The shared tiny job with a one-step warm-up, 3-token responses and a checkpoint every 2 steps."""
    sections: dict[str, Any] = {
        "task": {"params": ONE_DIGIT_SUMS, "size": 50},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
        "warmup": {"sft_steps": 1, "batch_size": 4},
        "precision": {"recipe": recipe, "fp8_kv_cache": recipe != "bf16"},
        "steps": steps,
        "checkpoint_interval": 2,
    }
    return parse_spec(helpers.tiny_spec(**{**sections, **extra}))


class _MallocProbe:
    """Inside an actor: its ``GLIBC_TUNABLES`` and whether a 100 MiB ``malloc`` grew the heap
    (glibc without mmap for large blocks) or was mapped on its own (glibc's default)."""

    def probe(self) -> tuple[str | None, bool]:
        import ctypes
        import os

        def heap_mib() -> int:
            for line in Path("/proc/self/maps").read_text().splitlines():
                if line.endswith("[heap]"):
                    start, end = line.split()[0].split("-")
                    return (int(end, 16) - int(start, 16)) >> 20
            return 0

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        before = heap_mib()
        block = libc.malloc(100 << 20)
        grew = heap_mib() - before >= 100
        libc.free(ctypes.c_void_p(block))
        return os.environ.get("GLIBC_TUNABLES"), grew


@pytest.mark.slow  # Ray starts an actor process for a runtime_env: 10 s and more (tests/conftest.py)
def test_a_cpu_actor_runs_with_the_malloc_tunables_in_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set through Ray's runtime_env, the variable is there when the actor's process starts (glibc
    reads it only then): a large block comes from the heap, where a plain actor maps it apart."""
    from workers.job.ray_cluster import CPU_MALLOC_TUNABLES, actor_options

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("FP8RL_CPU_MALLOC", raising=False)
    tuned: Any = ray.remote(**actor_options(tiny_spec("bf16"), "training"))(_MallocProbe).remote()
    plain: Any = ray.remote(num_cpus=0)(_MallocProbe).remote()
    assert tuple(ray.get(tuned.probe.remote(), timeout=120)) == (CPU_MALLOC_TUNABLES, True)
    assert tuple(ray.get(plain.probe.remote(), timeout=120)) == (None, False)
    for actor in (tuned, plain):
        ray.kill(actor)


def run_until_a_crash(spec: JobSpec, out: Path, step: int) -> list[Mapping[str, Any]]:
    """Run ``spec`` until the line of ``step`` is written, then crash (as a worker dying there
    would); the lines seen before the crash."""
    seen: list[Mapping[str, Any]] = []

    def crash(row: Mapping[str, Any]) -> None:
        seen.append(row)
        if row["step"] == step:
            raise RuntimeError("simulated worker crash")

    with pytest.raises(RuntimeError, match="simulated"):
        run(spec, out, RunOptions(on_step=crash))
    return seen


@pytest.mark.slow  # Ray and a driver: 5 s and more on 2 idle cores (tests/conftest.py: tiers)
@pytest.mark.parametrize("recipe", ["bf16", "fp8-gen", "fp8-e2e"])
def test_each_recipe_runs_end_to_end(recipe: str, tmp_path: Path) -> None:
    scraped: list[str] = []
    port: list[int] = []

    def scrape(row: Mapping[str, Any]) -> None:
        if port:
            with urllib.request.urlopen(f"http://127.0.0.1:{port[0]}/metrics", timeout=10) as r:
                scraped.append(r.read().decode())

    opts = RunOptions(metrics_port=0, job="t", on_step=scrape, log=lambda m: port.extend(
        [int(m.rsplit(":", 1)[1].split("/")[0])] if "Prometheus" in m else []))  # fmt: skip
    result = run(tiny_spec(recipe), tmp_path / recipe, opts)

    rows = MetricsLog(tmp_path / recipe / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2] and result.last_step == 2 and not result.stopped
    for row in rows:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        assert not missing, missing
        assert 0.0 <= row["reward/mean"] <= 1.0
        # the native pair on the CPU: bf16 and fp8-e2e compute what the generator computed (the
        # trainer reads K/V as fp8-e2e's FP8 cache holds them), fp8-gen samples with FP8 weights
        # against a BF16 trainer (docs/precision.md)
        tmpe = row["mismatch/token_mult_prob_error"]
        assert tmpe == 1.0 if recipe != "fp8-gen" else 1.0 < tmpe < 2.0, tmpe
        assert row["weight_sync/bytes"] > 0 and row["throughput/generation_tokens_per_s"] > 0
    audit = json.loads((tmp_path / recipe / "quantization_audit.json").read_text())
    fp8_gen = audit["generator"]["summary"]["fp8_layers"]
    fp8_train = audit["trainer"]["summary"]["fp8_layers"]
    # one layer x (q, k, v, o, gate, up, down) = 7 linears; dims 32/64 are multiples of 16
    assert (fp8_gen, fp8_train) == {"bf16": (0, 0), "fp8-gen": (7, 0), "fp8-e2e": (7, 7)}[recipe]
    spec_back = json.loads((tmp_path / recipe / "spec.resolved.json").read_text())
    assert spec_back["precision"]["recipe"] == recipe
    numerics = json.loads((tmp_path / recipe / "numerics.json").read_text())
    assert numerics["torch"] == torch.__version__ and numerics["cpu_bf16_gemm"] in ("native", "float32")
    assert set(numerics["switches"]) >= {"FP8RL_CPU_BF16_GEMM", "FP8RL_TRITON", "FP8RL_CUBLAS_BLOCKWISE"}
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / recipe)] == [0, 2]
    # Prometheus, scraped over HTTP while the run was live
    assert scraped, "the metrics endpoint was never reached"
    text = scraped[-1]
    label = f'job="t",namespace="default",recipe="{recipe}"'
    assert f"fp8rl_token_mult_prob_error{{{label}}}" in text
    assert (
        f'fp8rl_step_duration_seconds{{job="t",namespace="default",phase="generation",recipe="{recipe}"}}'
        in text
    )
    generated = rows[0]["tokens/generated"] + rows[1]["tokens/generated"]
    assert f"fp8rl_generation_tokens_total{{{label}}} {generated}" in text
    # every recipe's tiny run is within its default mismatch SLO (bf16 and fp8-e2e at exactly 1.0;
    # fp8-gen below its 1.25 median)
    assert f"fp8rl_mismatch_slo_breached{{{label}}} 0.0" in text
    assert all(row["mismatch_slo/breached"] == 0.0 for row in rows)


@pytest.mark.slow
def test_the_mismatch_slo_follows_its_window_across_a_resume(tmp_path: Path) -> None:
    """fp8-gen's mismatch is above 1.0 on every step, so an SLO of median 1.0 with no step allowed
    above 1.0 breaches from step 1; each step's median is the median of the last three steps'
    token_mult_prob_error as the rows hold them (the window reaches back across the stop and
    resume), and the breach is logged once per driver."""
    slo = {"median": 1.0, "tail_bound": 1.0, "tail_fraction": 0.0, "window": 3}
    spec = tiny_spec("fp8-gen", steps=4, precision={"recipe": "fp8-gen", "mismatch_slo": slo})
    stop, said = threading.Event(), list[str]()

    def stop_at_2(row: Mapping[str, Any]) -> None:
        if row["step"] == 2:
            stop.set()

    run(spec, tmp_path, RunOptions(stop=stop, on_step=stop_at_2, log=said.append))
    run(spec, tmp_path, RunOptions(resume=True, log=said.append))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    values = [r["mismatch/token_mult_prob_error"] for r in rows]
    assert all(v > 1.0 for v in values)
    for i, row in enumerate(rows):
        window = sorted(values[max(0, i - 2) : i + 1])
        assert (
            row["mismatch_slo/median"] == window[len(window) // 2]
            if len(window) % 2
            else ((window[0] + window[1]) / 2)
        )
        assert row["mismatch_slo/tail_steps"] == len(window)
        assert (row["mismatch_slo/breached"], row["mismatch_slo/median_bound"]) == (1.0, 1.0)
    breaches = [line for line in said if "mismatch SLO breached" in line]
    assert [line.split(":")[0] for line in breaches] == ["step 1", "step 3"]  # once per driver


@pytest.mark.slow
def test_the_per_layer_attribution_runs_on_its_interval_and_at_the_breach(tmp_path: Path) -> None:
    """fp8-gen breaks an SLO of median 1.0 at step 1: the attribution runs then (the breach) and at
    step 2 (its interval), not at step 3; each time it writes a line to mismatch_layers.jsonl, the
    step's ``mismatch/layer/<i>`` keys (one per decoder layer of the tiny model) and the labelled
    gauge, and the breach names the layers in the log once."""
    slo = {"median": 1.0, "tail_bound": 1.0, "tail_fraction": 0.0, "window": 3, "attribution_interval": 2}
    spec = tiny_spec("fp8-gen", steps=3, precision={"recipe": "fp8-gen", "mismatch_slo": slo})
    said: list[str] = []
    result = run(spec, tmp_path, RunOptions(log=said.append))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    lines = [json.loads(x) for x in (tmp_path / "mismatch_layers.jsonl").read_text().splitlines()]
    assert [(x["step"], x["breached"]) for x in lines] == [(1, True), (2, False)]
    layers = spec.model.tiny.num_layers if spec.model.tiny else 0
    for line in lines:
        row = rows[line["step"] - 1]
        assert [row[f"mismatch/layer/{i}"] for i in range(layers)] == line["layers"]
        assert len(line["tokens_logprob_diff"]) == spec.precision.mismatch_slo.attribution_sequences
    assert not any(k.startswith("mismatch/layer/") for k in rows[2])
    named = [x for x in said if "add most to the mismatch" in x]
    assert len(named) == 1 and named[0].startswith("step 1:"), said
    assert result.last_step == 3


# one decoder layer of the tiny model (test_weight_sync_bytes_follow_the_recipe): its linears q, k,
# v, o, gate, up, down hold 9216 weights in 7 blocks of 128x128; FP8 sends 1 B a weight and a 4 B
# scale a block, BF16 2 B a weight; on the wire each tensor is padded to a multiple of 16 bytes (the
# weights' bytes already are: 512, 1024, 2048; each 4 B scale becomes 16 B)
LAYER_WEIGHTS = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 64 * 32
LAYER_TO_BF16_BYTES = 2 * LAYER_WEIGHTS - (LAYER_WEIGHTS + 16 * 7)
KV_SCALE_BYTES = 2 * 2 * 16  # K and V, 4 B each (16 B on the wire), for each of 2 layers


def responding_spec(
    steps: int, staleness: int = 0, layers: int = 2, kv: bool = True, relax: bool = False
) -> JobSpec:
    """fp8-gen (with the FP8 KV cache: ``kv``) on a tiny model of ``layers`` decoder layers, held to
    an SLO it breaks at every FP8 step (median 1.0: any mismatch), with ``action: respond``: the
    ladder climbs a rung a step (the first breach takes tighten-is with bf16-layers)."""
    slo = {"median": 1.0, "tail_bound": 1.0, "tail_fraction": 0.0, "window": 2, "attribution_interval": 0,
           "action": "respond", "action_layers": 1, "relax": relax}  # fmt: skip
    return tiny_spec(
        "fp8-gen", steps=steps,
        model={"tiny": {**helpers.TINY_MODEL, "num_layers": layers}},
        precision={"recipe": "fp8-gen", "fp8_kv_cache": kv, "mismatch_slo": slo},
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3, "max_staleness": staleness},
    )  # fmt: skip


@pytest.mark.slow
def test_the_slo_response_climbs_its_ladder_in_both_engines(tmp_path: Path) -> None:
    """Each breach takes the next action (the first: tighten-is with bf16-layers, since tightening
    changes no engine), seen in the log (once each), precision_actions.jsonl, the line's
    ``precision/actions``, and in what the engines then are: the weight sync's bytes (hand-worked:
    the layer the attribution named worst goes BF16, then the KV cache's scales go, then the other
    layer), with the weight contract met at every step. From step 4 the job is BF16: a mismatch of
    1.0 holds the SLO, and nothing more is taken."""
    said: list[str] = []
    result = run(responding_spec(5), tmp_path, RunOptions(log=said.append))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    events = [json.loads(x) for x in (tmp_path / "precision_actions.jsonl").read_text().splitlines()]
    assert [(e["step"], e["taken"][-1]) for e in events] == [
        (1, "bf16-layers"), (2, "bf16-kv-cache"), (3, "bf16-generation")
    ]  # fmt: skip
    assert events[0]["taken"] == ["tighten-is", "bf16-layers"]
    assert [r["precision/actions"] for r in rows] == [2, 3, 4, 4, 4]
    attribution = [json.loads(x) for x in (tmp_path / "mismatch_layers.jsonl").read_text().splitlines()]
    assert attribution[0]["step"] == 1 and events[0]["layers"] == attribution[0]["worst"][:1]
    sent = [r["weight_sync/bytes"] for r in rows]
    assert sent[1] - sent[0] == LAYER_TO_BF16_BYTES
    assert sent[2] - sent[1] == -KV_SCALE_BYTES
    assert sent[3] - sent[2] == LAYER_TO_BF16_BYTES  # recipe bf16: the other layer too
    assert sent[4] == sent[3]
    assert [r["mismatch/token_mult_prob_error"] for r in rows[3:]] == [1.0, 1.0]
    assert all(r["sync/layers_mismatched"] == 0 for r in rows)
    responses = [x for x in said if "mismatch SLO response" in x]
    assert [x.split(":")[0] for x in responses] == ["step 1", "step 2", "step 3"]
    assert "importance sampling tis [0.5, 2] -> tis [0.75, 1.5]; bf16-layers: decoder layers" in responses[0]
    assert result.last_step == 5


@pytest.mark.slow
def test_relax_moves_the_layer_back_to_fp8_after_a_window_within(tmp_path: Path) -> None:
    """fp8-gen on one decoder layer, SLO median 1.0, window 2, relax: step 1 breaks it
    (tighten-is with bf16-layers: the only layer, so the generator computes as the BF16 trainer
    does and the mismatch is 1.0), steps 2-3 hold it for a window, so bf16-layers is undone after
    step 3 (tighten-is stays: one action at a time); step 4 is FP8 again, breaks it, and takes
    bf16-layers again for step 5. The weight sync's bytes follow each change."""
    one_layer = responding_spec(5, layers=1, kv=False, relax=True)
    said: list[str] = []
    run(one_layer, tmp_path, RunOptions(log=said.append))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    assert [r["precision/actions"] for r in rows] == [2, 2, 1, 2, 2]
    mismatch = [r["mismatch/token_mult_prob_error"] for r in rows]
    assert mismatch[0] > 1.0 and mismatch[3] > 1.0  # FP8
    assert mismatch[1] == mismatch[2] == mismatch[4] == 1.0  # the only layer in BF16
    sent = [r["weight_sync/bytes"] for r in rows]
    assert sent[1] - sent[0] == LAYER_TO_BF16_BYTES and sent[2] == sent[1]
    assert sent[3] - sent[2] == -LAYER_TO_BF16_BYTES  # FP8 again after the undoing
    assert sent[4] - sent[3] == LAYER_TO_BF16_BYTES
    events = [json.loads(x)["what"] for x in (tmp_path / "precision_actions.jsonl").read_text().splitlines()]
    assert [e.split(":")[0] for e in events] == ["tighten-is", "undone", "bf16-layers"]
    assert any(x.startswith("step 3: mismatch SLO response: undone: bf16-layers") for x in said), said


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "asynchronous"])
def test_a_crash_and_resume_keep_the_actions_of_the_checkpoint(tmp_path: Path, staleness: int) -> None:
    """Crash after step 3 (checkpoint at 2, taken after bf16-kv-cache): the resumed job starts with
    tighten-is, bf16-layers and bf16-kv-cache, computes step 3 again as the first run did (the same
    prompts, seeds per step; the same bytes), drops the step-3 action of the lost run, takes it
    again, and has every step once."""
    seen = run_until_a_crash(responding_spec(4, staleness), tmp_path, 3)
    said: list[str] = []
    run(responding_spec(4, staleness), tmp_path, RunOptions(resume=True, log=said.append))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    in_effect = "tighten-is, bf16-layers, bf16-kv-cache"
    assert any("precision actions in effect from" in x and in_effect in x for x in said), said
    assert rows[2]["weight_sync/bytes"] == seen[2]["weight_sync/bytes"]
    assert rows[2]["weight_sync/bytes"] - rows[1]["weight_sync/bytes"] == -KV_SCALE_BYTES
    assert rows[2]["reward/mean"] == seen[2]["reward/mean"]
    events = [json.loads(x) for x in (tmp_path / "precision_actions.jsonl").read_text().splitlines()]
    assert [(e["step"], e["taken"][-1]) for e in events] == [
        (1, "bf16-layers"), (2, "bf16-kv-cache"), (3, "bf16-generation")
    ]  # fmt: skip
    assert [r["precision/actions"] for r in rows] == [2, 3, 4, 4]


@pytest.mark.slow
def test_weight_sync_bytes_follow_the_recipe(tmp_path: Path) -> None:
    """BF16 sends 2 B per parameter; FP8 layers send 1 B per weight + 4 B per 128x128 block, and an
    FP8 KV cache's scales 4 B per layer for K and for V; each tensor padded to a multiple of 16 B."""
    sizes = {}
    for recipe in ("bf16", "fp8-e2e"):
        sizes[recipe] = run(
            tiny_spec(recipe, steps=1), tmp_path / recipe, RunOptions(log=lambda m: None)
        ).rows[0]
    # tiny model: embed 272x32, lm_head 32x272 (vocab 259 padded to 272), 2 norms x 32 + final 32;
    # linears q 32x32, k 16x32, v 16x32, o 32x32, gate/up 64x32, down 32x64 = 7168 weights, 7 blocks
    linear = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 3 * 64 * 32
    other = 2 * 272 * 32 + 3 * 32
    assert sizes["bf16"]["weight_sync/bytes"] == 2 * (linear + other)  # every tensor a multiple of 16 B
    # fp8-e2e runs with the FP8 KV cache here (tiny_spec): its K and V scales, float32, one layer;
    # each 4 B scale (7 weights' one block each, K, V) travels as 16 B
    assert sizes["fp8-e2e"]["weight_sync/bytes"] == linear + 16 * 7 + 2 * other + 2 * 16


@pytest.mark.slow
def test_stop_checkpoints_and_resume_continues_at_the_next_step(tmp_path: Path) -> None:
    stop = threading.Event()
    first = run(tiny_spec("fp8-e2e", steps=4), tmp_path, RunOptions(stop=stop, on_step=lambda r: stop.set()))
    assert first.stopped and first.last_step == 1
    assert checkpoint.latest(tmp_path) is not None and checkpoint.latest(tmp_path)[0] == 1  # type: ignore[index]
    with pytest.raises(FileExistsError, match="--resume"):
        run(tiny_spec("fp8-e2e", steps=4), tmp_path, RunOptions())
    second = run(tiny_spec("fp8-e2e", steps=4), tmp_path, RunOptions(resume=True))
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").rows()] == [1, 2, 3, 4]
    assert second.last_step == 4 and not second.stopped


@pytest.mark.slow
def test_crash_after_a_checkpoint_resumes_without_duplicate_or_missing_steps(tmp_path: Path) -> None:
    """Crash in step 3 (checkpoint at 2, metrics line 3 written): resume drops line 3, recomputes
    step 3 from the step-2 checkpoint, and gets the same rollouts (seeds are per step)."""
    seen = run_until_a_crash(tiny_spec("bf16", steps=4), tmp_path, 3)
    assert [r["step"] for r in MetricsLog(tmp_path / "metrics.jsonl").rows()] == [1, 2, 3]
    run(tiny_spec("bf16", steps=4), tmp_path, RunOptions(resume=True))
    rows = MetricsLog(tmp_path / "metrics.jsonl").rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["reward/mean"] == seen[2]["reward/mean"]
    assert rows[2]["response_length/mean"] == seen[2]["response_length/mean"]


def test_rayjob_entrypoint_rejects_a_bad_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from workers.job.driver import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 0\n")
    assert main([str(bad)]) == 2
    assert "steps: Input should be greater than or equal to 1" in capsys.readouterr().out


@pytest.mark.slow
def test_entrypoint_runs_a_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from workers.job.driver import main

    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(tiny_spec("fp8-gen", steps=1).model_dump(mode="json")))
    assert main([str(spec), "--output", str(tmp_path / "out"), "--job", "j1"]) == 0
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [p["step"] for p in printed] == [1]


@pytest.mark.slow
def test_two_trainers_and_two_generators(tmp_path: Path) -> None:
    """2x2 actors over gloo: data-parallel trainers (gradients and statistics all-reduced), the
    weight sync from trainer 0 to both generators, per-generator memory summed."""
    res = {"trainers": 2, "generators": 2, "cpus_per_actor": 0.5}
    two = run(tiny_spec("fp8-e2e", steps=2, resources=res), tmp_path / "2x2", RunOptions(log=lambda m: None))
    one = run(tiny_spec("fp8-e2e", steps=1), tmp_path / "1x1", RunOptions(log=lambda m: None))
    assert [r["step"] for r in two.rows] == [1, 2]
    for row in two.rows:
        assert row["weight_sync/bytes"] == one.rows[0]["weight_sync/bytes"]  # the same model, once
        assert row["weights/bytes"] == 2 * one.rows[0]["weights/bytes"]  # two generators
        # rewards of a random tiny policy may tie within a group (zero advantage, zero gradient):
        # the values themselves are checked against one trainer in test_data_parallel.py
        assert row["train/grad_norm"] >= 0 and row["tokens/generated"] > 0 and "train/tokens" not in row


def test_an_engine_that_is_not_installed_fails_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.engines.factory import EngineUnavailable

    def no_ray(*args: Any) -> None:
        raise AssertionError("Ray was started")

    monkeypatch.setattr("workers.job.driver.ray_init", no_ray)
    # make test installs vLLM's CPU build: this machine is one without vLLM only for this test
    monkeypatch.setattr("workers.engines.factory._installed", lambda module: not module.startswith("vllm"))
    spec = tiny_spec("bf16", resources={"generator_engine": "vllm", "gpus_per_generator": 1})
    with pytest.raises(
        EngineUnavailable, match=r"resources.generator_engine=vllm: .*needs vllm.*worker image"
    ):
        run(spec, tmp_path, RunOptions(log=lambda m: None))


def test_validation_is_due_every_interval_and_at_the_last_step() -> None:
    from workers.rl.validation import validation_due

    def due(interval: int, steps: int) -> list[int]:
        spec = tiny_spec("bf16", steps=steps, validation={"interval": interval})
        return [s for s in range(1, steps + 1) if validation_due(spec, s)]

    assert due(2, 5) == [2, 4, 5] and due(5, 5) == [5] and due(10, 3) == [3] and due(0, 5) == []


@pytest.mark.slow
def test_validation_scores_the_held_out_rows_on_the_due_steps(tmp_path: Path) -> None:
    """A constructed task: every training answer is "1", so the supervised warm-up teaches the
    policy to answer "1" whatever the question (GRPO then sees equal rewards in every group: no
    update moves it). Of the 4 held-out rows (the file's last), 2 expect "1" and 2 expect "2":
    greedy answers score 1, 1, 0, 0, so val/accuracy = val/reward_mean = 2/4 = 0.5."""
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(16)]
    rows += [{"question": "h0", "answer": "1"}, {"question": "h1", "answer": "1"}]
    rows += [{"question": "h2", "answer": "2"}, {"question": "h3", "answer": "2"}]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tiny_spec(
        "bf16",
        steps=3,
        task={"dataset": str(data)},
        warmup={"sft_steps": 40, "batch_size": 16, "lr": 1e-2},
        validation={"interval": 2, "size": 4, "temperature": 0.0},
    )
    result = run(spec, tmp_path / "run", RunOptions(log=lambda m: None))
    rows_out = MetricsLog(tmp_path / "run" / "metrics.jsonl").rows()
    # step 0: the warmed-up policy before RL, a line of its own with the validation keys only
    assert [r["step"] for r in rows_out] == [0, 1, 2, 3] and result.last_step == 3
    val_keys = {
        "val/accuracy",
        "val/pass@1",
        "val/reward_mean",
        "val/truncated_fraction",
        "val/unreadable_fraction",
    }
    assert set(rows_out[0]) == {"step", "timing/validation_s", *val_keys}
    assert [("val/accuracy" in r, "val/reward_mean" in r, "timing/validation_s" in r) for r in rows_out] == [
        (True, True, True),
        (False, False, False),
        (True, True, True),
        (True, True, True),
    ]
    for r in (rows_out[0], *rows_out[2:]):
        assert (r["val/accuracy"], r["val/pass@1"], r["val/reward_mean"]) == (0.5, 0.5, 0.5), r
        # "1" then EOS, as the warm-up taught: every answer ends and is read (the last number)
        assert (r["val/truncated_fraction"], r["val/unreadable_fraction"]) == (0.0, 0.0), r
        assert r["timing/validation_s"] > 0
    # the training rows answer "1" and are all rewarded: the policy did learn the constant answer
    assert rows_out[-1]["reward/mean"] == 1.0
    # a resume from step 3's checkpoint, one step more: step 0 is not validated again
    resumed = run(
        spec.model_copy(update={"steps": 4}), tmp_path / "run", RunOptions(resume=True, log=lambda m: None)
    )
    again = MetricsLog(tmp_path / "run" / "metrics.jsonl").rows()
    assert [r["step"] for r in again] == [0, 1, 2, 3, 4] and resumed.last_step == 4


@pytest.mark.slow
def test_the_warm_up_stops_at_its_target_accuracy(tmp_path: Path) -> None:
    """Every training answer is "1": the warm-up learns it within a few dozen steps at lr 1e-2
    (the test above needs 40). With a target of 1.0 checked every 5 steps it stops at the first
    check that finds every training problem answered "1", long before its cap of 400 steps; the
    checks' lines carry the accuracy, the others do not."""
    rows = [{"question": f"q{i}", "answer": "1"} for i in range(16)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tiny_spec(
        "bf16",
        steps=1,
        task={"dataset": str(data)},
        warmup={"sft_steps": 400, "batch_size": 16, "lr": 1e-2, "target_accuracy": 1.0,
                "check_interval": 5, "check_size": 16},
    )  # fmt: skip
    logs: list[str] = []
    run(spec, tmp_path / "run", RunOptions(log=logs.append))
    lines = [json.loads(x) for x in (tmp_path / "run" / "warmup.jsonl").read_text().splitlines()]
    n = len(lines)
    assert 5 <= n < 400 and n % 5 == 0
    checks = [x for x in lines if "train_accuracy" in x]
    assert [x["sft_step"] for x in checks] == list(range(5, n + 1, 5))
    assert checks[-1]["train_accuracy"] == 1.0 and all(x["train_accuracy"] < 1.0 for x in checks[:-1])
    assert any(
        f"supervised warm-up: {n} steps" in line and "greedy training accuracy 1.000" in line for line in logs
    )


@pytest.mark.slow
def test_a_kill_between_the_checkpoint_and_its_metrics_line_loses_no_line(tmp_path: Path) -> None:
    """The driver checkpoints a step before appending its line (a line never names weights that
    were not saved). A kill between the two left a checkpoint at step 2 and lines 1 only: the
    resume used to start at 3 and step 2's line was lost for good (seen in the service's SIGKILL
    test). The checkpoint carries the line; the resume restores it."""
    run(tiny_spec("bf16", steps=2, checkpoint_interval=2), tmp_path, RunOptions())
    log = tmp_path / "metrics.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    log.write_text(lines[0])  # the kill: checkpoint 2 committed, line 2 not yet written
    logs: list[str] = []
    run(tiny_spec("bf16", steps=3, checkpoint_interval=2), tmp_path, RunOptions(resume=True, log=logs.append))
    rows = MetricsLog(log).rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1] == json.loads(lines[1])  # the line itself, not a recomputation
    assert "restored the metrics line of step 2 from its checkpoint" in logs

"""The Megatron trainer over two gloo processes (spawned): tensor and pipeline parallel against one
process, and the trainer actor's setup with two trainers (data or tensor parallel).

Float32 compute for the comparisons with one process: tensor parallelism splits GEMMs and the
vocabulary, so only the order of float32 additions changes (an all-reduce of two partial sums
instead of one sum). Bounds as in test_megatron_cpu.py, measured here in brackets: log-probs and
logits to 2e-5 [TP=2: 1.4e-6; PP=2: 0], the step's statistics to 1e-5 relative, updated weights to
5e-2 x lr [TP=2: 2.8e-3 x lr; PP=2: 4.5e-5 x lr], Adam's moments to 1e-5 of the largest. Each
spawn takes ~10 s on two cores: slow.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import megatron.core  # noqa: F401  # `make engines` installs it (make test does): missing is an error
import pytest
import torch

from tests.workers.engines.megatron.megatron_cpu import (
    REWARDS,
    VOCAB,
    assert_same_state,
    assert_same_stats,
    cpu_spec,
    fixed_batch,
    free_port,
    hf_state,
    megatron_logits,
    one_rank_group,
    random_hf_model,
    release_megatron,
    rows_of,
)

pytestmark = pytest.mark.slow
F32 = torch.float32
TIMEOUT_S = 240


def spawn(target: Callable[..., None], world: int, out: Path, *args: Any) -> list[Any]:
    """Run ``target(rank, world, port, out, *args)`` in ``world`` spawned processes (a gloo group
    each joins); every rank's result, read from ``out/rank{r}.pt``. Stragglers are killed."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [(out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists()]
    assert not errors, "\n".join(errors)
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _guarded(work: Callable[[], Any], rank: int, out: Path) -> None:
    """Run ``work`` in a spawned rank, saving its result, or its traceback for the parent."""
    torch.set_num_threads(1)  # two ranks on two cores
    try:
        torch.save(work(), out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        release_megatron()


# -- tensor and pipeline parallel against one process ----------------------------------------------


def _parallel_rank(rank: int, world: int, port: int, out: Path, tp: int, pp: int) -> None:
    def work() -> dict[str, Any]:
        import torch.distributed as dist

        from workers.engines.megatron.trainer import MegatronTrainer

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        spec = cpu_spec("qwen2", resources=_parallel(tp, pp))
        meg = MegatronTrainer(spec, VOCAB, "cpu", rank, compute_dtype=F32)
        meg.load_state_dict({"model": hf_state(random_hf_model(spec))})
        mine = rows_of(fixed_batch(), rank, world)
        logp = meg.logprobs(mine, 0.9)
        step = meg.train_step(mine, rows_of_rewards(rank, world), 1.0)
        return {
            "logp": logp,
            "stats": step.stats,
            "old": step.logprobs_old,
            "state": meg.state_dict(),
        }

    _guarded(work, rank, out)


def rows_of_rewards(rank: int, world: int) -> torch.Tensor:
    per = REWARDS.shape[0] // world
    return REWARDS[rank * per : (rank + 1) * per]


def _parallel(tp: int, pp: int) -> dict[str, Any]:
    return {"trainers": tp * pp, "trainer_tensor_parallel_size": tp, "trainer_pipeline_parallel_size": pp}


@pytest.fixture
def one_process() -> Iterator[dict[str, Any]]:
    """The float32 reference: the same weights, rows and step in one process."""
    from workers.engines.megatron.trainer import MegatronTrainer

    group = one_rank_group()
    next(group)
    try:
        spec = cpu_spec("qwen2")
        meg = MegatronTrainer(spec, VOCAB, "cpu", compute_dtype=F32)
        meg.load_state_dict({"model": hf_state(random_hf_model(spec))})
        batch = fixed_batch()
        logp = meg.logprobs(batch, 0.9)
        step = meg.train_step(batch, REWARDS, 1.0)
        yield {
            "logp": logp,
            "stats": step.stats,
            "old": step.logprobs_old,
            "state": meg.state_dict(),
        }
    finally:
        next(group, None)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_equal_one(tmp_path: Path, one_process: dict[str, Any], tp: int, pp: int) -> None:
    ranks = spawn(_parallel_rank, 2, tmp_path, tp, pp)
    lr = cpu_spec("qwen2").optimizer.lr
    logp = torch.cat([r["logp"] for r in ranks])  # each trainer's own rows, in rank order
    print(f"tp={tp} pp={pp}: log-probs max diff {float((logp - one_process['logp']).abs().max()):.2e}")
    torch.testing.assert_close(logp, one_process["logp"], atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.cat([r["old"] for r in ranks]), one_process["old"], atol=2e-5, rtol=0)
    assert ranks[0]["stats"] == ranks[1]["stats"]  # the whole batch's statistics on each trainer
    assert_same_stats(ranks[0]["stats"], one_process["stats"])
    state, expected = ranks[0]["state"]["model"], one_process["state"]["model"]
    assert ranks[1]["state"]["model"] == {}  # trainer 0 holds the gathered checkpoint
    assert state.keys() == expected.keys()
    worst = max(float((state[k] - v).abs().max()) for k, v in expected.items())
    print(f"tp={tp} pp={pp}: updated weights max diff {worst / lr:.2e} x lr")
    assert worst <= 5e-2 * lr
    # Adam's moments, gathered from the shards: 0.1 x g and 0.001 x g^2 after one step
    for key in ("exp_avg", "exp_avg_sq"):
        got, want = ranks[0]["state"]["optimizer"][key], one_process["state"]["optimizer"][key]
        assert got.keys() == want.keys()
        largest = max(float(v.abs().max()) for v in want.values())
        assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5 * largest, key


def test_tensor_parallel_logits_are_the_vocabulary_shards(tmp_path: Path) -> None:
    """Each tensor-parallel rank's logits are its half of the padded vocabulary's columns of the
    Hugging Face model's logits (float32)."""
    spec = cpu_spec("llama")
    hf = random_hf_model(spec)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits  # [2, 9, 272]
    shards = spawn(_logits_rank, 2, tmp_path, ids)
    # 272 rows padded to a multiple of 128 x tp = 256: 512, 256 on each rank
    assert [s.shape[-1] for s in shards] == [256, 256]
    logits = torch.cat(shards, -1)
    assert not logits[..., 272:].any()
    torch.testing.assert_close(logits[..., :272], expected, atol=2e-5, rtol=0)


def _logits_rank(rank: int, world: int, port: int, out: Path, ids: torch.Tensor) -> None:
    def work() -> torch.Tensor:
        import torch.distributed as dist

        from workers.engines.megatron.trainer import MegatronTrainer

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        spec = cpu_spec("llama", resources=_parallel(2, 1))
        meg = MegatronTrainer(spec, VOCAB, "cpu", rank, compute_dtype=F32)
        meg.load_state_dict({"model": hf_state(random_hf_model(spec))})
        return megatron_logits(meg, ids)

    _guarded(work, rank, out)


# -- the trainer actor ------------------------------------------------------------------------------


def _actor_rank(rank: int, world: int, port: int, out: Path, resources: dict[str, Any]) -> None:
    def work() -> dict[str, Any]:
        from workers.job.ray_workers import TrainerWorker

        spec = cpu_spec("llama", resources=resources)
        worker = TrainerWorker(spec.model_dump_json(), rank, world + 1, VOCAB)  # + one generator
        audit = worker.setup(f"tcp://127.0.0.1:{port}", "gloo")  # the job's collective backend on CPU
        logp_old, stats = worker.train_step(rows_of(fixed_batch(), rank, world), rows_of_rewards(rank, world))
        worker.save(str(out))  # every trainer gathers; trainer 0 writes trainer.pt
        saved = worker.engine.state_dict()
        worker.train_step(rows_of(fixed_batch(seed=1), rank, world), rows_of_rewards(rank, world))
        worker.load(str(out))
        return {
            "audit": audit["table"],
            "logp_old": logp_old,
            "stats": stats,
            "saved": saved,
            "reloaded": worker.engine.state_dict(),
        }

    _guarded(work, rank, out)


@pytest.mark.parametrize(
    "resources",
    [{"trainers": 2}, {"trainers": 2, "trainer_tensor_parallel_size": 2}],
    ids=["dp2", "tp2"],
)
def test_the_trainer_actor_runs_two_megatron_trainers(tmp_path: Path, resources: dict[str, Any]) -> None:
    """``TrainerWorker.setup`` joins the trainers' gloo group, the factory builds the Megatron
    trainer on it (BF16), a step's statistics cover both trainers' rows, and the checkpoint
    trainer 0 writes loads back on both exactly."""
    ranks = spawn(_actor_rank, 2, tmp_path, resources)
    assert ranks[0]["stats"] == ranks[1]["stats"]  # the whole batch's statistics on each trainer
    batch = fixed_batch()
    assert ranks[0]["stats"]["train/tokens"] == float(batch.response_mask.sum())
    logp_old = torch.cat([r["logp_old"] for r in ranks])
    assert logp_old.shape == batch.logprobs.shape and not (logp_old * (1 - batch.response_mask)).any()
    assert "decoder.layers.0.input_layernorm" in ranks[0]["audit"]  # the local layer spec
    assert (tmp_path / "trainer.pt").exists() and ranks[1]["reloaded"]["model"] == {}
    assert ranks[0]["saved"]["optimizer"]["steps"] == 1
    assert_same_state(ranks[0]["reloaded"], ranks[0]["saved"])  # weights and Adam's moments

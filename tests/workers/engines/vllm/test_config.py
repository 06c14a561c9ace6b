"""The vLLM generator's pure parts, on CPU: layout and refusals, resources, engine and sampling
arguments, the Rollouts built from vLLM's documented output fields, and the worker extension's
names. (The engine itself: test_vllm_cpu.py and test_vllm_kv_scales.py.)"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import LlamaConfig

from rljob import parse_spec
from workers.engines.vllm import config as vg
from workers.engines.vllm.generator import rollouts_from_outputs
from workers.engines.vllm.worker import WeightChannelExtension


def config(hidden: int = 256, heads: int = 2, kv_heads: int = 1, layers: int = 2, ffn: int = 512) -> Any:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def spec(**precision: Any) -> Any:
    return parse_spec(
        {
            "model": {
                "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_heads": 2, "num_kv_heads": 1}
            },
            "precision": precision,
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1},
        }
    )


@pytest.mark.parametrize(
    "kept", [{"keep_bf16_layers": [1, 0]}, {"bf16_layers": [0]}], ids=["first", "by-index"]
)
def test_layout_is_the_native_rule_with_layers_kept_in_bf16(kept: dict[str, Any]) -> None:
    fp8, bf16 = vg.generator_layout(config(), spec(**kept).precision)
    # layer 0 kept: its 7 linears are BF16 (vLLM's ignored_layers); layer 1 is FP8
    assert fp8 == [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
    ]
    assert sorted(bf16) == sorted(
        ["lm_head"]
        + [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        + [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    )
    none, everything = vg.generator_layout(config(), spec(recipe="bf16").precision)
    assert none == [] and len(everything) == 15


@pytest.mark.parametrize(
    ("precision", "by_hand"),
    [
        ({"keep_bf16_layers": [1, 1]}, {0, 3}),
        ({"bf16_layers": [2, 0]}, {0, 2}),
        ({"keep_bf16_layers": [0, 2], "bf16_layers": [1]}, {1, 2, 3}),
        ({}, set()),
    ],
    ids=["ends", "by-index", "both", "none"],
)
def test_vllm_and_the_native_engine_keep_the_same_layers_for_the_same_reasons(
    precision: dict[str, Any], by_hand: set[int]
) -> None:
    """The two generators' layouts, each built by its own code, against each other and against the
    layers worked by hand (4 decoder layers): a layer one engine keeps in BF16 and the other
    quantizes would break the precision contract at the first sync."""
    from transformers import LlamaForCausalLM

    from workers.fp8.convert import convert_model

    cfg = config(layers=4)
    job = spec(**precision)
    fp8, bf16 = vg.generator_layout(cfg, job.precision)
    audit = convert_model(
        LlamaForCausalLM(cfg).model,
        "fp8-e2e",
        keep_bf16=tuple(job.precision.keep_bf16_layers),
        bf16_layers=job.precision.bf16_layers,
    )
    native = {f"model.{r.name}": r.reason for r in audit.rows if r.kind == "linear" and r.precision != "fp8"}
    assert native == {k: v for k, v in bf16.items() if k != "lm_head"}
    assert sorted(f"model.{n}.weight" for n in audit.fp8_layers) == sorted(fp8)
    assert {int(k.split(".")[2]) for k in native} == by_hand
    assert len(native) == 7 * len(by_hand)


def test_a_layer_index_beyond_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"precision.bf16_layers \[2, 5\]: the model has decoder layers 0-1"):
        vg.generator_layout(config(), spec(bf16_layers=[5, 0, 2]).precision)


def test_shapes_of_the_decoder_linears() -> None:
    # head_dim 256 / 2 = 128; one KV head: k/v out = 128
    shapes = {m: s for _, m, s in vg.decoder_linears(config())}
    assert shapes["model.layers.0.self_attn.q_proj"] == (256, 256)
    assert shapes["model.layers.0.self_attn.k_proj"] == (128, 256)
    assert shapes["model.layers.0.self_attn.o_proj"] == (256, 256)
    assert shapes["model.layers.1.mlp.down_proj"] == (256, 512)


def test_a_layout_without_whole_blocks_is_refused_naming_the_layer() -> None:
    small = config(hidden=128, heads=4, kv_heads=2)  # head_dim 32: k_proj has 64 rows
    fp8, _ = vg.generator_layout(small, spec().precision)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.*64.*keep_bf16_layers"):
        vg.check_layout(small, fp8, 1)
    fp8, _ = vg.generator_layout(config(), spec().precision)
    vg.check_layout(config(), fp8, 1)  # every part a multiple of 128
    with pytest.raises(ValueError, match=r"k_proj.*128.*tensor_parallel_size 2"):
        vg.check_layout(config(), fp8, 2)  # one 128-row KV head cannot split over two GPUs


def test_engine_arguments_of_an_fp8_job() -> None:
    job = spec(keep_bf16_layers=[1, 0], fp8_kv_cache=True)
    kwargs = vg.engine_kwargs(job, "/models/tiny", ["model.layers.0.self_attn.q_proj"], gpu_memory=0.8)
    assert kwargs["quantization"] == "fp8" and kwargs["kv_cache_dtype"] == "fp8"
    qc = kwargs["hf_overrides"]["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    assert qc["ignored_layers"] == ["model.layers.0.self_attn.q_proj"]
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["load_format"] == "dummy"
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["skip_tokenizer_init"]
    assert kwargs["weight_transfer_config"] == {"backend": "fp8rl"}
    assert kwargs["gpu_memory_utilization"] == 0.8 and not kwargs["enforce_eager"]  # CUDA graphs
    assert "kv_cache_memory_bytes" not in kwargs
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightChannelExtension
    plain = vg.engine_kwargs(spec(recipe="bf16"), "m", [])
    assert "quantization" not in plain and "kv_cache_dtype" not in plain
    env = vg.vllm_environment(job, "cuda")
    assert env["VLLM_USE_DEEP_GEMM_E8M0"] == "0" and set(env) == {
        "VLLM_USE_DEEP_GEMM_E8M0",
        "VLLM_LOGGING_LEVEL",
    }
    assert vg.vllm_environment(spec(power_of_two_scales=True), "cuda")["VLLM_USE_DEEP_GEMM_E8M0"] == "1"


def test_engine_arguments_on_cpu() -> None:
    job = spec(recipe="bf16", fp8_kv_cache=True)
    kwargs = vg.engine_kwargs(
        job, "m", [], device="cpu", model_len=96, kv_cache_bytes=5 * 2**20, gpu_memory=0.5
    )
    assert kwargs["enforce_eager"] and kwargs["max_model_len"] == 96
    assert not kwargs["enable_chunked_prefill"] and kwargs["max_num_batched_tokens"] == 4096
    assert vg.engine_kwargs(job, "m", [], device="cpu", model_len=8000)["max_num_batched_tokens"] == 8000
    assert kwargs["kv_cache_memory_bytes"] == 5 * 2**20 and "gpu_memory_utilization" not in kwargs
    threads = parse_spec(
        {"model": {"tiny": {}}, "resources": {"generator_engine": "vllm", "threads_per_actor": 3}}
    )
    env = vg.vllm_environment(threads, "cpu")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "3"


def cpu_spec(**precision: Any) -> Any:
    return parse_spec(
        {
            "model": {"tiny": {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}},
            "precision": precision,
            "rollout": {"max_new_tokens": 32, "prompts_per_step": 6, "group_size": 4},
            "resources": {"generator_engine": "vllm", "generators": 4},
        }
    )


NO_AMX = vg.CpuFeatures(amx=False, avx512=True)


def test_what_vllm_cannot_run_on_this_kind_of_cpu_is_refused_naming_the_field() -> None:
    tiny = config(hidden=128, heads=4, kv_heads=2)  # head_dim 32
    vg.check_vllm(tiny, cpu_spec(recipe="bf16", fp8_kv_cache=True), NO_AMX)  # what this CPU runs
    with pytest.raises(
        ValueError, match=r"recipe fp8-gen.*Intel AMX.*recipe bf16.*fp8_kv_cache.*native.*GPUs"
    ):
        vg.check_vllm(tiny, cpu_spec(recipe="fp8-gen"), NO_AMX)
    with pytest.raises(ValueError, match=r"recipe fp8-e2e.*Intel AMX"):
        vg.check_vllm(tiny, cpu_spec(recipe="fp8-e2e"), NO_AMX)
    # with AMX the FP8 layers get as far as the block layout (head_dim 32: k_proj has 64 rows)
    with pytest.raises(ValueError, match=r"k_proj.*not a multiple of 128"):
        vg.check_vllm(tiny, cpu_spec(recipe="fp8-gen"), vg.CpuFeatures(amx=True, avx512=True))
    odd = config(hidden=96, heads=2, kv_heads=1)  # head_dim 48
    with pytest.raises(ValueError, match=r"fp8_kv_cache.*divisible by 32.*is 48"):
        vg.check_vllm(odd, cpu_spec(recipe="bf16", fp8_kv_cache=True), NO_AMX)
    vg.check_vllm(odd, cpu_spec(recipe="bf16"), NO_AMX)  # a BF16 cache takes any head_dim
    with pytest.raises(ValueError, match=r"fp8_kv_cache.*AVX-512 or AMX"):
        vg.check_vllm(tiny, cpu_spec(recipe="bf16", fp8_kv_cache=True), vg.CpuFeatures(False, False))
    # on GPUs the CPU's features do not matter
    gpu = parse_spec(
        {
            "model": {"tiny": {"hidden_size": 256, "num_heads": 2, "num_kv_heads": 1}},
            "precision": {"recipe": "fp8-gen", "fp8_kv_cache": True},
            "resources": {"generator_engine": "vllm", "gpus_per_generator": 1},
        }
    )
    vg.check_vllm(config(), gpu, vg.CpuFeatures(False, False))
    short = config()
    short.max_position_embeddings = 32
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens \(32\).*32 positions"):
        vg.check_vllm(short, cpu_spec(recipe="bf16"), NO_AMX)


def test_the_factory_refuses_before_anything_starts() -> None:
    from workers.engines.factory import check_model

    with pytest.raises(ValueError, match=r"Intel AMX|head_dim|AVX-512|k_proj"):  # whichever this CPU hits
        check_model(cpu_spec(recipe="fp8-e2e"))


def test_resources_from_the_spec() -> None:
    tiny = config(hidden=128, heads=4, kv_heads=2, layers=2)
    job = cpu_spec(recipe="bf16", fp8_kv_cache=True)
    # K and V x 2 KV heads x head_dim 32 x 1 byte (FP8) x 2 layers = 256 bytes per token
    assert vg.kv_bytes_per_token(tiny, True) == 256
    assert vg.max_model_len(tiny, job) == 2048  # LlamaConfig's default max_position_embeddings
    assert vg.max_model_len(tiny, job, max_prompt_tokens=40) == 40 + 32
    assert vg.max_model_len(tiny, job, max_prompt_tokens=4000) == 2048
    # 6 prompts over 4 generators: at most 2 prompts x group 4 = 8 sequences per call
    assert vg.sequences_per_generate(job) == 8
    with_validation = job.model_copy(update={"validation": job.validation.model_copy(update={"interval": 5})})
    assert vg.sequences_per_generate(with_validation) == 32  # 128 held-out problems / 4 generators
    # 256 B x 72 tokens x 8 sequences = 147456 B, under the 64 MiB floor; 2048 tokens x 32: 16 MiB
    assert vg.cpu_kv_cache_bytes(tiny, job, 72) == 64 * 2**20
    big = job.model_copy(update={"rollout": job.rollout.model_copy(update={"group_size": 512})})
    assert vg.cpu_kv_cache_bytes(tiny, big, 2048) == 256 * 2048 * 1024  # 2 prompts x 512 = 1024 sequences
    # an 80 GiB GPU, 10 GiB of weights: 80 - 2 x 10 - 1 = 59 GiB for vLLM = 0.7375 of it
    assert vg.gpu_memory_utilization(10 * 2**30, 80 * 2**30) == pytest.approx(0.7375, abs=1e-3)
    assert vg.gpu_memory_utilization(2**20, 80 * 2**30) == 0.9  # vLLM's default at most
    with pytest.raises(ValueError, match="generator_tensor_parallel_size"):
        vg.gpu_memory_utilization(8 * 2**30, 16 * 2**30)


def test_sampling_arguments() -> None:
    s = vg.sampling_kwargs(32, 0.7, 0.9, 5, eos=2)
    assert (s["temperature"], s["top_p"], s["max_tokens"], s["seed"]) == (0.7, 0.9, 32, 5)
    assert s["logprobs"] == 0 and s["stop_token_ids"] == [2] and not s["detokenize"] and s["n"] == 1
    assert vg.sampling_kwargs(8, 0.0, 0.9, 1, 2)["top_p"] == 1.0  # greedy


def _output(tokens: list[int], logps: list[float]) -> SimpleNamespace:
    """A RequestOutput as vLLM documents it: outputs[0].token_ids and per-position
    {token id: Logprob(logprob=...)} (logprobs=0: the sampled token only)."""
    lp = [
        {t: SimpleNamespace(logprob=v, rank=1, decoded_token=None)}
        for t, v in zip(tokens, logps, strict=True)
    ]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=lp, finish_reason="stop")])


def test_rollouts_from_vllm_outputs() -> None:
    eos, pad = 9, 0
    prompts = [[5, 6, 7], [8]]
    outputs = [_output([1, 2, eos], [-0.5, -1.0, -0.25]), _output([3, 4], [-2.0, -3.0])]  # 2nd: length
    r = rollouts_from_outputs(prompts, outputs, pad, eos)
    assert r.prompt_ids.tolist() == [[5, 6, 7], [pad, pad, 8]]  # left-padded
    assert r.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert r.response_ids.tolist() == [[1, 2, eos], [3, 4, pad]]
    assert r.response_mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # EOS counts
    assert r.logprobs.tolist() == [[-0.5, -1.0, -0.25], [-2.0, -3.0, 0.0]]
    after_eos = rollouts_from_outputs([[1]], [_output([4, eos, 4], [-1.0, -1.0, -1.0])], pad, eos)
    assert after_eos.response_ids.tolist() == [[4, eos]]
    # several stop ids (a chat model's end of turn beside its EOS): cut after the first of them
    two = rollouts_from_outputs([[1]], [_output([4, 7, eos, 4], [-1.0] * 4)], pad, (eos, 7))
    assert two.response_ids.tolist() == [[4, 7]]
    assert vg.sampling_kwargs(8, 1.0, 1.0, 1, (eos, 7))["stop_token_ids"] == [eos, 7]
    missing = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], logprobs=None)])
    with pytest.raises(ValueError, match="logprobs=0"):
        rollouts_from_outputs([[1]], [missing], pad, eos)


def test_kv_bytes_and_audit() -> None:
    # 2 layers x (K and V) x 1 KV head x 128 head dim x 2 bytes (BF16) = 1024; FP8: 512
    assert vg.kv_bytes_per_token(config(), False) == 1024 and vg.kv_bytes_per_token(config(), True) == 512
    audit = vg.generator_audit(config(), spec(keep_bf16_layers=[1, 0]).precision)
    assert audit.device == "CUDA (vLLM)" and vg.generator_audit(config(), spec().precision, "cpu").device == (
        "CPU (vLLM)"
    )
    assert len(audit.fp8_layers) == 7 and "lm_head" in [r.name for r in audit.rows if r.precision != "fp8"]
    q = next(r for r in audit.rows if r.name == "model.layers.1.self_attn.q_proj")
    assert q.bytes_after == 256 * 256 + 4 * 4  # FP8 bytes + four 128x128 block scales


def test_the_worker_extension_adds_only_new_names() -> None:
    # vLLM asserts that no attribute of the extension already exists on its worker class
    names = [a for a in dir(WeightChannelExtension) if not a.startswith("__")]
    assert names and all(a.startswith(("fp8rl_", "_fp8rl_")) for a in names)


def test_the_gpu_example_fits_vllms_blocks() -> None:
    from transformers import Qwen2Config

    # Qwen2.5-1.5B (examples/rljob-qwen-gpu.yaml), its published config: head_dim 1536/12 = 128
    qwen = Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    )
    job = parse_spec({"precision": {"keep_bf16_layers": [1, 1]}})
    fp8, bf16 = vg.generator_layout(qwen, job.precision)
    assert len(fp8) == 26 * 7 and len(bf16) == 2 * 7 + 1
    vg.check_layout(qwen, fp8, 1)  # q 1536, k/v 256, MLP 8960 = 70 x 128
    vg.check_layout(qwen, fp8, 2)  # k/v 128 per GPU
    with pytest.raises(ValueError, match=r"k_proj.*256.*tensor_parallel_size 4 gives 64"):
        vg.check_layout(qwen, fp8, 4)


def test_tensor_parallel_workers_must_report_the_same() -> None:
    from workers.engines.vllm.generator import VllmGenerator

    def report(scale: float, holds: str = "bfloat16") -> dict[str, Any]:
        weight = {"dtype": "bfloat16", "holds": holds, "data": 7, "scale": 0}
        return {
            "weights": {"lm_head.weight": weight},
            "kv": {"dtype": "bfloat16", "k_scales": [scale], "v_scales": []},
        }

    class Llm:  # what collective_rpc returns: one report per worker
        def __init__(self, reports: list[dict[str, Any]]) -> None:
            self.reports = reports

        def collective_rpc(self, method: str) -> list[dict[str, Any]]:
            assert method == "fp8rl_weight_report"
            return self.reports

    gen: Any = VllmGenerator.__new__(VllmGenerator)  # no engine: only the comparison of reports
    gen.llm = Llm([report(0.5), report(0.5)])
    assert gen.weight_report() == report(0.5)
    gen.llm = Llm([report(0.5), report(0.25)])
    with pytest.raises(RuntimeError, match=r"workers 0 and 1 .* hold different weights \(the KV cache\)"):
        gen.weight_report()
    gen.llm = Llm([report(0.5), report(0.5), report(0.5, holds="missing")])
    with pytest.raises(RuntimeError, match=r"workers 0 and 2 .*\(lm_head.weight\)"):
        gen.weight_report()


@pytest.mark.parametrize("dead", [True, False])
def test_a_request_lost_to_a_dead_engine_core_is_an_engine_failure(dead: bool) -> None:
    """vLLM's monitor closes the client's sockets when its engine core dies; a request sent in
    that window fails with the socket's error. With the engine marked dead that is an engine
    failure (EngineDeadError, a fault the driver recovers); with the engine alive it stays the
    error it was (not a fault: the job fails)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from workers.engines.vllm.generator import VllmGenerator
    from workers.rl.faults import is_engine_failure

    class SocketClosed(Exception):  # stands in for zmq.error.ZMQError: Socket operation on non-socket
        pass

    class Llm:
        llm_engine = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_dead=dead)))

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            raise SocketClosed("Socket operation on non-socket")

    gen: Any = VllmGenerator.__new__(VllmGenerator)  # no engine: only the failure's naming
    gen.llm, gen.eos_ids = Llm(), (2,)
    with pytest.raises(EngineDeadError if dead else SocketClosed) as caught:
        gen.generate([[1, 2, 3]], 4, 1.0, 1.0, 0)
    assert is_engine_failure(caught.value) is dead
    if dead:
        assert isinstance(caught.value.__cause__, SocketClosed)

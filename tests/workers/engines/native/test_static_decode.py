"""Static-shape decoding (workers/engines/native/static_decode.py) against the eager decode loop.

The static path is what a CUDA graph captures; on the CPU it runs the same step eagerly, so these
tests check its arithmetic against the dynamic-cache loop (the reference), that every step has
the same shapes and strides (what a capture needs), that it reads nothing back (``meta``), and
that a step compiles as one graph. The capture itself, and weights reloaded under a captured
graph, are checked on a GPU in tests/workers/test_gpu_data_plane.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rljob import JobSpec, parse_spec
from workers.engines.batching import left_pad
from workers.engines.native.generator import NativeGenerator
from workers.engines.native.sampling import log_softmax
from workers.engines.native.static_decode import PROMPT_MULTIPLE, StaticDecoder
from workers.fp8 import simulate
from workers.fp8.linear import Fp8Linear
from workers.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(f"Calculate {a} + {3 * a + 1}. ") for a in range(6)]  # lengths 17..19


def spec(recipe: str, fp8_kv: bool = False, decode: str = "auto") -> JobSpec:
    return parse_spec(
        {
            "model": {"tiny": {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2}},
            "precision": {"recipe": recipe, "fp8_kv_cache": fp8_kv},
            "rollout": {"decode": decode},
        }
    )


def static_of(gen: NativeGenerator, fp8_kv: bool) -> StaticDecoder:
    return StaticDecoder(gen.model, gen.device, False, fp8_kv, log_softmax)


@pytest.mark.parametrize(("recipe", "fp8_kv"), [("bf16", False), ("fp8-e2e", False), ("fp8-e2e", True)])
@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 0.9)])
def test_static_decode_samples_what_eager_decode_samples(
    recipe: str, fp8_kv: bool, temperature: float, top_p: float
) -> None:
    """Same tokens and log-probs as the eager loop: the static cache holds the same K/V (FP8:
    the same scales, calibrated without the extra padding), masked positions get weight 0, and
    the sampler consumes the same random numbers. On the CPU every product is the same float32
    arithmetic, so the log-probs agree to rounding (observed: bit for bit)."""
    gen = NativeGenerator(spec(recipe, fp8_kv), TOK.vocab_size, -1, TOK.pad_id, "cpu")
    assert gen.static is None  # auto on a CPU: the eager loop
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    assert ids.shape[1] % PROMPT_MULTIPLE != 0  # so the static path adds padding of its own
    want = gen.generate_on_device(ids, mask, 10, temperature, top_p, 7)
    got = static_of(gen, fp8_kv).generate(ids, mask, 10, temperature, top_p, 7, -1, TOK.pad_id)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)


def test_static_decode_stops_where_eager_decode_stops() -> None:
    """With two stop ids that rows sample (a chat model's end of turn beside its EOS): the same
    finished rows, padding and early stop in both loops, each row cut at its first stop id."""
    gen = NativeGenerator(spec("bf16"), TOK.vocab_size, -1, TOK.pad_id, "cpu")
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    first = gen.generate_on_device(ids, mask, 12, 0.0, 1.0, 0)[0]  # greedy, never stopping
    stop = (int(first[0, 2]), int(first[1, 3]))  # row 0 stops by its third token, row 1 by its fourth
    # where each row must end, read off the unstopped tokens (greedy: the same prefix)
    ends = [next((t + 1 for t, tok in enumerate(row.tolist()) if tok in stop), 12) for row in first]
    assert ends[0] <= 3 and ends[1] <= 4
    gen = NativeGenerator(spec("bf16"), TOK.vocab_size, stop, TOK.pad_id, "cpu")  # same init seed
    want = gen.generate_on_device(ids, mask, 12, 0.0, 1.0, 0)
    got = static_of(gen, False).generate(ids, mask, 12, 0.0, 1.0, 0, stop, TOK.pad_id)
    assert [int(n) for n in want[1].sum(1)] == ends  # valid tokens per row, then padding
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=1e-5)


class _Record(TorchDispatchMode):
    """Every op of a region with the shapes, strides and dtypes of its tensor arguments/results."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))

        def layout(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.stride(), x.dtype)
            if isinstance(x, list | tuple):
                return tuple(layout(y) for y in x)
            return None

        self.ops.append((str(func), layout(list(args)), layout(out)))
        return out


def test_every_decode_step_has_the_same_shapes_and_strides() -> None:
    """What a CUDA graph replays: the same ops on tensors of the same shapes and strides."""
    gen = NativeGenerator(spec("fp8-e2e", fp8_kv=True), TOK.vocab_size, -1, TOK.pad_id, "cpu")
    decoder = static_of(gen, True)
    steps: list[list[tuple[Any, ...]]] = []
    step = decoder._step

    def recorded(s: Any) -> None:
        with _Record() as rec:
            step(s)
        steps.append(rec.ops)

    decoder._step = recorded  # type: ignore[method-assign]
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    decoder.generate(ids, mask, 6, 1.0, 0.9, 0, -1, TOK.pad_id)
    assert len(steps) == 5 and len(steps[0]) > 100  # 5 decode steps after the prefill's token
    assert all(ops == steps[0] for ops in steps[1:])


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_static_decode_runs_on_meta(fp8_kv: bool) -> None:
    """Nothing is read back (meta tensors have no data), under the SM90 profile's CUDA kernels."""
    gen = NativeGenerator(spec("fp8-e2e", fp8_kv), TOK.vocab_size, TOK.eos_id, TOK.pad_id, "meta")
    gen.model.config._attn_implementation = "sdpa"
    decoder = static_of(gen, fp8_kv)
    ids, mask = left_pad(PROMPTS[:4], TOK.pad_id)
    with simulate("sm90-cuda13.0"):
        tokens, valid, logps = decoder.generate(
            ids.to("meta"), mask.to("meta"), 5, 0.7, 0.9, 0, TOK.eos_id, TOK.pad_id
        )
    assert tokens.shape == valid.shape == logps.shape == (4, 5) and tokens.device.type == "meta"


def test_a_non_finite_prefill_is_what_the_static_loop_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's guard is read at the end with the loop's (no host read between prefill and
    decode), first: a NaN that enters in the prefill is reported as the prefill's, naming the
    first layer's q_proj input, although every decode step then saw it too."""
    from workers.fp8 import NonFiniteError, guard

    gen = NativeGenerator(spec("fp8-e2e"), TOK.vocab_size, -1, TOK.pad_id, "cpu")
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    with torch.no_grad():
        gen.model.get_input_embeddings().weight[int(ids[0, -1])] = float("nan")
    decoder = static_of(gen, False)
    checked: list[Any] = []
    real = guard.FiniteGuard.check

    def check(self: Any) -> None:
        checked.append(self)
        real(self)

    monkeypatch.setattr(guard.FiniteGuard, "check", check)
    with pytest.raises(NonFiniteError, match=r"layers\.0\.self_attn\.q_proj"):
        decoder.generate(ids, mask, 4, 1.0, 1.0, 0, -1, TOK.pad_id)
    (session,) = decoder.sessions.values()
    assert len(checked) == 1 and checked[0] is not session.guard  # the prefill's guard raised
    assert int(session.step) == 4  # after the whole loop had run


@pytest.mark.slow
def test_a_decode_step_compiles_as_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` traces a whole greedy step (the model forward with the
    static cache, the in-place writes, the argmax) without a graph break, and computes what the
    eager step computes. (A sampling step holds a ``torch.Generator``, which dynamo does not
    trace: one reason the GPU path captures the step itself, where the generator is registered
    on the graph; and an FP8 layer looks up its NaN/inf guard in a ``ContextVar``, which dynamo
    does not trace either: FP8 steps are captured, not compiled.)"""
    gen = NativeGenerator(spec("bf16"), TOK.vocab_size, -1, TOK.pad_id, "cpu")
    decoder = static_of(gen, False)
    ids, mask = left_pad(PROMPTS, TOK.pad_id)
    want = decoder.generate(ids, mask, 6, 0.0, 1.0, 0, -1, TOK.pad_id)[0]
    s = next(iter(decoder.sessions.values()))
    p = s.cache.prompt_len
    s.step.fill_(3)  # back to the state before step 3: the compiled step redoes steps 3..5
    s.cache.index.fill_(p + 2)
    s.next_pos.sub_(3)
    s.tok.copy_(want[:, 2])
    s.seen[:, p + 2 :] = False
    compiled = torch.compile(decoder._step, fullgraph=True, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            compiled(s)
    assert torch.equal(s.tokens[:, :6], want)


def test_graph_decode_needs_cuda() -> None:
    with pytest.raises(ValueError, match=r"rollout.decode: graph needs a CUDA GPU.*cpu"):
        NativeGenerator(spec("bf16", decode="graph"), TOK.vocab_size, -1, TOK.pad_id, "cpu")


def test_loading_fp8_weights_writes_into_the_storage_a_graph_reads() -> None:
    """After ``drop_master_weight`` a reload copies into the held FP8 tensors (same addresses, as a
    captured graph needs), refreshes the cuBLAS scale layout in place, and drops the CPU float32
    dequantization so the next forward uses the new weight."""
    torch.manual_seed(0)
    layer = Fp8Linear(256, 384, bias=False)
    layer.drop_master_weight()
    held = layer.fp8_weight()
    from workers.fp8.matmul import blockwise_scales_for_cublas
    from workers.fp8.quant import quantize, quantize_rows

    x = torch.randn(5, 256)
    layer(x)  # makes the CPU dequantization
    _, layout = blockwise_scales_for_cublas(quantize_rows(x, "e4m3"), held.t())  # memoised on the weight
    addresses = (held.data.data_ptr(), held.scale.data_ptr(), layout.data_ptr())
    new_w = torch.randn(384, 256) * 3
    layer.load_fp8_weight(layer.config.quantize_weight(new_w))
    now = layer.fp8_weight()
    assert now is held and (now.data.data_ptr(), now.scale.data_ptr()) == addresses[:2]
    assert now._memo["cublas_scale_t"].data_ptr() == addresses[2]
    fresh = quantize(new_w, "e4m3", (128, 128))
    assert torch.equal(now.data.view(torch.uint8), fresh.data.view(torch.uint8))
    # the layout cuBLAS reads is the new weight's (computed independently from a fresh tensor)
    _, want_layout = blockwise_scales_for_cublas(quantize_rows(x, "e4m3"), fresh.t())
    assert torch.equal(now._memo["cublas_scale_t"], want_layout)
    # the forward uses the new weight: float64 reference from the new FP8 weight's values
    ref = quantize_rows(x, "e4m3").dequantize(torch.float64) @ fresh.dequantize(torch.float64).t()
    # (float32 accumulation over K = 256: ~1e-5 relative; the old weight would be O(1) off)
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-4, atol=1e-4)

"""``fp8rl bench`` (continued): the kernel-level benchmarks a GPU session runs to find where FP8
time goes: the GEMM and quantizer microbenchmark, the decode attention alone, a decode step's
sampling, the host time of one FP8 linear, and the per-kernel profile of one training step
(docs/benchmarks.md, docs/gpu-checks.md). Registered on :data:`fp8rl.bench_cli.bench_app` when imported
(:mod:`fp8rl.cli` imports it)."""

from __future__ import annotations

from typing import Annotated

import typer

from fp8rl.bench_cli import DeviceOpt, ModelOpt, bench_app, echo_report


@bench_app.command("kernels")
def bench_kernels(
    device: DeviceOpt = "auto",
    tokens: Annotated[str, typer.Option(help="token counts M, comma-separated")] = "1,16,64,256,1024,4096",
    shapes: Annotated[
        str, typer.Option(help="INxOUT weight shapes, comma-separated")
    ] = "2048x8192,8192x2048,4096x14336",
    weights: Annotated[
        str,
        typer.Option(
            help="also time a trainer's FP8 weights re-quantized after an optimizer step, each layer "
            "on its own vs the batched call, on this model preset (e.g. 1b; empty: skip)"
        ),
    ] = "",
    kinds: Annotated[
        str, typer.Option(help="the kinds to time, comma-separated (empty: all; bf16 is the baseline)")
    ] = "",
) -> None:
    """Time per call of each GEMM kind (BF16 mm, blockwise, rowwise, tensorwise FP8, wgrad) and of
    the activation quantizer, per token count; GPU time from CUDA-graph replay."""
    from bench import kernels
    from bench.common import pick_device

    def parse_kinds() -> tuple[str, ...]:
        names = tuple(k.strip() for k in kinds.split(",") if k.strip()) or kernels.KINDS
        unknown = [k for k in names if k not in kernels.KINDS]
        if unknown:
            raise ValueError(
                f"--kinds {kinds!r}: {', '.join(unknown)} unknown; choose from {', '.join(kernels.KINDS)}"
            )
        return names

    def parse() -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        try:
            ms = tuple(int(t) for t in tokens.split(","))
            ks = tuple((int(a), int(b)) for a, b in (s.lower().split("x") for s in shapes.split(",")))
        except ValueError as err:
            raise ValueError(
                f"--tokens {tokens!r} / --shapes {shapes!r}: expected e.g. 1,64 and 2048x8192"
            ) from err
        if min(ms) <= 0 or min(min(k) for k in ks) <= 0:
            raise ValueError("--tokens and --shapes take positive sizes")
        return ms, ks

    def report() -> str:
        ms, ks = parse()
        dev = str(pick_device(device))
        table = kernels.report(dev, tokens=ms, shapes=ks, kinds=parse_kinds())
        return table + ("\n\n" + kernels.weight_quantization(weights, dev) if weights else "")

    echo_report(report)


@bench_app.command("decode-attention")
def bench_decode_attention(
    device: DeviceOpt = "auto",
    shapes: Annotated[
        str, typer.Option(help="BxHQxHKVxCONTEXT, comma-separated (head_dim 128)")
    ] = "1024x16x8x160,64x16x8x1056,64x16x8x2080,256x32x8x2064",
    caches: Annotated[str, typer.Option(help="bf16,e4m3 or one of them")] = "bf16,e4m3",
) -> None:
    """The Triton decode attention over a BF16 and an E4M3 cache: GPU time, cache GB/s, and its
    error against float64 per head beside SDPA's (needs CUDA, or TRITON_INTERPRET=1 on CPU)."""
    from bench import decode_attention

    def report() -> str:
        try:
            dims = tuple(tuple(int(x) for x in s.lower().split("x")) for s in shapes.split(","))
        except ValueError as err:
            raise ValueError(f"--shapes {shapes!r}: expected e.g. 64x16x8x1056") from err
        if any(len(d) != 4 or min(d) <= 0 or d[1] % d[2] or d[3] < 2 for d in dims):
            raise ValueError(
                f"--shapes {shapes!r}: four positive sizes B x Hq x Hkv x context each, Hkv dividing Hq, "
                "context >= 2"
            )
        names = tuple(c.strip() for c in caches.split(",") if c.strip())
        return decode_attention.report(device, dims, names)  # type: ignore[arg-type]

    echo_report(report)


@bench_app.command("sampling")
def bench_sampling(
    device: DeviceOpt = "auto",
    rows: Annotated[str, typer.Option(help="batch sizes B, comma-separated")] = "1,64,256,1024",
    vocabs: Annotated[str, typer.Option(help="vocabulary sizes V, comma-separated")] = "49152,128256",
    replays: Annotated[int, typer.Option(help="graph replays per timing")] = 20,
) -> None:
    """One decode step's sampling from [B, V] logits: torch's path against the three Triton
    launches of FP8RL_SAMPLING=triton, GPU time and their ratio (needs CUDA, or
    TRITON_INTERPRET=1 on CPU)."""
    from bench import sampling
    from bench.common import pick_device

    def report() -> str:
        try:
            bs = tuple(int(x) for x in rows.split(","))
            vs = tuple(int(x) for x in vocabs.split(","))
        except ValueError as err:
            raise ValueError(f"--rows {rows!r} / --vocabs {vocabs!r}: expected e.g. 1,64 and 49152") from err
        if min(bs) <= 0 or min(vs) <= 0 or replays <= 0:
            raise ValueError("--rows, --vocabs and --replays take positive numbers")
        if max(bs) * max(vs) > 2**31 // 8:
            raise ValueError(
                f"--rows x --vocabs: at most {2**31 // 8} logits per call (B x V), got {max(bs) * max(vs)}"
            )
        return sampling.report(str(pick_device(device)), bs, vs, replays)

    echo_report(report)


@bench_app.command("host")
def bench_host(
    profile: Annotated[
        str, typer.Option(help="the device profile planned for (sm90-cuda13.0: cuBLAS blockwise)")
    ] = ("sm90-cuda13.0"),
    calls: Annotated[int, typer.Option(help="calls per timing")] = 2000,
    rounds: Annotated[int, typer.Option(help="interleaved rounds (median reported)")] = 5,
) -> None:
    """Host time of the FP8 linear's forward GEMM per call, kernel stubbed (no GPU needed): the
    general fp8_matmul against the GEMM bound once per weight."""
    from bench import host

    def report() -> str:
        if calls <= 0 or rounds <= 0:
            raise ValueError(f"--calls {calls} / --rounds {rounds}: positive numbers")
        return host.report(profile, calls, rounds)

    echo_report(report)


@bench_app.command("profile-train")
def bench_profile_train(
    model: ModelOpt = "tiny",
    device: DeviceOpt = "auto",
    recipes: Annotated[
        str, typer.Option(help="comma-separated recipes; the first is the baseline")
    ] = "bf16,fp8-e2e",
    sequences: Annotated[int, typer.Option(help="sequences in the step (bench step: prompts x group)")] = 512,
    prompt_tokens: Annotated[int, typer.Option(help="prompt tokens per sequence")] = 16,
    new_tokens: Annotated[int, typer.Option(help="response tokens per sequence")] = 64,
    group_size: Annotated[int, typer.Option(help="samples per prompt (divides --sequences)")] = 8,
    micro_batch: Annotated[int, typer.Option(help="sequences per micro-batch (bench step: 64)")] = 64,
    top: Annotated[int, typer.Option(help="kernels listed per recipe")] = 20,
    cover: Annotated[float, typer.Option(help="the share of the difference the change list names")] = 0.9,
) -> None:
    """One training step per recipe under torch.profiler: the top kernels by GPU time (operators
    by CPU time on a CPU), and the kernels that make up each recipe's difference from the first."""
    from bench import profile_train

    names = tuple(r.strip() for r in recipes.split(",") if r.strip())
    echo_report(
        lambda: profile_train.report(
            model,
            device,
            names,
            top,
            cover,
            sequences=sequences,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            group_size=group_size,
            micro_batch=micro_batch,
            progress=lambda msg: typer.echo(msg, err=True),
        )
    )

"""``fp8rl bench``: the performance benchmarks. Each prints ratios against a baseline measured in
the same run (docs/benchmarks.md). Thin, like ``fp8rl.cli``: options in, tables out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

bench_app = typer.Typer(
    help="Performance benchmarks; each prints ratios measured in one run.", no_args_is_help=True
)


@bench_app.command("fp8")
def bench_fp8(
    shapes: Annotated[
        str,
        typer.Option(help="llm | square | all | quick | TOKENSxINxOUT[,...]"),
    ] = "all",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    mode: Annotated[str, typer.Option(help="fwd (forward) | train (forward + backward)")] = "fwd",
    repeat: Annotated[int | None, typer.Option(help="timed runs per shape (median reported)")] = None,
    warmup: Annotated[int | None, typer.Option(help="untimed runs first")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the results as JSON")] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            help="Print which kernel each GEMM would use on this device profile (cpu, sm80, sm89, "
            "sm90-cuda12.9, sm100, ...) and why, without running anything."
        ),
    ] = None,
) -> None:
    """FP8 linear vs BF16 linear at LLM shapes and 8192^3 (activation quantization included)."""
    from bench import fp8

    try:
        shape_list = fp8.parse_shapes(shapes)
        if profile is not None:
            typer.echo(fp8.plan_table(shape_list, profile))
            return
        info, rows = fp8.run(
            shape_list,
            device=device,
            mode=mode,
            warmup=warmup,
            repeat=repeat,
            progress=lambda msg: typer.echo(msg, err=True),
        )
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(fp8.format_table(info, rows))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(fp8.to_json(info, rows))
        typer.echo(f"wrote {json_out}", err=True)


def echo_report(make: Callable[[], str]) -> None:
    """Print a benchmark's table; a bad option (ValueError) exits 2 with the message."""
    try:
        table = make()
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(table)


ModelOpt = Annotated[
    str,
    typer.Option(
        help="tiny (the CPU example's policy) | 100m | 1b | 8b-4l (8B-shaped layers, 4 of them; random init)"
    ),
]
DeviceOpt = Annotated[str, typer.Option(help="auto | cpu | cuda")]
CheckpointOpt = Annotated[
    Path | None, typer.Option(help="A run's checkpoints/step_N directory (default: initial weights).")
]


@bench_app.command("async")
def bench_async(
    spec: Annotated[Path, typer.Argument(help="job spec file (YAML/JSON)")],
    steps: Annotated[int, typer.Option(help="steps of each run")] = 12,
    skip: Annotated[int, typer.Option(help="first steps left out of the timing")] = 2,
    warmup: Annotated[
        bool, typer.Option(help="run the spec's supervised warm-up first, as shipped (--no-warmup: none)")
    ] = True,
) -> None:
    """Steps/s of SPEC synchronously and with rollout.max_staleness 1 (generation overlapping
    training), one trainer and one generator of one core each, and the ratio; the spec as
    shipped, warm-up included and timed after it, and every setting it changed printed."""
    from bench import async_rl

    echo_report(lambda: async_rl.report(spec, steps=steps, skip=skip, warmup=warmup))


@bench_app.command("rollout")
def bench_rollout(
    model: ModelOpt = "tiny",
    device: DeviceOpt = "auto",
    prompts: Annotated[int, typer.Option(help="sequences per generate call")] = 64,
    new_tokens: Annotated[int, typer.Option(help="tokens generated per sequence")] = 32,
    repeat: Annotated[int, typer.Option(help="timed calls per variant (median reported)")] = 3,
    decode: Annotated[
        str | None,
        typer.Option(
            help="eager, graph, graph-triton, comma-separated (default: eager,graph on CUDA, eager on CPU)"
        ),
    ] = None,
    kv_cache: Annotated[
        str | None, typer.Option(help="bf16 | fp8 | bf16,fp8: the KV caches measured [default: bf16,fp8]")
    ] = None,
    variants: Annotated[
        str | None,
        typer.Option(
            help="WEIGHTS/KV pairs instead of --kv-cache, e.g. bf16/bf16,fp8/fp8 (default: all four)"
        ),
    ] = None,
) -> None:
    """Generator tokens/s: BF16 vs FP8 weights, BF16 vs FP8 KV cache, eager vs graph-captured decode;
    same model/prompts/seeds."""
    from bench import rollout

    if kv_cache is not None and variants is not None:
        raise typer.BadParameter("give --variants or --kv-cache, not both", param_hint="--variants")
    decodes = tuple(d.strip() for d in decode.split(",")) if decode else None
    kv_caches = tuple(k.strip() for k in (kv_cache or "bf16,fp8").split(","))
    chosen = tuple(v.strip() for v in variants.split(",")) if variants is not None else None
    options = {
        "prompts": prompts,
        "new_tokens": new_tokens,
        "repeat": repeat,
        "kv_caches": kv_caches,
        "variants": chosen,
    }
    echo_report(lambda: rollout.report(model, device, decodes=decodes, **options))


@bench_app.command("logprobs")
def bench_logprobs(
    batch: Annotated[int, typer.Option(help="sequences")] = 8,
    length: Annotated[int, typer.Option(help="response tokens per sequence")] = 512,
    vocab: Annotated[int, typer.Option(help="vocabulary size (SmolLM2: 49152)")] = 49152,
) -> None:
    """Peak memory and time of the trainer's log-probs (forward + backward) at a real vocabulary:
    the chunked log-softmax against the one-piece form, each in a fresh process (CPU)."""
    from bench import logprobs

    def report() -> str:
        if min(batch, length, vocab) <= 0:
            raise ValueError(f"--batch {batch} / --length {length} / --vocab {vocab}: positive numbers")
        return logprobs.report(batch, length, vocab)

    echo_report(report)


@bench_app.command("step")
def bench_step(
    model: Annotated[
        str,
        typer.Option(
            help="tiny | 100m | 1b | 8b-4l (random init, byte prompts) | smollm2 (SmolLM2-135M-Instruct, "
            "fetched if needed) or a Hugging Face directory: examples/smollm2-addition.yaml's task and batch"
        ),
    ] = "tiny",
    device: DeviceOpt = "auto",
    prompts: Annotated[int | None, typer.Option(help="prompts per step (default: 16; real model 8)")] = None,
    group_size: Annotated[int | None, typer.Option(help="samples per prompt (default: 8)")] = None,
    new_tokens: Annotated[
        int | None, typer.Option(help="tokens generated per sample (default: 16; real model 12)")
    ] = None,
    steps: Annotated[int, typer.Option(help="timed steps per recipe after one warm-up (median)")] = 2,
    recipes: Annotated[
        str | None,
        typer.Option(help="comma-separated recipes (default: all three; real model bf16,fp8-e2e)"),
    ] = None,
    baseline: Annotated[
        bool | None,
        typer.Option(
            help="also time plain transformers on the same batch (float32 log-probs + forward/backward, "
            "generate in BF16) and print the ratios (default: on for a real model)"
        ),
    ] = None,
    kv_cache: Annotated[
        str,
        typer.Option(
            help="the FP8 recipes' KV cache: bf16, fp8 (E4M3, precision.fp8_kv_cache) or bf16,fp8 (each "
            "FP8 recipe twice); bf16 always keeps a BF16 cache"
        ),
    ] = "bf16",
    interleave: Annotated[
        bool,
        typer.Option(
            help="build every recipe first, then run their steps in turn (a shared machine's drift "
            "reaches all recipes alike; holds every recipe's models at once)"
        ),
    ] = False,
) -> None:
    """One RL step of each recipe, split by phase (generation, reward, train, weight sync), with the
    generation's prefill apart from its decode steps."""
    from bench import step

    names = None if recipes is None else tuple(r.strip() for r in recipes.split(",") if r.strip())
    caches = tuple(c.strip() for c in kv_cache.split(",") if c.strip())
    echo_report(
        lambda: step.report(
            model,
            device,
            prompts=prompts,
            group_size=group_size,
            new_tokens=new_tokens,
            steps=steps,
            recipes=names,
            baseline=baseline,
            progress=lambda msg: typer.echo(msg, err=True),
            kv_caches=caches,
            interleave=interleave,
        )
    )


@bench_app.command("sync")
def bench_sync(
    model: Annotated[
        str, typer.Option(help="tiny | 100m | 1b | 8b-4l (random init) | smollm2 or a Hugging Face directory")
    ] = "tiny",
    device: DeviceOpt = "auto",
    repeat: Annotated[int, typer.Option(help="timed syncs per payload (median)")] = 3,
) -> None:
    """Weight sync: FP8 payload vs BF16 (bytes, seconds, GB/s) vs a raw broadcast of the same bytes."""
    from bench import sync

    echo_report(lambda: sync.report(model, device, repeat=repeat))


@bench_app.command("mismatch")
def bench_mismatch(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC", help="Job spec (model, task, rollout).")],
    checkpoint: CheckpointOpt = None,
    batches: Annotated[int, typer.Option(help="Rollout batches per recipe.")] = 5,
    kv_cache: Annotated[
        str | None,
        typer.Option(
            help="FP8 KV-cache variants, comma-separated: off, on (the trainer reads K/V as the cache "
            "holds them), bf16-attn (it attends over BF16 K/V). Default: the spec's setting."
        ),
    ] = None,
    recipes: Annotated[
        str, typer.Option(help="Recipes, comma-separated (the spec's other precision fields apply).")
    ] = "bf16,fp8-gen,fp8-e2e",
) -> None:
    """token_mult_prob_error of bf16, fp8-gen and fp8-e2e on the same weights and prompts."""
    from bench.mismatch import KV_MODES, probe, summary
    from fp8rl.specs import load_spec_or_exit
    from rljob.algorithms import RECIPES

    spec = load_spec_or_exit(spec_path)
    modes = None if kv_cache is None else tuple(k.strip() for k in kv_cache.split(",") if k.strip())
    unknown = [k for k in modes or () if k not in KV_MODES]
    if unknown:
        typer.echo(f"error: --kv-cache {','.join(unknown)}: expected off, on or bf16-attn", err=True)
        raise typer.Exit(2)
    named = [r.strip() for r in recipes.split(",") if r.strip()]
    chosen = tuple(r for r in RECIPES if r in named)  # in the comparison's order
    if not named or len(chosen) != len(set(named)):
        typer.echo(f"error: --recipes {recipes!r}: expected some of {', '.join(RECIPES)}", err=True)
        raise typer.Exit(2)
    try:
        values = probe(spec, checkpoint, batches, modes, chosen)
    except ValueError as err:  # a checkpoint that is not one
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(summary(values))


@bench_app.command("gradients")
def bench_gradients(
    spec_path: Annotated[
        Path, typer.Argument(metavar="SPEC", help="Job spec (model, task, rollout, algorithm).")
    ],
    checkpoint: CheckpointOpt = None,
    variants: Annotated[
        str, typer.Option(help="Comma-separated: bf16, e4m3, hybrid (float32: the reference itself).")
    ] = "bf16,e4m3,hybrid",
    keep_bf16_layers: Annotated[
        str,
        typer.Option(
            metavar="FIRST,LAST",
            help="Decoder layers the FP8 variants keep in BF16 at each end (default 0,0: all FP8; "
            "the spec's own setting is not used).",
        ),
    ] = "0,0",
    batches: Annotated[int, typer.Option(help="RL steps' prompts concatenated into the one batch.")] = 1,
    device: DeviceOpt = "auto",
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the results as JSON.")] = Path(
        "gradients.json"
    ),
) -> None:
    """Per-layer cosine and relative error of BF16 and FP8 weight gradients against float32."""
    from bench import gradients
    from bench.common import pick_device
    from fp8rl.specs import load_spec_or_exit

    spec = load_spec_or_exit(spec_path)
    try:
        names = gradients.parse_variants(variants)
        keep = gradients.parse_keep_layers(keep_bf16_layers)
        result = gradients.audit(spec, checkpoint, names, batches, keep, str(pick_device(device)))
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    spec_keep = ",".join(str(n) for n in result.spec_keep_bf16_layers)
    typer.echo(
        f"gradient fidelity against {gradients.REFERENCE}\n"
        f"spec {spec_path}, checkpoint {checkpoint or '(initial weights)'}; batch: {result.sequences} "
        f"sequences, {result.tokens} response tokens, mean reward {result.reward_mean:.3f}\n"
        f"FP8 variants keep {keep[0]},{keep[1]} decoder layers in BF16 (first,last; the spec says "
        f"{spec_keep}; --keep-bf16-layers to change)\n"
    )
    typer.echo(result.format_table())
    result.write_json(json_out, str(spec_path))
    typer.echo(f"wrote {json_out}", err=True)


@bench_app.command("api")
def bench_api(
    clients: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,10,50",
    requests: Annotated[int, typer.Option(help="Requests per client per operation.")] = 20,
    in_process: Annotated[
        bool, typer.Option(help="Run the service in the clients' process (sharing their GIL).")
    ] = False,
    client: Annotated[
        str, typer.Option(help="HTTP client of the load: stdlib (light, default) or httpx (as fp8rl submit).")
    ] = "stdlib",
) -> None:
    """p50/p99 latency and requests/s of POST and GET /v1/jobs on the embedded default (SQLite)."""
    from bench import api

    try:
        levels = tuple(int(x) for x in clients.split(","))
        if not levels or min(levels) < 1 or requests < 1:
            raise ValueError
    except ValueError as err:
        typer.echo("error: --clients takes positive integers like 1,10,50; --requests >= 1", err=True)
        raise typer.Exit(2) from err
    if client not in api.CLIENTS:
        typer.echo(f"error: --client {client!r}: pick one of {', '.join(api.CLIENTS)}", err=True)
        raise typer.Exit(2)
    typer.echo(api.format_table(api.run(levels, requests, in_process, client)))


@bench_app.command("operator")
def bench_operator(
    jobs: Annotated[int, typer.Option(min=1, max=5000, help="RLJobs to create at once.")] = 100,
) -> None:
    """Time for N RLJobs to have their RayJobs on kmock, against the bare API calls as baseline."""
    try:
        from bench import operator as bench
    except ImportError as err:  # kmock is a development dependency
        typer.echo(f"error: {err}; install the dev extras: pip install -e '.[dev]'", err=True)
        raise typer.Exit(2) from err
    typer.echo(bench.run(jobs).table())


@bench_app.command("graders")
def bench_graders(
    samples: Annotated[int, typer.Option(min=1, max=100_000, help="Samples graded.")] = 512,
    work_ms: Annotated[
        float, typer.Option(min=0.0, max=10_000.0, help="CPU ms the grader takes per sample.")
    ] = 10.0,
    workers: Annotated[
        int | None, typer.Option(min=1, max=256, help="Pool processes (default: the cores).")
    ] = None,
) -> None:
    """A python grader through the sandbox pool against the same function in process, and the
    cost of starting the pool (docs/benchmarks.md)."""
    from bench import graders

    try:
        result = graders.run(samples, work_ms, workers)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from err
    typer.echo(result.table())

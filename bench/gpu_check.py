"""The GPU checklist (``make gpu-check``): one markdown report of what runs on this GPU.

Sections, each independent (a failure is reported and the next section runs):

1. the machine: GPU, capability, torch, CUDA, transformers, and the vLLM / Megatron-Core /
   Transformer Engine versions (the adapters' GPU tests in section 4 need them);
2. kernel probe: every FP8 call kind the dispatch may make, run on this GPU against the emulated
   product: accepted (with its error) or refused (with CUDA's message);
3. the dispatch plan: which kernel each GEMM of an FP8 linear uses here, and why;
4. ``pytest -m gpu`` (sync-debug mode "error" around a generate and a train step is in those tests);
5. ``bench fp8`` (forward and train, LLM shapes and 8192^3), ``bench rollout``, ``bench step``,
   ``bench sync``;
6. a short ``fp8rl run`` of ``examples/arithmetic-gpu.yaml`` for each recipe (needs Ray).

Run on a GPU machine with its own CUDA torch (not the CPU venv): ``python -m bench.gpu_check
--out gpu-check.md``. ``--quick`` shortens the benchmarks; ``--sections`` picks some.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

SECTIONS = (
    "machine",
    "probe",
    "plan",
    "pytest",
    "bench-fp8",
    "kernels",
    "overhead",
    "bench-rollout",
    "bench-step",
    "bench-sync",
    "run",
)


def machine() -> str:
    import transformers

    lines = ["| what | value |", "|---|---|", f"| commit | {commit()} |"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"| GPU | {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs |"
        )
        lines.append(f"| compute capability | {props.major}.{props.minor} |")
    else:
        lines.append("| GPU | none (torch.cuda.is_available() is False) |")
    lines += [
        f"| torch | {torch.__version__} (CUDA {torch.version.cuda}) |",
        f"| torch.nn.functional.scaled_mm | {'yes' if hasattr(torch.nn.functional, 'scaled_mm') else 'no'} |",
        f"| transformers | {transformers.__version__} |",
        f"| python | {platform.python_version()} |",
    ]
    # the engines the adapters target (docker/worker.Dockerfile); their GPU tests skip without them
    from workers.engines.megatron.config import MEGATRON_CORE_VERSION, TRANSFORMER_ENGINE_VERSION
    from workers.engines.vllm.generator import VLLM_VERSION

    targets = (
        ("vllm", VLLM_VERSION),
        ("megatron-core", MEGATRON_CORE_VERSION),
        ("transformer-engine", TRANSFORMER_ENGINE_VERSION),
    )
    for dist, target in targets:
        lines.append(f"| {dist} | {_installed_version(dist)} (adapters target {target}) |")
    return "\n".join(lines)


def commit() -> str:
    """The checkout's git commit: ``FP8RL_GIT_COMMIT`` where the tree travelled without ``.git``
    (bench/gpu_session.sh passes it), else ``git rev-parse HEAD``, else "unknown"."""
    import os

    given = os.environ.get("FP8RL_GIT_COMMIT", "").strip()
    if given:
        return given[:40]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here; set FP8RL_GIT_COMMIT)"
    return out.stdout.strip() if out.returncode == 0 else "unknown (no git here; set FP8RL_GIT_COMMIT)"


def _installed_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30))


def probe() -> str:
    """Call each FP8 kernel kind directly on this GPU; compare with the emulated product."""
    from workers.fp8 import quantize
    from workers.fp8.matmul import blockwise_scaled_mm, lay_out, matmul_emulated

    dev = torch.device("cuda")
    m, k, n = 256, 512, 384
    x, w, g = (torch.randn(m, k, device=dev), torch.randn(n, k, device=dev), torch.randn(m, n, device=dev))
    cases: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []

    def tensorwise(fa: str, fb: str, out: torch.dtype) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            a, b = quantize(x, fa), quantize(w, fb).t()
            got = torch._scaled_mm(a.data, b.data, a.scale, b.scale, out_dtype=out)
            return got, matmul_emulated(a, b)

        return run

    def rowwise(fa: str, fb: str, out: torch.dtype) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            a, b = quantize(x, fa, (1, k)), quantize(w, fb, (1, k)).t()  # one scale per row / column
            got = torch._scaled_mm(a.data, b.data, a.scale.contiguous(), b.scale.contiguous(), out_dtype=out)
            return got, matmul_emulated(a, b)

        return run

    def blockwise(pair: str, out: torch.dtype) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            if pair == "1x128 x 128x128":
                a, b = quantize(x, "e4m3", (1, 128)), quantize(w, "e4m3", (128, 128)).t()
            elif pair == "1x128 x 1x128":  # wgrad: dy.T @ x, both tiled along tokens
                a = quantize(g.t(), "e4m3", (1, 128))
                b = quantize(x.t(), "e4m3", (1, 128)).t()
            else:  # e5m2 x e4m3 (the hybrid recipe's dgrad)
                a, b = quantize(g, "e5m2", (1, 128)), quantize(w, "e4m3", (128, 128))
                b = type(b)(b.data.t().contiguous().t(), b.scale, b.block, b.fmt)
            a2, b2 = lay_out(a, b, 128)
            return blockwise_scaled_mm(a2, b2, out)[: a.shape[0]], matmul_emulated(a, b)

        return run

    for fa, fb in (("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e5m2", "e5m2")):
        cases.append((f"tensorwise {fa} x {fb} -> float32", tensorwise(fa, fb, torch.float32)))
    for fa, fb, out in (
        ("e4m3", "e4m3", torch.float32),
        ("e5m2", "e4m3", torch.float32),
        ("e4m3", "e4m3", torch.bfloat16),
    ):
        cases.append((f"rowwise {fa} x {fb} -> {str(out).replace('torch.', '')}", rowwise(fa, fb, out)))
    for pair in ("1x128 x 128x128", "1x128 x 1x128", "e5m2 1x128 x e4m3 128x128"):
        for out in (torch.bfloat16, torch.float32):
            cases.append((f"blockwise {pair} -> {str(out).replace('torch.', '')}", blockwise(pair, out)))
    lines = ["| call | result |", "|---|---|"]
    for name, run in cases:
        try:
            got, want = run()
            torch.cuda.synchronize()
            lines.append(f"| {name} | accepted, relative error vs emulation {_rel_err(got, want):.2e} |")
        except Exception as err:
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            lines.append(f"| {name} | refused: {type(err).__name__}: {first} |")
    return "\n".join(lines)


def plan() -> str:
    from bench.fp8 import LLM_SHAPES, SQUARE_SHAPES
    from workers.fp8.dispatch import profile_of, simulate
    from workers.fp8.linear import Fp8Linear

    p = profile_of(torch.device("cuda"))
    lines = [f"Device profile: {p.describe()}", "", "| tokens x in x out | gemm | kernel | why |"]
    lines.append("|---|---|---|---|")
    with simulate(p):  # layers on meta (no memory), planned for this GPU
        for m, k, n in [*LLM_SHAPES, *SQUARE_SHAPES]:
            for gemm, gp in Fp8Linear(k, n, bias=False, device="meta").gemm_plans(m).items():
                lines.append(f"| {m}x{k}x{n} | {gemm} | {gp.kernel} | {gp.reason} |")
    return "\n".join(lines)


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def gpu_test_files(root: Path = Path("tests")) -> tuple[list[str], list[str]]:
    """Test files with GPU tests (only these are collected: the rest may need CPU-only extras),
    and the engine test folders left out because their engine is not installed here (their
    tests import it and fail without it, by design: ``make engines`` installs both on CPU)."""
    missing = [d for name, d in ENGINE_DIRS.items() if not _importable(ENGINE_MODULES[name])]
    files = sorted(
        str(p)
        for p in root.rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text() and not any(str(p).startswith(d) for d in missing)
    )
    return files, missing


def run_pytest(log: Path | None = None) -> str:
    if not Path("tests").is_dir():
        return "skipped: no tests/ here (GPU images leave it out); run make gpu-check from a checkout"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rA",
    ]
    files, missing = gpu_test_files()
    out = subprocess.run([*cmd, *files], capture_output=True, text=True, timeout=900)
    if log is not None:  # the whole output (the report keeps its last 40 lines)
        log.write_text(out.stdout + out.stderr)
    tail = "\n".join(out.stdout.strip().splitlines()[-40:])
    left_out = "".join(f"\n\nNot collected: `{d}` (its engine is not installed here)" for d in missing)
    return (
        f"`{' '.join(cmd[2:])} <{len(files)} files>` exit code {out.returncode}{left_out}\n\n"
        f"{engine_tests(out.stdout)}\n\n```\n{tail}\n```"
    )


ENGINE_DIRS = {"vllm": "tests/workers/engines/vllm/", "megatron": "tests/workers/engines/megatron/"}
ENGINE_MODULES = {"vllm": "vllm", "megatron": "megatron.core"}


def engine_tests(pytest_output: str) -> str:
    """Which engine tests ran, from pytest's ``-rA`` summary: per engine (vLLM, Megatron-Core and
    Transformer Engine, the rest), the tests passed, failed and skipped, with the skip reasons. On
    a GPU machine these are what CPU CI cannot run: vLLM's FP8 linears and Transformer Engine."""
    counts = {name: {"passed": 0, "failed": 0, "skipped": 0} for name in (*ENGINE_DIRS, "other")}
    reasons: dict[str, set[str]] = {name: set() for name in counts}

    def engine(path: str) -> str:
        return next((name for name, d in ENGINE_DIRS.items() if path.startswith(d)), "other")

    for line in pytest_output.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR"):
            counts[engine(rest)]["passed" if word == "PASSED" else "failed"] += 1
        elif word == "SKIPPED":  # SKIPPED [n] path:line: reason
            number, _, where = rest.partition(" ")
            path, _, reason = where.partition(": ")
            name = engine(path)
            counts[name]["skipped"] += int(number.strip("[]") or 1)
            reasons[name].add(reason.strip())
    lines = ["| engine tests | passed | failed | skipped (why) |", "|---|---|---|---|"]
    for name, c in counts.items():
        why = f" ({'; '.join(sorted(reasons[name]))})" if reasons[name] else ""
        lines.append(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']}{why} |")
    return "\n".join(lines)


def bench_fp8(quick: bool) -> str:
    from bench import fp8

    shapes = fp8.QUICK_SHAPES if quick else fp8.LLM_SHAPES + fp8.SQUARE_SHAPES
    parts = []
    for mode in ("fwd", "train"):
        info, rows = fp8.run(shapes, device="cuda", mode=mode)
        parts.append(fp8.format_table(info, rows))
    return "```\n" + "\n\n".join(parts) + "\n```"


def kernel_microbench(quick: bool) -> str:
    """GPU time per call of each GEMM kind and of the quantizer (graph replay), per token count:
    which kernel wins in which regime (``bench/kernels.py``)."""
    from bench import kernels

    shapes = kernels.SHAPES[:2] if quick else kernels.SHAPES
    table = kernels.report("cuda", shapes=shapes)
    return "```\n" + table + "\n\n" + kernels.weight_quantization("1b", "cuda") + "\n```"


def overhead() -> str:
    """Host time to issue one linear (what an eager decode step pays per layer) vs its GPU time,
    and the same for each piece of the FP8 linear."""

    def per_call(fn: Callable[[], object], calls: int = 200) -> tuple[float, float]:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls
        torch.cuda.synchronize()
        return host * 1e6, (time.perf_counter() - t0) / calls * 1e6

    lines = ["| tokens x in x out | what | host us/call | GPU us/call |", "|---|---|---|---|"]
    for m, k, n in ((1, 2048, 8192), (256, 2048, 8192), (2048, 2048, 8192)):
        for name, fn in _pieces(m, k, n):
            host, gpu = per_call(fn)
            lines.append(f"| {m}x{k}x{n} | {name} | {host:.1f} | {gpu:.1f} |")
    lines.append("")
    lines.append("GPU us/call: wall time of 200 calls until the GPU finished, per call; when host us is")
    lines.append("close to it, the call is launch-bound (the GPU waits for the host).")
    return "\n".join(lines)


def _pieces(m: int, k: int, n: int) -> list[tuple[str, Callable[[], object]]]:
    from torch import nn

    from workers.fp8.linear import Fp8Linear
    from workers.fp8.matmul import blockwise_scaled_mm, fp8_matmul
    from workers.fp8.quant import quantize_rows

    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    fp8 = Fp8Linear.from_linear(bf16, name="bench")
    fp8.drop_master_weight()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = fp8.fp8_weight()
    xq = quantize_rows(x, "e4m3", rows_multiple=16)
    gemm = fp8.fprop_gemm
    return [
        ("bf16 nn.Linear", lambda: bf16(x)),
        ("fp8 Fp8Linear", lambda: fp8(x)),
        ("  quantize_rows (Triton)", lambda: quantize_rows(x, "e4m3", rows_multiple=16)),
        (
            "  bound GEMM (planned once per weight)",
            lambda: gemm.bound(w, fp8.config, x.device, torch.bfloat16)(xq),
        ),
        (
            "  fp8_matmul (plans and lays out per call)",
            lambda: fp8_matmul(xq, w.t(), out_dtype=torch.bfloat16),
        ),
        ("  F.scaled_mm alone", lambda: blockwise_scaled_mm(xq, w.t(), torch.bfloat16)),
    ]


def data_plane_benches(quick: bool) -> dict[str, Callable[[], str]]:
    """``bench rollout``, ``step`` and ``sync`` at GPU sizes: a ~1B model (``--quick``: ~100M)."""
    from bench import rollout, step, sync

    model = "100m" if quick else "1b"
    tokens = 32 if quick else 256  # the 1B preset: 256 new tokens, a 32k vocabulary (bench.common)

    def rollouts() -> str:
        # 1024 sequences of the 1B model: the graph loops only (eager takes minutes there)
        runs = [(256, rollout.DECODES), (1024, rollout.DECODES if quick else rollout.DECODES[1:])]
        tables = [
            f"{n} sequences\n"
            + rollout.report(model, "cuda", prompts=n, new_tokens=tokens, repeat=2, decodes=decodes)
            for n, decodes in runs
        ]
        return "\n\n".join(tables)

    sections = {
        "bench-rollout": rollouts,
        # the RL step as the issue measures it: 1B, 32k vocabulary, 256 new tokens, graph decode
        "bench-step": lambda: step.report(
            model, "cuda", prompts=64, group_size=8, new_tokens=tokens, steps=2
        ),
        "bench-sync": lambda: sync.report(model, "cuda", repeat=3),
    }

    def fenced(run: Callable[[], str]) -> Callable[[], str]:
        return lambda: "```\n" + run() + "\n```"

    return {name: fenced(run) for name, run in sections.items()}


def run_recipes(quick: bool) -> str:
    import importlib.util
    import json

    from rljob import metrics as m
    from rljob.run_dir import RunDir

    if importlib.util.find_spec("ray") is None:
        return "skipped: ray is not installed in this Python (the GPU worker image has it)"
    if not Path("examples/arithmetic-gpu.yaml").is_file():
        return "skipped: no examples/ here; run make gpu-check from a checkout"
    steps = "3" if quick else "10"
    lines = [
        "| recipe | exit | steps | reward (last) | token_mult_prob_error (mean) | gen tokens/s (last) | "
        "weight sync MiB | KV MiB | generator weights MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe in ("bf16", "fp8-gen", "fp8-e2e"):
        out_dir = Path("runs") / f"gpu-check-{recipe}-{int(time.time())}"
        cmd = [
            sys.executable, "-m", "fp8rl.cli", "run", "examples/arithmetic-gpu.yaml", "--recipe", recipe,
            "--steps", steps, "--output", str(out_dir), "--no-progress",
        ]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        metrics = RunDir(out_dir).metrics
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        rows = [r for r in rows if m.TOKEN_MULT_PROB_ERROR in r]  # RL steps (not a step-0 validation)
        if rows:
            last = rows[-1]
            mismatch = sum(r[m.TOKEN_MULT_PROB_ERROR] for r in rows) / len(rows)
            mib = [last.get(k, 0) / 2**20 for k in (m.WEIGHT_SYNC_BYTES, m.KV_CACHE_BYTES, m.WEIGHTS_BYTES)]
            lines.append(
                f"| {recipe} | {res.returncode} | {len(rows)} | {last['reward/mean']:.3f} | {mismatch:.5f} | "
                f"{last['throughput/generation_tokens_per_s']:.0f} | "
                + " | ".join(f"{x:.1f}" for x in mib)
                + " |"
            )
        else:
            lines.append(f"| {recipe} | {res.returncode} | 0 | | | | | | |")
        if res.returncode != 0:
            lines.append(f"\n```\n{res.stderr[-3000:]}\n```\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check.md"), help="markdown report")
    parser.add_argument("--quick", action="store_true", help="short benchmarks")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    if not torch.cuda.is_available() and set(wanted) - {"machine"}:
        print("error: no CUDA GPU visible (torch.cuda.is_available() is False); run this on a GPU machine")
        return 2
    runners: dict[str, Callable[[], str]] = {
        "machine": machine,
        "probe": probe,
        "plan": plan,
        "pytest": lambda: run_pytest(args.out.with_suffix(".pytest.log")),
        "bench-fp8": lambda: bench_fp8(args.quick),
        "kernels": lambda: kernel_microbench(args.quick),
        "overhead": overhead,
        **data_plane_benches(args.quick),
        "run": lambda: run_recipes(args.quick),
    }
    report = [f"# fp8rl GPU checklist ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    failed = []
    for name in wanted:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            body = runners[name]()
        except Exception:
            body = "FAILED\n\n```\n" + traceback.format_exc()[-4000:] + "\n```"
            failed.append(name)
        report += [f"## {name} ({time.perf_counter() - start:.0f} s)", "", body, ""]
        print(body, flush=True)
        args.out.write_text("\n".join(report))
    print(f"wrote {args.out}" + (f"; failed sections: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

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

from bench import gpu_sections as sections
from workers.job.numerics import installed_version

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
        lines.append(
            f"| {dist} | {installed_version((dist,)) or 'not installed'} (adapters target {target}) |"
        )
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
        "bench-fp8": lambda: sections.bench_fp8(args.quick),
        "kernels": lambda: sections.kernel_microbench(args.quick),
        "overhead": sections.overhead,
        **sections.data_plane_benches(args.quick),
        "run": lambda: sections.run_recipes(args.quick),
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

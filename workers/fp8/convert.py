"""Swap a model's linear layers for :class:`Fp8Linear`, and say exactly what was and wasn't swapped.

Rules (the anchors': NeMo RL, DeepSeek-V3):
- Linear layers inside the decoder blocks (attention q/k/v/o, MLP gate/up/down) become FP8.
- Embeddings, ``lm_head`` and norms stay in the model's dtype (BF16): they are a small share of
  the FLOPs and the most sensitive to precision.
- The first/last N decoder layers can be kept in BF16 (``keep_bf16``), and names can be excluded
  by pattern (``skip``).
- A linear layer whose dims are not multiples of 16 stays BF16: FP8 tensor-core GEMMs need that.

Every module that holds parameters gets one row in the :class:`Fp8Audit`, FP8 or not, with the
reason. Frameworks that fall back to BF16 silently make FP8 runs that are not FP8; the audit is
printed at the start of every run and written next to its metrics.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from rljob.algorithms import RECIPES
from rljob.spec import bf16_layer_reason
from workers.fp8.dispatch import profile_of
from workers.fp8.input_stats import InputStats
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class AuditRow:
    """One parameter-holding module: its precision after conversion and why."""

    name: str
    kind: str  # linear | lm_head | embedding | norm | other
    precision: str  # fp8 | bf16 | float32 | ... (the dtype the module keeps)
    reason: str
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    # FP8 layers: the kernel of each GEMM on the model's device ({"fprop": "cublas_blockwise", ...})
    kernels: dict[str, str] = field(default_factory=dict)
    # linear layers: max |W| of the weight as converted (None: not a linear, or on the meta device)
    weight_amax: float | None = None
    # linear layers, after Fp8Audit.with_inputs: the input activations on a calibration batch
    # (workers/fp8/input_stats.py): max |x|, and max over input channels c of
    # max|x[:, c]| / p99.9(|x[:, c]|) (nearest rank) with the channel c that attains it
    input_amax: float | None = None
    outlier_ratio: float | None = None
    outlier_channel: int | None = None


@dataclass
class Fp8Audit:
    """Per-layer quantization audit of one model."""

    recipe: str
    rows: list[AuditRow] = field(default_factory=list)
    device: str = "CPU"  # the device profile the kernels were planned for
    # why each (gemm, kernel) was chosen, e.g. {"fprop: emulate": "CPU: ..."}
    kernel_reasons: dict[str, str] = field(default_factory=dict)
    # the FP8 layers' formats, e.g. "E4M3 weights and activations, E4M3 gradients" ("" if none)
    formats: str = ""
    # where the input statistics come from, e.g. "32 prompts, 1480 tokens" ("": not measured)
    calibration: str = ""

    def with_inputs(self, stats: Mapping[str, InputStats], calibration: str = "") -> Fp8Audit:
        """This audit with each linear row's input statistics filled in from ``stats`` (by module
        name, as :func:`~workers.fp8.input_stats.measure_inputs` returns them)."""
        rows = [
            replace(r, input_amax=s.amax, outlier_ratio=s.outlier_ratio, outlier_channel=s.outlier_channel)
            if (s := stats.get(r.name)) is not None
            else r
            for r in self.rows
        ]
        return replace(self, rows=rows, calibration=calibration)

    def top_outliers(self, n: int = 5) -> list[AuditRow]:
        """The ``n`` rows with the largest outlier ratio, largest first."""
        measured = [r for r in self.rows if r.outlier_ratio is not None]
        return sorted(measured, key=lambda r: -float(r.outlier_ratio or 0.0))[:n]

    @property
    def fp8_layers(self) -> list[str]:
        return [r.name for r in self.rows if r.precision == "fp8"]

    def summary(self) -> dict[str, int | float | str]:
        fp8 = [r for r in self.rows if r.precision == "fp8"]
        linear = [r for r in self.rows if r.kind in ("linear", "lm_head")]
        before = sum(r.bytes_before for r in self.rows)
        after = sum(r.bytes_after for r in self.rows)
        return {
            "recipe": self.recipe,
            "fp8_layers": len(fp8),
            "linear_layers": len(linear),
            "bytes_before": before,
            "bytes_after": after,
            "fp8_param_fraction": (
                sum(_numel(r.shape) for r in fp8) / max(1, sum(_numel(r.shape) for r in self.rows))
            ),
        }

    def to_dict(self) -> dict[str, object]:
        return {
            "summary": self.summary(),
            "device": self.device,
            "kernel_reasons": self.kernel_reasons,
            "calibration": self.calibration,
            "layers": [asdict(r) for r in self.rows],
        }

    def format(self) -> str:
        """A fixed-width table, one row per module, then a summary line."""
        header = (
            f"{'layer':<48} {'kind':<9} {'precision':<9} {'shape':<14} {'kernels':<24} "
            f"{'w amax':>8} {'x amax':>8} {'outlier@ch':>12}  reason"
        )
        lines = [header, "-" * len(header)]
        for r in self.rows:
            shape = "x".join(str(d) for d in r.shape)
            kernels = "/".join(_SHORT.get(k, k) for k in r.kernels.values()) or "-"
            outlier = "-" if r.outlier_ratio is None else f"{r.outlier_ratio:.3g}@{r.outlier_channel}"
            lines.append(
                f"{r.name:<48} {r.kind:<9} {r.precision:<9} {shape:<14} {kernels:<24} "
                f"{_num(r.weight_amax):>8} {_num(r.input_amax):>8} {outlier:>12}  {r.reason}"
            )
        s = self.summary()
        lines.append(
            f"recipe {s['recipe']}: {s['fp8_layers']}/{s['linear_layers']} linear layers in FP8, "
            f"{float(s['fp8_param_fraction']):.1%} of parameters; weights "
            f"{_mib(int(s['bytes_before']))} -> {_mib(int(s['bytes_after']))}"
        )
        if self.formats:
            lines.append(f"FP8 formats: {self.formats}")
        if self.calibration:
            top = ", ".join(
                f"{r.name} {_num(r.outlier_ratio)}@{r.outlier_channel}" for r in self.top_outliers(3)
            )
            lines.append(
                f"input statistics on {self.calibration}; outlier = max over input channels of "
                f"max|x| / p99.9|x| (nearest rank); largest: {top}"
            )
        if self.kernel_reasons:
            gemms = "/".join(next(r.kernels for r in self.rows if r.kernels))
            lines.append(f"FP8 GEMM kernels ({gemms}) on {self.device}:")
            lines += [f"  {key}: {why}" for key, why in self.kernel_reasons.items()]
        return "\n".join(lines)


def _formats(cfg: Fp8LinearConfig, gemms: tuple[str, ...]) -> str:
    """The FP8 formats and scalings in words, e.g. for the audit's footer."""

    def scaling(block: tuple[int, int] | None) -> str:
        return "per tensor" if block is None else "x".join(map(str, block))

    words = (
        f"{cfg.forward_fmt.upper()} weights ({scaling(cfg.weight_block)} blocks) and activations "
        f"({scaling(cfg.activation_block)} tiles)"
    )
    if "dgrad" in gemms or "wgrad" in gemms:
        words += f", {cfg.grad_fmt.upper()} gradients ({scaling(cfg.grad_block)} tiles)"
    return words


_SHORT = {
    "cublas_blockwise": "blockwise",
    "scaled_mm_rowwise": "rowwise",
    "scaled_mm_tensorwise": "tensorwise",
    "emulate": "emulate",
    "emulate_bf16": "emulate-bf16",
}


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _param_bytes(module: nn.Module, seen: set[int]) -> int:
    """Bytes of the module's own parameters not counted yet (tied weights count once)."""
    total = 0
    for p in module.parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _fp8_bytes(layer: nn.Linear, cfg: Fp8LinearConfig) -> int:
    out_f, in_f = layer.weight.shape
    if cfg.weight_block is None:
        n_scales = 1
    else:
        br, bc = cfg.weight_block
        n_scales = -(-out_f // br) * -(-in_f // bc)
    bias = layer.bias.numel() * layer.bias.element_size() if layer.bias is not None else 0
    return out_f * in_f + 4 * n_scales + bias


def _kind(name: str, module: nn.Module, lm_head_names: set[str]) -> str:
    cls = type(module).__name__.lower()
    if isinstance(module, nn.Embedding):
        return "embedding"
    if name in lm_head_names or name.split(".")[-1] == "lm_head":
        return "lm_head"
    if "norm" in cls or "norm" in name.split(".")[-1]:
        return "norm"
    if isinstance(module, nn.Linear | Fp8Linear):
        return "linear"
    return "other"


def _num_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    found = [int(m.group(1)) for name, _ in model.named_modules() if (m := _LAYER_INDEX.search(name + "."))]
    return max(found) + 1 if found else 0


def _lm_head_names(model: nn.Module) -> set[str]:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return {name for name, m in model.named_modules() if head is not None and m is head}


def _keep_range(keep_bf16: int | tuple[int, int]) -> tuple[int, int]:
    first, last = (keep_bf16, keep_bf16) if isinstance(keep_bf16, int) else keep_bf16
    if first < 0 or last < 0:
        raise ValueError(f"keep_bf16={keep_bf16!r}: layer counts must be >= 0")
    return first, last


def check_bf16_layers(bf16_layers: Iterable[int], n_layers: int) -> None:
    """Refuse ``precision.bf16_layers`` that name a layer the model does not have (every engine
    that honours them asks this)."""
    beyond = sorted(i for i in set(bf16_layers) if not 0 <= i < n_layers)
    if beyond:
        raise ValueError(
            f"precision.bf16_layers {beyond}: the model has decoder layers 0-{n_layers - 1}; "
            "name layers in that range"
        )


def _fp8_decision(
    name: str,
    layer: nn.Linear,
    n_layers: int,
    keep: tuple[int, int],
    skip: Iterable[str],
    named: frozenset[int] = frozenset(),
) -> str | None:
    """None if the layer goes FP8, else the reason it stays in high precision."""
    for pattern in skip:
        if fnmatch.fnmatch(name, pattern):
            return f"skipped by pattern {pattern!r}"
    m = _LAYER_INDEX.search(name)
    if m is not None and (reason := bf16_layer_reason(int(m.group(1)), n_layers, keep, named)):
        return reason
    out_f, in_f = layer.weight.shape
    if in_f % 16 or out_f % 16:
        return f"shape {out_f}x{in_f} not a multiple of 16 (FP8 GEMMs need it)"
    return None


def convert_model(
    model: nn.Module,
    recipe: str = "fp8-e2e",
    keep_bf16: int | tuple[int, int] = 0,
    skip: Iterable[str] = (),
    config: Fp8LinearConfig | None = None,
    verbose: bool = False,
    gemms: tuple[str, ...] = ("fprop", "dgrad", "wgrad"),
    bf16_layers: Iterable[int] = (),
) -> Fp8Audit:
    """Swap the decoder's ``nn.Linear`` layers for :class:`Fp8Linear` in place; return the audit.

    Args:
        model: a Hugging Face Llama/Qwen2 model (or any module with ``layers.<i>.`` names).
        recipe: ``bf16`` converts nothing (the audit says so); ``fp8-gen`` and ``fp8-e2e``
            convert (the caller decides which engines get an FP8 model).
        keep_bf16: keep the first and last N decoder layers in BF16: an int for both ends, or
            ``(first, last)``.
        skip: ``fnmatch`` patterns of module names to keep in BF16.
        config: quantization settings for the new layers.
        verbose: print the audit table.
        gemms: which GEMMs' kernels the audit shows (a generator only runs ``fprop``).
        bf16_layers: decoder layers kept in BF16 by index (``precision.bf16_layers``); each must
            be a layer of the model.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not one of {RECIPES}")
    cfg = config or Fp8LinearConfig()
    keep = _keep_range(keep_bf16)
    skip = tuple(skip)
    n_layers = _num_layers(model)
    named = frozenset(bf16_layers)
    check_bf16_layers(named, n_layers)
    heads = _lm_head_names(model)
    audit = Fp8Audit(recipe=recipe)
    seen: set[int] = set()
    amax: dict[str, torch.Tensor] = {}  # linear name -> max |W| (0-d, on the weight's device)
    for name, module in list(model.named_modules()):
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        kind = _kind(name, module, heads)
        if isinstance(module, nn.Linear):
            amax[name] = module.weight.detach().abs().amax()
        before = _param_bytes(module, seen)
        dtype = str(next(module.parameters(recurse=False)).dtype).replace("torch.", "")
        shape = tuple(getattr(module, "weight", next(module.parameters(recurse=False))).shape)
        if isinstance(module, Fp8Linear):
            audit.rows.append(AuditRow(name, kind, "fp8", "already FP8", shape, before, before))
            continue
        reason: str | None
        if kind == "embedding":
            reason = "embeddings stay high precision"
        elif kind == "lm_head":
            reason = "lm_head stays high precision (logits are precision-sensitive)"
        elif kind == "norm":
            reason = "norms stay high precision"
        elif kind != "linear" or not isinstance(module, nn.Linear):
            reason = f"{type(module).__name__} has no FP8 implementation"
        elif recipe == "bf16":
            reason = "recipe bf16"
        else:
            reason = _fp8_decision(name, module, n_layers, keep, skip, named)
        if reason is None and isinstance(module, nn.Linear):
            layer = Fp8Linear.from_linear(module, cfg, name=name)
            _replace(model, name, layer)
            after = _fp8_bytes(module, cfg)
            plans = {g: p for g, p in layer.gemm_plans().items() if g in gemms}
            audit.device = profile_of(module.weight.device).describe()
            for g, p in plans.items():
                audit.kernel_reasons.setdefault(f"{g}: {p.kernel}", p.reason)
            kernels: dict[str, str] = {g: p.kernel for g, p in plans.items()}
            audit.formats = _formats(cfg, gemms)
            audit.rows.append(AuditRow(name, kind, "fp8", "decoder linear", shape, before, after, kernels))
        else:
            audit.rows.append(AuditRow(name, kind, dtype, reason or "", shape, before, before))
    audit.rows = _with_weight_amax(audit.rows, amax)
    if verbose:
        print(audit.format())
    return audit


def _with_weight_amax(rows: list[AuditRow], amax: dict[str, torch.Tensor]) -> list[AuditRow]:
    """``rows`` with each linear's max |W| (one host transfer for all; none from the meta device)."""
    real = {n: a for n, a in amax.items() if a.device.type != "meta"}
    if not real:
        return rows
    device = next(iter(real.values())).device
    values = dict(zip(real, torch.stack([a.float().to(device) for a in real.values()]).tolist(), strict=True))
    return [replace(r, weight_amax=values[r.name]) if r.name in values else r for r in rows]


def drop_master_weights(model: nn.Module) -> int:
    """Make every :class:`Fp8Linear` of an inference-only model (a generator) hold its FP8 weight
    alone; returns how many layers changed. See :meth:`Fp8Linear.drop_master_weight`."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.drop_master_weight()
    return len(layers)


def weight_bytes(model: nn.Module) -> int:
    """Bytes ``model``'s weights hold in memory: parameters and buffers with storage (each storage
    once), plus every :class:`Fp8Linear`'s FP8 copies (data, scales, and a CPU dequantization
    cache where the emulated GEMM made one)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            total += m.fp8_allocated_bytes()
    return total


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)

"""Checkpoints of a run: ``<output>/checkpoints/step_<N>/`` with ``trainer.pt`` and ``state.json``.

A checkpoint is written into a temporary directory and renamed into place only when complete,
so a crash while saving leaves the previous checkpoint intact. The newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rljob.run_dir import RunDir

_PREFIX = "step_"


def checkpoint_root(output_dir: Path) -> Path:
    return RunDir(output_dir).checkpoints


def begin(output_dir: Path, step: int) -> Path:
    """A fresh temporary directory to write the checkpoint of ``step`` into."""
    tmp = checkpoint_root(output_dir) / f".tmp-{_PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(output_dir: Path, tmp: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state.json`` into ``tmp`` and move it into place as ``step_<step>``."""
    (tmp / "state.json").write_text(json.dumps({"step": step, "time": time.time(), **state}, indent=2))
    final = checkpoint_root(output_dir) / f"{_PREFIX}{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old[1], ignore_errors=True)
    return final


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(_PREFIX) and (p / "state.json").is_file():
            try:
                found.append((int(p.name.removeprefix(_PREFIX)), p))
            except ValueError:
                continue
    return sorted(found)


def latest(output_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def load_master_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a checkpoint: a run's ``checkpoints/step_N`` directory (its
    ``trainer.pt``) or a file holding ``{"model": state_dict}``."""
    path = checkpoint / "trainer.pt" if checkpoint.is_dir() else checkpoint
    if not path.is_file():
        what = "trainer.pt in that directory" if checkpoint.is_dir() else "such file"
        raise ValueError(
            f"--checkpoint {checkpoint}: no {what}; "
            "give a run's checkpoints/step_N directory (e.g. runs/arithmetic/checkpoints/step_00000050)"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"--checkpoint {path}: not a trainer checkpoint (no 'model' state dict)")
    return dict(state["model"])

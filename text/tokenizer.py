"""Text <-> token ids and chat templates, for GGUF files and Hugging Face tokenizer folders.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library) and adds what serving needs on
top: the BOS/EOS ids that end a turn, and chat templates rendered exactly as Hugging Face
renders them (a sandboxed jinja2 environment with `trim_blocks`/`lstrip_blocks`,
`raise_exception`, a non-escaping `tojson`, `strftime_now`, and the special-token strings as
variables).

Two ways in:

* `Tokenizer.from_hf_dir(path)`: `tokenizer.json` + `tokenizer_config.json` (+ optional
  `chat_template.jinja` and `generation_config.json`).
* `Tokenizer.from_gguf_fields(data)`: the `tokenizer.ggml.*` metadata of a GGUF file. Only
  byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported; SentencePiece
  (`"llama"`) and others raise `UnsupportedTokenizerError`. The pre-tokenizer split follows
  llama.cpp's `tokenizer.ggml.pre`:

      pre value                                      split applied before byte-level BPE
      None, "default", "gpt2"                        GPT-2 regex
      "smollm", "starcoder", "refact", "codeshell"   every \\p{N} alone, then the GPT-2 regex
      "llama-bpe", "llama3", "llama-v3", "dbrx",     Llama-3 regex (digits in runs of <= 3)
      "smaug-bpe", "falcon3"
      "qwen2", "deepseek-r1-qwen"                    Qwen2 regex (every digit alone)

  Any other value raises `UnsupportedTokenizerError` rather than silently mis-tokenizing.

A tokenizer is immutable after construction (but for the byte table it builds once, on
first use) and safe to share between requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from text.gguf_metadata import GGUFTokenizerData
from text.tool_prompt import (ChatTurn, ToolFunction, folded_messages, template_knows_tools,
                              template_messages, template_tools)
from text.token_bytes import TokenBytes

TOKEN_TYPE_CONTROL = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL: special, e.g. <|im_start|>
TOKEN_TYPE_USER_DEFINED = 4  # added but not special, e.g. <think>

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex splits applied in order (llama.cpp runs each split over the
# pieces the previous one produced; tokenizers' Sequence of Split does the same).
_PRE_SPLITS: dict[str | None, tuple[str, ...]] = {
    None: (_GPT2_SPLIT,),
    "default": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "codeshell")},
    **{name: (_LLAMA3_SPLIT,) for name in
       ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3")},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen")},
}


class UnsupportedTokenizerError(ValueError):
    """The file describes a tokenizer this module cannot reproduce faithfully."""


class Tokenizer:
    """Encode/decode plus chat templates. Immutable; build with `from_hf_dir`/`from_gguf_fields`."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], add_bos_token: bool,
                 chat_template: str | None, special_token_strings: dict[str, str]) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        # bos_token/eos_token/... as the template sees them (HF passes the special tokens map)
        self._special_token_strings = dict(special_token_strings)
        self._compiled_template: Any = None  # compiled lazily: most callers never render chats
        # Built on first use (a pass over the vocabulary): (table,) once built, the table
        # None where the decoder is not plain byte-level.
        self._token_bytes: tuple[TokenBytes | None] | None = None

    # ---- basic operations -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token strings in `text` (e.g. "<|im_start|>") always become their one id.

        Through `encode_batch`, which runs the Rust code with the interpreter lock released
        (the single `encode` holds it throughout: 0.34 s for a 660 kB prompt, every other
        thread of the process stopped meanwhile, the gateway's event loop included); the
        same ids, and no slower for a short text."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids if type(ids) is list else list(ids),
                                    skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> TokenBytes | None:
        """Each token's bytes (special tokens skipped) where the text of any ids is their
        bytes decoded as UTF-8 (text/token_bytes.py); None otherwise. Built once, on the
        first call (0.12 s for the default model's 49k vocabulary): call it at start-up."""
        if self._token_bytes is None:
            self._token_bytes = (TokenBytes.try_build(self._backend),)
        return self._token_bytes[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, object]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> str:
        """Renders `messages` with the model's template, as `transformers` would."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt, **self._special_token_strings)

    def encode_chat(self, messages: Sequence[Mapping[str, object]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Template then encode. Templates usually write BOS themselves, so the text is encoded
        without special tokens and BOS is added only when the model wants one and it is absent."""
        return self._encode_rendered(self.apply_chat_template(messages, add_generation_prompt))

    def encode_tool_chat(self, turns: Sequence[ChatTurn],
                         functions: tuple[ToolFunction, ...]) -> list[int]:
        """A conversation with tools (text/tool_prompt.py), with the generation prompt: the
        template renders `tools` itself when it knows them, else they are folded into the
        system prompt, Hermes style."""
        if self.chat_template is not None and template_knows_tools(self.chat_template):
            text = self.apply_chat_template(template_messages(tuple(turns)), True,
                                            template_tools(functions))
        else:
            text = self.apply_chat_template(folded_messages(tuple(turns), functions), True)
        return self._encode_rendered(text)

    def _encode_rendered(self, text: str) -> list[int]:
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, data: GGUFTokenizerData) -> Tokenizer:
        model_name = data.model or "gpt2"  # files without the key predate other models
        if model_name != "gpt2" or not data.merges:
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer model {model_name!r} (merges: {len(data.merges)}) is not supported; "
                "only byte-level BPE ('gpt2') vocabularies are")
        if data.pre not in _PRE_SPLITS:
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer.ggml.pre {data.pre!r} is not supported; known: "
                f"{sorted(k for k in _PRE_SPLITS if k)}")
        if data.token_types and len(data.token_types) != len(data.tokens):
            raise ValueError(f"GGUF tokenizer: {len(data.token_types)} token types for "
                             f"{len(data.tokens)} tokens")
        vocab = {token: i for i, token in enumerate(data.tokens)}
        merges = []
        for merge in data.merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ValueError(f"GGUF tokenizer: malformed merge {merge!r}")
            merges.append((left, right))
        backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")
                  for pattern in _PRE_SPLITS[data.pre]]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()

        types = data.token_types or [1] * len(data.tokens)
        # Control tokens must match whole in text, or "<|im_start|>" would be cut into pieces.
        backend.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(data.tokens, types) if kind == TOKEN_TYPE_CONTROL])
        backend.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(data.tokens, types) if kind == TOKEN_TYPE_USER_DEFINED])

        bos_id = data.bos_token_id
        add_bos = bool(data.add_bos_token) and bos_id is not None
        if add_bos and bos_id is not None:
            bos = data.tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)])
        strings = {}
        for name, token_id in (("bos_token", bos_id), ("eos_token", data.eos_token_id),
                               ("unk_token", data.unknown_token_id),
                               ("pad_token", data.padding_token_id)):
            if token_id is not None and 0 <= token_id < len(data.tokens):
                strings[name] = data.tokens[token_id]
        eos_ids = (data.eos_token_id,) if data.eos_token_id is not None else ()
        return cls(backend, bos_token_id=bos_id,
                   eos_token_ids=_with_turn_end(eos_ids, data.chat_template, backend),
                   add_bos_token=add_bos, chat_template=data.chat_template,
                   special_token_strings=strings)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: missing (a Hugging Face tokenizer folder "
                                    "needs tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust error says what is wrong, not which file
            raise ValueError(f"{tokenizer_file}: cannot be parsed: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json", required=False)
        generation = _read_json(root / "generation_config.json", required=False)

        chat_template = _pick_template(config.get("chat_template"), root / "tokenizer_config.json")
        template_file = root / "chat_template.jinja"
        if template_file.is_file():  # transformers saves templates here and prefers this file
            chat_template = template_file.read_text(encoding="utf-8")

        strings = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = _token_content(config.get(name))
            if value is not None:
                strings[name] = value
        bos_id = backend.token_to_id(strings["bos_token"]) if "bos_token" in strings else None
        eos_ids: list[int] = []
        if "eos_token" in strings and (eos := backend.token_to_id(strings["eos_token"])) is not None:
            eos_ids.append(eos)
        gen_eos = generation.get("eos_token_id")
        for token_id in (gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []):
            if token_id not in eos_ids:
                eos_ids.append(int(token_id))
        # Whether BOS is added is decided by tokenizer.json's post-processor; observe it.
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and probe[:1] == [bos_id]
        return cls(backend, bos_token_id=bos_id,
                   eos_token_ids=_with_turn_end(tuple(eos_ids), chat_template, backend),
                   add_bos_token=add_bos, chat_template=chat_template,
                   special_token_strings=strings)


def _with_turn_end(eos_ids: tuple[int, ...], chat_template: str | None,
                   backend: tokenizers.Tokenizer) -> tuple[int, ...]:
    """Adds the token that ends an assistant turn: a chat model stops there even when the
    file's EOS is <|endoftext|>."""
    result = list(eos_ids)
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if chat_template and marker in chat_template:
            token_id = backend.token_to_id(marker)
            if token_id is not None and token_id not in result:
                result.append(token_id)
    return tuple(result)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: missing")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _pick_template(value: Any, source: Path) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" wins."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{source}: chat_template list has no 'default' entry "
                         f"(names: {sorted(n for n in named if n)})")
    raise ValueError(f"{source}: chat_template must be a string or a list, got {type(value).__name__}")


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> Any:
    import jinja2  # only needed by chat requests
    import jinja2.ext
    import jinja2.nodes
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja's own tojson HTML-escapes, which would change the prompt the model sees
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
        transformers; for serving only its body matters."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from exc

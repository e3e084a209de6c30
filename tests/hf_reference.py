"""The independent reference for the default model: `transformers`' own GGUF loader,
tokenizer and chat template, and a greedy loop over its own KV cache.

Nothing here touches pdserve's engine: the weights are dequantized by transformers, the
prompt is tokenized by its tokenizer (from the same file's metadata), and generation stops
at the tokenizer's end-of-turn token exactly as OpenAI-style servers do (the stop token is
generated, counted in `completion_tokens`, and left out of the text).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch


@dataclass(frozen=True)
class Greedy:
    """One greedy continuation: every generated token (a stop token included), its text
    without special tokens, and why it ended ("stop" or "length")."""

    token_ids: list[int]
    text: str
    finish_reason: str


@contextlib.contextmanager
def _one_parse_of_the_file() -> Iterator[None]:
    """While the reference loads, gguf's reader and tensor name map are made once each.

    transformers parses the GGUF file's header afresh for the tokenizer, the config and the
    weights (a 49k-token vocabulary, ~4 s each), and rebuilds the tensor name map for each
    of the model's ~400 submodules (~8 s in all): half of the reference's load time. Both
    are pure functions of their arguments (the reader maps the file read-only); what is
    read, and how it is dequantized and converted, stays transformers' and gguf's own."""
    import gguf

    readers: dict[str, gguf.GGUFReader] = {}
    make_reader = gguf.GGUFReader

    def reader(path: str, mode: str = "r") -> gguf.GGUFReader:
        assert mode == "r", mode
        if str(path) not in readers:
            readers[str(path)] = make_reader(path, mode)
        return readers[str(path)]

    with mock.patch("gguf.GGUFReader", reader), \
            mock.patch("gguf.get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


class HFReference:
    """transformers' LlamaForCausalLM and tokenizer for the default GGUF file (fp32)."""

    @classmethod
    def shared(cls, directory: Path) -> HFReference:
        """One conversion per test run: the first test process to ask builds the reference
        from the GGUF file and saves it in `directory` (transformers' `save_pretrained`), the
        others wait for it and load that copy (~1 s instead of ~14 s of CPU each)."""
        directory.mkdir(parents=True, exist_ok=True)
        saved = directory / "model"
        with open(directory / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (saved / "complete").exists():
                return cls(saved)
            reference = cls()
            reference.model.save_pretrained(saved)
            reference.tokenizer.save_pretrained(saved)
            (saved / "complete").touch()
            return reference

    def __init__(self, saved: Path | None = None) -> None:
        """From the default GGUF file, or from a copy `shared` saved."""
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # transformers < 5
            from transformers.modeling_utils import no_init_weights

        from text.default_model import default_model_path

        path = default_model_path()
        self.path = path
        # The longest run so far per (prompt, ignore_eos): greedy decoding is deterministic,
        # so a shorter run is its prefix (several test modules ask for the same prompts).
        self._runs: dict[tuple[tuple[int, ...], bool], Greedy] = {}
        if saved is not None:
            self.tokenizer = AutoTokenizer.from_pretrained(str(saved))
            self.model = LlamaForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
            self.stop_ids = {int(self.tokenizer.eos_token_id)}
            return
        with _one_parse_of_the_file():
            self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            config = LlamaConfig(**load_gguf_checkpoint(str(path))["config"])
            with no_init_weights():  # every weight is overwritten from the file just below
                self.model = LlamaForCausalLM(config).eval()
            tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                           model_to_load=self.model)["tensors"]
        result = self.model.load_state_dict(tensors, strict=False)
        # Tied embeddings: the head is the embedding, so it is the only key the file lacks.
        assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
        self.model.tie_weights()
        self.stop_ids = {int(self.tokenizer.eos_token_id)}

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt an assistant turn is generated after, by the file's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 return_dict=False)
        return [int(i) for i in ids]

    def prompt_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> Greedy:
        """Argmax decoding through transformers' KV cache, up to `max_tokens` tokens (on one
        thread: the suite shares two cores with the servers under test); a prefix of a
        longer run of the same prompt when there was one."""
        key = (tuple(prompt), ignore_eos)
        known = self._runs.get(key)
        if known is not None and (len(known.token_ids) >= max_tokens
                                  or known.finish_reason == "stop"):
            tokens = known.token_ids[:max_tokens]
            stopped = not ignore_eos and tokens[-1] in self.stop_ids
            return Greedy(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                          "stop" if stopped else "length")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run = self._greedy(prompt, max_tokens, ignore_eos)
        finally:
            torch.set_num_threads(threads)
        self._runs[key] = run
        return run

    def _greedy(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> Greedy:
        out: list[int] = []
        finish = "length"
        with torch.no_grad():
            result = self.model(torch.tensor([prompt]), use_cache=True)
            while len(out) < max_tokens:
                token = int(result.logits[0, -1].argmax())
                out.append(token)
                if not ignore_eos and token in self.stop_ids:
                    finish = "stop"
                    break
                result = self.model(torch.tensor([[token]]),
                                    past_key_values=result.past_key_values, use_cache=True)
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        return Greedy(out, text, finish)

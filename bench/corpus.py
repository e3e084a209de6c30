"""Real English text cut into prompts of a target token length.

The shipped text (`data/corpus.txt`, about 28 KB) is public domain: the Declaration of
Independence, the Preamble and Bill of Rights of the US Constitution, the Gettysburg Address,
Lincoln's Second Inaugural, Genesis 1 and Psalm 23 (King James Version), and the openings of
Pride and Prejudice, A Tale of Two Cities and Moby-Dick. Real text keeps tokenizers on their
ordinary path (no degenerate repeated-token prompts that compress or cache oddly).

Token counts. The target server's tokenizer is unknown to the client, so by default a prompt
of N tokens is cut as round(N / tokens_per_word) whitespace-separated words, with
`tokens_per_word` = 1.3. Measured on this corpus with the default model's tokenizer
(SmolLM2, 49k-entry BPE): 1.27 tokens per word overall; cut prompts re-encode to 83-133% of
the target at 64 tokens and 90-104% at 1024 tokens (mean 97-98%). Larger vocabularies
(Llama 3, 128k) give slightly fewer tokens per word. Pass a local `tokenizer.json` (or a
model directory that holds one) to cut on exact token boundaries instead; then N tokens
re-encode to N +- 1 (merges across the cut). Chat templates add their own tokens on top.
Either way the server's usage block, when sent, reports the truth (`prompt_tokens`).

A prompt longer than the corpus wraps around to its start.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

DEFAULT_TOKENS_PER_WORD = 1.3


def default_corpus_text() -> str:
    resource = importlib.resources.files("bench") / "data" / "corpus.txt"
    return resource.read_text(encoding="utf-8")


def _tokenizer_spans(text: str, tokenizer_path: str) -> list[tuple[int, int]]:
    from tokenizers import Tokenizer  # only when asked for: keeps `--help` fast

    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {tokenizer_path}")
    encoding = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False)
    return [span for span in encoding.offsets if span[1] > span[0]]


class Corpus:
    """Text plus the spans of its units (words, or tokens when a tokenizer is given).

    Invariants: `spans` is non-empty, sorted and non-overlapping; `tokens_per_unit` > 0.
    """

    def __init__(self, text: str, spans: list[tuple[int, int]], tokens_per_unit: float):
        self.text = text
        self.spans = spans
        self.tokens_per_unit = tokens_per_unit
        self.check_invariants()

    @classmethod
    def load(cls, tokenizer_path: str | None = None, text: str | None = None,
             tokens_per_word: float = DEFAULT_TOKENS_PER_WORD) -> Corpus:
        text = default_corpus_text() if text is None else text
        if tokenizer_path is not None:
            return cls(text, _tokenizer_spans(text, tokenizer_path), 1.0)
        spans = [m.span() for m in re.finditer(r"\S+", text)]
        return cls(text, spans, tokens_per_word)

    @property
    def num_units(self) -> int:
        return len(self.spans)

    def units_for_tokens(self, num_tokens: int) -> int:
        return max(1, round(num_tokens / self.tokens_per_unit))

    def passage(self, start_unit: int, num_tokens: int) -> str:
        """About `num_tokens` tokens of text starting at unit `start_unit` (wrapping)."""
        num_units = self.units_for_tokens(num_tokens)
        pieces = []
        start = start_unit % self.num_units
        while num_units > 0:
            take = min(num_units, self.num_units - start)
            first, last = self.spans[start], self.spans[start + take - 1]
            pieces.append(self.text[first[0]:last[1]])
            num_units -= take
            start = 0
        return "\n\n".join(pieces)

    def check_invariants(self) -> None:
        if not self.spans:
            raise ValueError("corpus has no text")
        if self.tokens_per_unit <= 0:
            raise ValueError("tokens_per_unit must be positive")
        for (_, end), (start, _) in zip(self.spans, self.spans[1:]):
            if start < end:
                raise ValueError("corpus spans overlap or are unsorted")

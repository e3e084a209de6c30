"""The engine's record of its grammar-constrained requests (engine/llm_engine.py).

Lifecycle of a constrained request here:

    tracked: `matcher_for` compiles its grammar (a cache hit: the worker compiled it off the
             engine's thread first) and replays output it got elsewhere (a prefill worker's
             first token, a migrated request's output), so this worker masks where the last
             left off
    -> every token sampled here advances its matcher (engine/sampler.py `advance_grammars`)
    -> it leaves the engine; `any_live` forgets it then

Invariant: `any_live(tracked)` is True iff a tracked request has a grammar; while it is, the
engine does not overlap steps (the next mask needs the token just sampled, on the host).
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence

from engine.request import Request
from text.grammar import GrammarCompiler, GrammarMatcher
from text.tokenizer import Tokenizer


class GrammarRows:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # Thread-safe (text/grammar.py): a worker compiles on a helper thread beforehand.
        self.compiler = GrammarCompiler(tokenizer, vocab_size)
        self._request_ids: set[str] = set()  # tracked (or were) with a grammar

    def matcher_for(self, request: Request, replayed: Sequence[int] = ()
                    ) -> GrammarMatcher | None:
        """A matcher for a request with a grammar (None without one), moved past
        `replayed`, its output sampled elsewhere. GrammarError (a ValueError) when the
        grammar does not compile or does not allow that output."""
        spec = request.sampling_params.grammar
        if spec is None:
            return None
        matcher = self.compiler.new_matcher(spec)
        matcher.accept_all(list(replayed))
        self._request_ids.add(request.request_id)
        return matcher

    def any_live(self, tracked: KeysView[str]) -> bool:
        """Whether a request in `tracked` has a grammar (the ids gone are dropped here)."""
        if self._request_ids:
            self._request_ids &= tracked
        return bool(self._request_ids)

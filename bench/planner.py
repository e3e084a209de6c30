"""A seeded, endless stream of concrete requests drawn from a workload.

The same (workload, corpus, seed) yields the same requests in the same order, whatever the
rate, concurrency or server: arrival times come from a separate random stream (arrivals.py),
so a goodput search compares rates on identical request sequences.

Prompt layout (token counts approximate, see corpus.py):

    without a shared prefix:  "[<index>] " + passage(random start, input_len)
    with a shared prefix:     prefix_k + "\n\n[<index>] " + passage(random start,
                              max(MIN_SUFFIX_TOKENS, input_len - prefix_len))
    a conversation's turn:    history + "\n\n[<index>] " + passage(random start, input_len)

The "[<index>]" tag keeps two unshared prompts from starting at the same corpus word and
so sharing a cacheable prefix by accident; shared prefixes and histories are the only
intended overlap.

Conversations (a class with `turns` > 1): `num_conversations` run at once, in slots; each
request of the class is the next turn of a random slot's conversation, and its prompt is the
conversation's history so far followed by the new user text. The history then grows by
that text and an answer of `max_tokens` tokens; after `turns` turns the slot starts a new
conversation. The answer is corpus text standing in for the model's reply (an open-loop
plan cannot wait for it), so a server finds the history's earlier prompts in its prefix
cache but computes the stood-in answers afresh: a lower bound on what a real client's
conversation reuses. The working set is about num_conversations x the mean history.
"""

from __future__ import annotations

import random

import msgspec

from bench.corpus import Corpus
from bench.workload import RequestClass, Workload

MIN_SUFFIX_TOKENS = 8


class PlannedRequest(msgspec.Struct, frozen=True):
    index: int
    class_name: str
    tier: str
    api_key: str | None
    prompt: str
    input_len: int        # target, in tokens
    max_tokens: int
    prefix_id: int | None  # which shared prefix opens the prompt, if any
    conversation_id: int | None = None  # the conversation it is a turn of, if any


class _Conversation(msgspec.Struct, frozen=True):
    """One slot's conversation: its id, the turns sent so far and their text (prompts and
    stood-in answers, in order) with its length in tokens."""

    id: int
    turn: int = 0
    history: str = ""
    num_tokens: int = 0


class RequestPlanner:
    """Lifecycle: constructed once per run; `next_request()` is called once per request.

    Invariants: `num_planned` equals the number of `next_request()` calls so far, and the
    i-th request's `index` is i.
    """

    def __init__(self, workload: Workload, corpus: Corpus, seed: int):
        self._classes = workload.classes
        self._weights = [c.weight for c in workload.classes]
        self._corpus = corpus
        self._seed = seed
        self._rng = random.Random(seed)
        self._prefixes: dict[tuple[str, int], str] = {}
        self._conversations: dict[str, list[_Conversation]] = {}
        self.num_planned = 0

    def _prefix(self, cls: RequestClass, prefix_id: int) -> str:
        key = (cls.name, prefix_id)
        if key not in self._prefixes:
            # Own stream per prefix: its text never depends on how many requests came first.
            rng = random.Random(f"{self._seed}:{cls.name}:{prefix_id}")
            start = rng.randrange(self._corpus.num_units)
            self._prefixes[key] = self._corpus.passage(start, cls.prefix_len)
        return self._prefixes[key]

    def _turn(self, cls: RequestClass, index: int, input_len: int, max_tokens: int,
              rng: random.Random) -> tuple[str, int, int]:
        """(prompt, its length in tokens, the conversation's id) of the next turn of a random
        conversation of `cls`, whose history then grows by it and its stood-in answer."""
        slots = self._conversations.setdefault(
            cls.name, [_Conversation(n) for n in range(cls.num_conversations)])
        slot = rng.randrange(len(slots))
        conversation = slots[slot]
        head = f"{conversation.history}\n\n" if conversation.history else ""
        text = self._corpus.passage(rng.randrange(self._corpus.num_units), input_len)
        prompt = f"{head}[{index}] {text}"
        length = conversation.num_tokens + input_len
        answer = self._corpus.passage(rng.randrange(self._corpus.num_units), max_tokens)
        if conversation.turn + 1 < cls.turns:
            slots[slot] = _Conversation(conversation.id, conversation.turn + 1,
                                        f"{prompt}\n\n{answer}", length + max_tokens)
        else:  # its last turn: a new conversation takes the slot
            slots[slot] = _Conversation(conversation.id + len(slots))
        return prompt, length, conversation.id

    def next_request(self) -> PlannedRequest:
        rng = self._rng
        index = self.num_planned
        cls = rng.choices(self._classes, weights=self._weights)[0]
        input_len = cls.input_len.sample(rng)
        max_tokens = cls.output_len.sample(rng)
        if cls.turns > 1:
            prompt, length, conversation_id = self._turn(cls, index, input_len, max_tokens,
                                                         rng)
            self.num_planned += 1
            return PlannedRequest(index=index, class_name=cls.name, tier=cls.tier,
                                  api_key=cls.api_key, prompt=prompt, input_len=length,
                                  max_tokens=max_tokens, prefix_id=None,
                                  conversation_id=conversation_id)
        use_prefix = cls.shared_prefix_fraction > 0 and rng.random() < cls.shared_prefix_fraction
        start = rng.randrange(self._corpus.num_units)
        if use_prefix:
            prefix_id = rng.randrange(cls.num_prefixes)
            suffix_len = max(MIN_SUFFIX_TOKENS, input_len - cls.prefix_len)
            prompt = (f"{self._prefix(cls, prefix_id)}\n\n[{index}] "
                      f"{self._corpus.passage(start, suffix_len)}")
        else:
            prefix_id = None
            prompt = f"[{index}] {self._corpus.passage(start, input_len)}"
        self.num_planned += 1
        return PlannedRequest(index=index, class_name=cls.name, tier=cls.tier,
                              api_key=cls.api_key, prompt=prompt, input_len=input_len,
                              max_tokens=max_tokens, prefix_id=prefix_id)


"""Prompts this gateway has routed and not yet seen prefilled: the part of a worker's queue
its load report may not show yet.

A worker publishes its load with its heartbeat (every 0.5 s) as its engine thread last took
it, between two steps (a long prefill step on a CPU holds it for seconds), and the gateway
reads it every 0.25 s: a prompt routed a moment ago is in none of these. Planned on the
report alone, the next request would follow it into the same queue as if it were empty. So
the cluster view keeps, per request, the worker that prefills its prompt and the prompt's
uncached tokens, from the plan until its first token, and hands each worker's totals to the
router with its view (`WorkerView.num_routed_prefills`; the router counts them where the
report lacks them, gateway/routing/router.py `load_at_routing`).

Lifecycle of an entry, per request id:

    add (at a plan) ──▶ counted on its worker ──settle──▶ gone
     ▲ a retry's plan replaces the entry            (the attempt's first token, or the
                                                     generation's end, whichever is first)

Invariants (`check_invariants`): each worker's totals are the sums over its entries, and
only workers with an entry have totals.
"""

from __future__ import annotations

from collections import Counter


class RoutedPrefills:
    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, int]] = {}  # request id -> (worker id, tokens)
        self._num_prompts: Counter[str] = Counter()  # worker id -> entries
        self._num_tokens: Counter[str] = Counter()  # worker id -> their tokens

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, worker_id: str, num_tokens: int) -> None:
        """The request's prompt (`num_tokens` of it uncached) was routed to `worker_id` to
        prefill; replaces the request's earlier entry, if any."""
        self.settle(request_id)
        self._entries[request_id] = (worker_id, num_tokens)
        self._num_prompts[worker_id] += 1
        self._num_tokens[worker_id] += num_tokens

    def settle(self, request_id: str) -> None:
        """The request's prompt is prefilled (or no longer to be): stop counting it. A
        request with no entry is left alone."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        worker_id, num_tokens = entry
        self._num_prompts[worker_id] -= 1
        self._num_tokens[worker_id] -= num_tokens
        if not self._num_prompts[worker_id]:
            del self._num_prompts[worker_id], self._num_tokens[worker_id]

    def totals(self, worker_id: str) -> tuple[int, int]:
        """(prompts, their uncached tokens) routed to `worker_id` and not settled."""
        return self._num_prompts.get(worker_id, 0), self._num_tokens.get(worker_id, 0)

    def check_invariants(self) -> None:
        prompts: Counter[str] = Counter()
        tokens: Counter[str] = Counter()
        for worker_id, num_tokens in self._entries.values():
            prompts[worker_id] += 1
            tokens[worker_id] += num_tokens
        assert dict(prompts) == dict(self._num_prompts), "prompt totals disagree"
        assert {w: tokens[w] for w in prompts} == dict(self._num_tokens), "token totals disagree"

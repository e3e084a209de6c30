"""Turns one step's logits into next tokens, one row per request.

Processing order, per row (vLLM's order; each step sees the previous one's output):

    raw logits [N, vocab] (float32)
      -> logprobs for the response = log_softmax(raw logits)      (see "Logprobs" below)
      -> grammar: tokens the row's grammar does not allow next set to -inf (see "Grammars")
      -> logit_bias: each listed token's bias added (OpenAI; -100 bans it in effect)
      -> min_tokens: EOS and stop_token_ids set to -inf while len(output) < min_tokens
      -> repetition penalty   over prompt + output tokens (HF/vLLM: divide positive logits,
                              multiply negative ones)
      -> frequency / presence over output tokens (OpenAI: logit -= f * count + p * [count > 0])
      -> greedy rows (temperature == 0): argmax, done
      -> / temperature -> min_p (drop p < min_p * p_max) -> top_k -> top_p (smallest set with
         mass >= top_p, and tokens tied with its last; the top token always survives; on
         the host found from a partial top-k, not a sort of the vocabulary)
      -> sample from softmax with the row's own generator

Logprobs: computed from the log-softmax of the raw logits, before any penalty, temperature or
truncation, i.e. the model's own distribution (vLLM's default "raw_logprobs"). They do not
change with sampling settings, and a token excluded by top_k still has a finite logprob.

Determinism: a row with `seed` draws only from its own `torch.Generator` (held in
`SamplingState`), re-seeded for every output position from (seed, position), and its draw
has the same shape whatever the batch; so a seeded request yields the same tokens alone or
batched with others, and on any worker: a request resumed elsewhere after n tokens (its
n tokens replayed) draws token n+1 exactly as the first worker would have. Rows without a
seed share the sampler's generator.

Grammars: a row whose request carries a grammar (protocol/grammar_spec.py) holds a
`GrammarMatcher` in its `SamplingState`; `launch` fills one bitmask row per such row on the
host (the matcher's allowed tokens; EOS only once the grammar has ended), expands it on the
device and masks the logits with it. Rows without a grammar cost nothing: no mask is built
when no row has one. `sample` advances each matcher past the token it got
(`advance_grammars`), before the row's next mask; `launch` alone does not, so an engine
step that queues the next step before its tokens reach the host cannot serve such rows
(engine/grammar_rows.py). The min_tokens rule leaves grammar rows alone: their grammar
alone says when EOS may come.

`ignore_eos` does not touch the logits (vLLM semantics): the model may sample EOS and the
stop checker simply does not stop there.

Invariants:
  * `SamplingState`: a generator exists iff the request has a seed, a grammar matcher iff
    it has a grammar (`SamplingState.check_invariants`);
  * every step's `SamplerOutput` has one token per row, each inside the vocabulary, and a
    row that asked for logprobs reports the token it got, with at most `logprobs`
    alternatives, most likely first (`SamplerOutput.check_invariants`; the engine runs it
    on every step's output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.device_upload import to_device
from engine.logit_masks import apply_grammar_masks, apply_logit_bias
from engine.pending_sample import PendingSample
from engine.sampler_output import SamplerOutput, TokenLogprobs
from protocol.sampling_params import SamplingParams
from text.grammar import GrammarMatcher

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "SamplingState", "TokenLogprobs",
           "advance_grammars", "position_seed"]

# The host's top-p looks at this many of a row's top tokens first (see _apply_top_p).
TOP_P_FIRST_K = 64


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to remember about one request between steps."""

    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # set iff the request has a seed
    plain: bool = False  # is_plain(params): its rows need an argmax and nothing else
    grammar: GrammarMatcher | None = None  # set iff the request has a grammar

    @classmethod
    def create(cls, params: SamplingParams, prompt_token_ids: Sequence[int],
               device: torch.device | str = "cpu",
               grammar: GrammarMatcher | None = None) -> SamplingState:
        """`grammar`: the request's matcher at its start, iff `params.grammar` is set."""
        if (grammar is None) != (params.grammar is None):
            raise ValueError("a grammar matcher is needed exactly when the request has a grammar")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)  # re-seeded at every position
        return cls(prompt_token_ids=prompt_token_ids, generator=generator,
                   plain=is_plain(params), grammar=grammar)

    def check_invariants(self, params: SamplingParams) -> None:
        assert (self.generator is not None) == (params.seed is not None), \
            "a seeded request must draw from its own generator, and only then"
        assert self.plain == is_plain(params), "plain, but its parameters say otherwise"
        assert (self.grammar is not None) == (params.grammar is not None), \
            "a grammar matcher exactly for a request with a grammar"


def may_edit_logits(params: SamplingParams) -> bool:
    """Only a row with a grammar, a logit bias, min_tokens or a penalty can ever have its
    logits edited."""
    return bool(params.grammar is not None or params.logit_bias or params.min_tokens
                or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty)


def advance_grammars(states: Sequence[SamplingState], token_ids: Sequence[int]) -> None:
    """Move each grammar row's matcher past the token it got (called once per sampled
    token, before the row's next `launch`). A token the grammar refused (none can be: the
    mask allowed it) leaves the matcher unusable, and its next mask allows EOS only."""
    for state, token_id in zip(states, token_ids):
        if state.grammar is not None:
            state.grammar.accept(token_id)


def is_plain(params: SamplingParams) -> bool:
    """Greedy, no logprobs, nothing that edits logits (min_tokens, penalties): the row's
    token is the argmax of its logits. Decided once per request (its parameters are
    frozen), so a batch of such rows skips the per-row pass of `Sampler.launch`."""
    return (params.temperature == 0.0 and params.logprobs is None
            and not may_edit_logits(params))

class Sampler:
    """Stateless apart from the generator used by unseeded rows."""

    def __init__(self, eos_token_ids: Sequence[int], device: torch.device | str = "cpu",
                 seed: int | None = None) -> None:
        self._eos_token_ids = tuple(eos_token_ids)
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               states: Sequence[SamplingState]) -> SamplerOutput:
        """`logits` is float32 [N, vocab]; row i belongs to params[i]/states[i]. Side-effect
        free apart from advancing generators and grammar matchers (`advance_grammars`; the
        caller appends the token to the state)."""
        result = self.launch(logits, params, states).result()
        advance_grammars(states, result.token_ids)
        return result

    def launch(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               states: Sequence[SamplingState]) -> PendingSample:
        """`sample` without waiting for the device: the tokens stay on it, and their copy
        to the host is queued (engine/pending_sample.py). Greedy rows queue no wait at all."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} vs {len(params)} params, "
                             f"{len(states)} states")
        logits = logits.float()
        for state in states:
            if not state.plain:
                break
        else:  # every row plain (the usual greedy serving batch): one kernel, nothing else
            return PendingSample(logits.argmax(dim=-1), None, params, no_logprobs=True)
        # One pass over the rows for what the batch needs (a row per request at every step).
        greedy, random, wants_logprobs, edits = [], [], False, False
        for i, (p, s) in enumerate(zip(params, states)):
            (greedy if p.temperature == 0.0 else random).append(i)  # p.is_greedy, inline
            wants_logprobs = wants_logprobs or p.logprobs is not None
            if not edits and may_edit_logits(p):
                edits = _edits_logits(p, s)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        if edits:
            logits = logits.clone()  # the caller's logits stay as they were
            apply_grammar_masks(logits, [s.grammar for s in states])
            apply_logit_bias(logits, [p.logit_bias for p in params])
            self._apply_min_tokens(logits, params, states)
            _apply_penalties(logits, params, states)

        if not random:
            # The common serving batch: no copy of the logits, no gather, one kernel.
            return PendingSample(logits.argmax(dim=-1), raw_logprobs, params)
        # Indices and parameters go up by `to_device` (pinned, no wait): a list index or
        # `torch.tensor(..., device=cuda)` would wait for the step in flight to finish.
        device = logits.device
        random_index = to_device(random, torch.long, device) if greedy else None
        rows = logits if random_index is None else logits.index_select(0, random_index)
        temperatures = [params[i].temperature for i in random]
        if any(t != 1.0 for t in temperatures):  # a division by 1 changes nothing
            rows = rows / to_device(temperatures, rows.dtype, device).unsqueeze(1)
        rows = _apply_min_p(rows, [params[i].min_p for i in random])
        rows = _apply_top_k(rows, [params[i].top_k for i in random])
        rows = _apply_top_p(rows, [params[i].top_p for i in random])
        probs = torch.softmax(rows, dim=-1)
        noise = self._exponential_noise(probs, [states[i].generator for i in random],
                                        [params[i].seed for i in random],
                                        [len(states[i].output_token_ids) for i in random])
        # argmax(p / E) with E ~ Exp(1) is an exact draw from p (the exponential race).
        drawn = (probs / noise).argmax(dim=-1)
        if random_index is None:
            return PendingSample(drawn, raw_logprobs, params)
        # Greedy rows keep their argmax; the random rows' draws replace theirs.
        token_ids = logits.argmax(dim=-1).index_copy_(0, random_index, drawn)
        return PendingSample(token_ids, raw_logprobs, params)

    def _apply_min_tokens(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                          states: Sequence[SamplingState]) -> None:
        banned = [(i, t) for i, (p, s) in enumerate(zip(params, states)) if _bans_stops(p, s)
                  for t in (*self._eos_token_ids, *p.stop_token_ids) if t < logits.shape[1]]
        if banned:
            rows, ids = zip(*banned)
            index = (to_device(rows, torch.long, logits.device),
                     to_device(ids, torch.long, logits.device))
            logits.index_put_(index, logits.new_full((), float("-inf")))

    def _exponential_noise(self, probs: torch.Tensor,
                           generators: Sequence[torch.Generator | None],
                           seeds: Sequence[int | None], positions: Sequence[int]
                           ) -> torch.Tensor:
        shared = [j for j, g in enumerate(generators) if g is None]
        noise = None if len(shared) == len(generators) else torch.empty_like(probs)
        if shared:
            # E = -log(1 - U), U ~ Uniform[0, 1): an Exp(1) draw; on the CPU four times
            # cheaper than exponential_ over a whole vocabulary per row.
            uniform = torch.rand(len(shared), probs.shape[1], dtype=probs.dtype,
                                 device=probs.device, generator=self._generator)
            uniform.neg_().log1p_().neg_()
            if noise is None:  # no row seeded: the shared draw is the whole noise
                noise = uniform
            else:
                noise.index_copy_(0, to_device(shared, torch.long, probs.device), uniform)
        assert noise is not None
        for j, (g, position) in enumerate(zip(generators, positions)):
            if g is not None and seeds[j] is not None:
                # One full row per seeded request, whatever the batch or the worker: the
                # draw depends on the seed and the output position only.
                g.manual_seed(position_seed(seeds[j], position))
                noise[j].exponential_(generator=g)
        # A zero draw would turn an excluded token's 0/0 into NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _bans_stops(params: SamplingParams, state: SamplingState) -> bool:
    """min_tokens not reached yet: EOS and the stop ids are masked (`_apply_min_tokens`);
    not for a grammar row (its grammar decides when EOS may come)."""
    return len(state.output_token_ids) < params.min_tokens and state.grammar is None


def _repetition_penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0


def _count_penalised(params: SamplingParams, state: SamplingState) -> bool:
    """Frequency or presence penalty, once the row has output to count."""
    return (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) \
        and bool(state.output_token_ids)


def _edits_logits(params: SamplingParams, state: SamplingState) -> bool:
    """Whether this row's logits change at this step: the very rules `_apply_min_tokens`
    and `_apply_penalties` select their rows by."""
    return (state.grammar is not None or bool(params.logit_bias) or _bans_stops(params, state)
            or _repetition_penalised(params) or _count_penalised(params, state))


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for one output position of a seeded request (splitmix64 of
    the pair): the same on every process, unrelated between neighbouring positions."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                     states: Sequence[SamplingState]) -> None:
    """In place, for the rows that have penalties, all such rows in a few batched ops."""
    rep_rows = [i for i, p in enumerate(params) if _repetition_penalised(p)]
    if rep_rows:
        seen = _token_counts([[*states[i].prompt_token_ids, *states[i].output_token_ids]
                              for i in rep_rows], logits.shape[1], logits.device) > 0
        penalty = to_device([params[i].repetition_penalty for i in rep_rows], logits.dtype,
                            logits.device).unsqueeze(1)
        index = to_device(rep_rows, torch.long, logits.device)
        rows = logits.index_select(0, index)
        penalised = torch.where(rows > 0, rows / penalty, rows * penalty)
        logits.index_copy_(0, index, torch.where(seen, penalised, rows))
    oai_rows = [i for i, p in enumerate(params) if _count_penalised(p, states[i])]
    if oai_rows:
        counts = _token_counts([states[i].output_token_ids for i in oai_rows], logits.shape[1],
                               logits.device).to(logits.dtype)
        frequency = to_device([params[i].frequency_penalty for i in oai_rows], logits.dtype,
                              logits.device).unsqueeze(1)
        presence = to_device([params[i].presence_penalty for i in oai_rows], logits.dtype,
                             logits.device).unsqueeze(1)
        index = to_device(oai_rows, torch.long, logits.device)
        rows = logits.index_select(0, index)
        logits.index_copy_(0, index, rows - (frequency * counts
                                             + presence * (counts > 0).to(logits.dtype)))


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] occurrence counts. Ids >= vocab_size (none expected) and
    the padding both land in an extra column that is dropped."""
    width = max(len(ids) for ids in token_lists)
    padded = torch.full((len(token_lists), width), vocab_size, dtype=torch.long)
    for row, ids in enumerate(token_lists):
        if ids:
            padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.long).clamp_(0, vocab_size)
    padded = to_device(padded.numpy(), torch.long, device)
    counts = torch.zeros(len(token_lists), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def _apply_min_p(rows: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if not any(m > 0 for m in min_ps):
        return rows
    probs = torch.softmax(rows, dim=-1)
    min_p = to_device(min_ps, rows.dtype, rows.device).unsqueeze(1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return rows.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(rows: torch.Tensor, top_ks: list[int | None]) -> torch.Tensor:
    vocab_size = rows.shape[1]
    ks = [vocab_size if k is None else min(k, vocab_size) for k in top_ks]
    if all(k == vocab_size for k in ks):
        return rows
    max_k = max(k for k in ks if k < vocab_size)
    top = rows.topk(max_k, dim=-1).values  # [n, max_k], descending
    index = to_device([min(k, max_k) - 1 for k in ks], torch.long, rows.device).unsqueeze(1)
    kth = top.gather(1, index)
    # Rows without a cut keep everything; ties with the k-th value are kept too.
    no_cut = to_device([k == vocab_size for k in ks], torch.bool, rows.device).unsqueeze(1)
    return rows.masked_fill((rows < kth) & ~no_cut, float("-inf"))


def _apply_top_p(rows: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep each row's smallest set of top tokens whose mass reaches its top_p: every token
    whose probability is at least that set's smallest (so tokens tied with it stay too;
    the top token always stays)."""
    if all(p >= 1.0 for p in top_ps):
        return rows
    probs = torch.softmax(rows, dim=-1)
    top_p = to_device(top_ps, torch.float64, rows.device).unsqueeze(1)
    floors = (_top_p_floors_sorted(probs, top_p) if rows.is_cuda
              else _top_p_floors_partial(probs, top_p, [p < 1.0 for p in top_ps]))
    floors = floors.masked_fill(top_p >= 1.0, 0.0)  # no cut: rounding must not drop the tail
    return rows.masked_fill(probs < floors, float("-inf"))


def _top_p_floors_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The floors from a sort of every row: no host sync (the device path)."""
    return _floors(probs.sort(dim=-1, descending=True).values, top_p)[0]


def _top_p_floors_partial(probs: torch.Tensor, top_p: torch.Tensor,
                          cut: list[bool]) -> torch.Tensor:
    """The floors from the top TOP_P_FIRST_K of each row, widened for the rows whose kept
    set runs past them (the host path: a language model's kept set is usually a few dozen
    tokens, and a CPU sort of a 49k vocabulary takes ~5 ms per row). The top k of a row
    are the first k of its sorted order, with the same running mass, so the floors are the
    sort's exactly."""
    num_rows, vocab_size = probs.shape
    floors = torch.zeros(num_rows, 1, dtype=probs.dtype, device=probs.device)
    pending = torch.tensor([i for i, c in enumerate(cut) if c], dtype=torch.long,
                           device=probs.device)
    k = min(TOP_P_FIRST_K, vocab_size)
    while pending.numel():
        rows = probs if pending.numel() == num_rows else probs[pending]
        top = (rows.topk(k, dim=-1) if k < vocab_size  # sorted, descending
               else rows.sort(dim=-1, descending=True)).values
        floor, num_kept = _floors(top, top_p[pending])
        done = (num_kept.squeeze(1) < k) | (k == vocab_size)
        floors[pending[done]] = floor[done]
        # Widen 8x; but past an eighth of the vocabulary, or for a flat row (its top k hold
        # less than half the mass it needs: the kept set is far wider), a sort costs as much.
        flat = bool((top[~done].sum(dim=-1) < top_p[pending][~done].squeeze(1) / 2).any())
        pending = pending[~done]
        k = k * 8 if k * 8 <= vocab_size // 8 and not flat else vocab_size
    return floors


def _floors(top: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From the largest probabilities of each row in descending order: the smallest kept
    one (the floor) and how many are kept. A token is kept while the mass before it is
    < top_p, so the kept set is the smallest reaching top_p (top_p > 0: at least one).

    The running mass is summed in float64: a float32 sum's rounding depends on the order the
    CPU's SIMD width (or the GPU's scan) adds in, which moves a cut near top_p by a token
    from one machine to the next; float64 decides the same boundary on every machine and on
    both paths (the host's partial top-k and the device's full sort)."""
    top64 = top.double()
    mass_before = top64.cumsum(dim=-1) - top64
    num_kept = (mass_before < top_p.double()).sum(dim=-1, keepdim=True)
    # A row of NaN probabilities (a model whose activations overflowed) keeps no token by
    # that rule; it keeps its first, as greedy rows pick one, rather than failing the batch.
    num_kept = num_kept.clamp_(min=1)
    return top.gather(1, num_kept - 1), num_kept
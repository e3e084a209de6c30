"""Sampler rules against straightforward references, statistics with fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

import engine.sampler as sampler_module
from engine.sampler import Sampler, SamplingState, position_seed
from protocol.sampling_params import SamplingParams

EOS = 3
VOCAB = 16


def logits_rows(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 2


def sample_once(logits: torch.Tensor, params: SamplingParams, prompt=(), output=(), sampler=None):
    sampler = sampler or Sampler((EOS,), seed=0)
    state = SamplingState.create(params, list(prompt))
    state.output_token_ids.extend(output)
    return sampler.sample(logits.unsqueeze(0), [params], [state])


def frequencies(logits: torch.Tensor, params: SamplingParams, num_samples: int = 20000,
                prompt=(), output=()) -> torch.Tensor:
    """Empirical distribution: many unseeded rows with the same logits, one batched call."""
    sampler = Sampler((EOS,), seed=1234)
    states = []
    for _ in range(num_samples):
        state = SamplingState.create(params, list(prompt))
        state.output_token_ids.extend(output)
        states.append(state)
    out = sampler.sample(logits.expand(num_samples, -1).contiguous(), [params] * num_samples, states)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1]).double() / num_samples


def assert_matches(freq: torch.Tensor, probs: torch.Tensor, num_samples: int = 20000) -> None:
    probs = probs.double()
    assert torch.all(freq[probs == 0] == 0), "sampled a token the rules exclude"
    sigma = torch.sqrt(probs * (1 - probs) / num_samples)
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-9), (freq, probs)


# ---- references -------------------------------------------------------------------------
def ref_penalties(logits: torch.Tensor, p: SamplingParams, prompt, output) -> torch.Tensor:
    x = logits.clone().double()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def ref_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits.double() / p.temperature
    probs = torch.softmax(x, -1)
    keep = probs >= p.min_p * probs.max()
    if p.top_k is not None:
        kth = sorted(x.tolist(), reverse=True)[p.top_k - 1]
        keep &= x >= kth
    x = torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype))
    probs = torch.softmax(x, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    mass, kept = 0.0, set()
    for i in order:
        if mass >= p.top_p:
            break
        kept.add(i)
        mass += probs[i].item()
    x = torch.tensor([x[i].item() if i in kept else -math.inf for i in range(len(x))], dtype=x.dtype)
    return torch.softmax(x, -1)


# ---- greedy and penalties -----------------------------------------------------------------
def test_greedy_is_argmax() -> None:
    logits = logits_rows(8)
    sampler = Sampler((EOS,), seed=0)
    params = [SamplingParams(temperature=0.0)] * 8
    out = sampler.sample(logits, params, [SamplingState.create(p, [1]) for p in params])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_batch_takes_the_same_tokens_with_or_without_rows_that_edit_logits() -> None:
    # An all-greedy batch without penalties takes argmax straight from the logits (no
    # copy); a batch with a row that edits its logits copies them first. Either way the
    # caller's logits are left as they were and the other rows' tokens do not change.
    logits = logits_rows(6, seed=7)
    before = logits.clone()
    plain = [SamplingParams(temperature=0.0, max_tokens=4)] * 6
    states = [SamplingState.create(p, [1, 2]) for p in plain]
    out = Sampler((EOS,), seed=0).sample(logits, plain, states)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    edited = [*plain[:5], SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=2.0)]
    states = [SamplingState.create(p, [1, 2]) for p in edited]
    again = Sampler((EOS,), seed=0).sample(logits, edited, states)
    assert again.token_ids[:5] == out.token_ids[:5]
    assert torch.equal(logits, before)
    mixed = [*plain[:3], *[SamplingParams(temperature=0.7, seed=5, max_tokens=4)] * 3]
    states = [SamplingState.create(p, [1, 2]) for p in mixed]
    third = Sampler((EOS,), seed=0).sample(logits, mixed, states)
    assert third.token_ids[:3] == out.token_ids[:3]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.8, 0.0),
                                            (1.0, 0.0, -1.5), (1.5, 1.2, 0.6)])
def test_penalties_match_reference(rep: float, freq: float, pres: float) -> None:
    prompt, output = [1, 2, 2, 5], [5, 7, 7, 7, 9]
    params = SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres)
    for seed in range(20):
        logits = logits_rows(1, seed)[0]
        expected = ref_penalties(logits, params, prompt, output).argmax().item()
        assert sample_once(logits, params, prompt, output).token_ids == [expected]
    # and the full distribution after penalties, with temperature
    params = SamplingParams(temperature=0.9, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres)
    logits = logits_rows(1, 99, vocab=10)[0]
    expected = torch.softmax(ref_penalties(logits, params, prompt, output) / 0.9, -1)
    assert_matches(frequencies(logits, params, 8000, prompt=prompt, output=output), expected, 8000)


def test_penalised_token_loses_greedy_choice() -> None:
    logits = torch.zeros(VOCAB)
    logits[4], logits[6] = 2.0, 1.9
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert sample_once(logits, params).token_ids == [4]
    assert sample_once(logits, params, output=[4]).token_ids == [6]


# ---- min_tokens / ignore_eos --------------------------------------------------------------
def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(VOCAB)
    logits[EOS], logits[8], logits[11] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(8,))
    assert sample_once(logits, params, output=[1]).token_ids == [11]
    assert sample_once(logits, params, output=[1, 1]).token_ids == [EOS]
    random = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(8,))
    freq = frequencies(logits, random, 4000, output=[1])
    assert freq[EOS] == 0 and freq[8] == 0


def test_ignore_eos_does_not_touch_logits() -> None:
    logits = torch.zeros(VOCAB)
    logits[EOS] = 5.0
    assert sample_once(logits, SamplingParams(temperature=0.0, ignore_eos=True)).token_ids == [EOS]


# ---- truncation rules ---------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.8, min_p=0.05),
])
def test_distribution_matches_reference(params: SamplingParams) -> None:
    logits = logits_rows(1, 7, vocab=10)[0]
    assert_matches(frequencies(logits, params), ref_probs(logits, params))


def test_truncations_never_select_excluded_tokens_in_mixed_batch() -> None:
    n = 3000
    logits = logits_rows(n, 3)
    kinds = [SamplingParams(temperature=1.5, top_k=2), SamplingParams(temperature=1.5, top_p=0.3),
             SamplingParams(temperature=1.5, min_p=0.5), SamplingParams(temperature=1.5)]
    params = [kinds[i % 4] for i in range(n)]
    sampler = Sampler((EOS,), seed=5)
    out = sampler.sample(logits, params, [SamplingState.create(p, []) for p in params])
    for i, token in enumerate(out.token_ids):
        assert ref_probs(logits[i], params[i])[token] > 0, (i, params[i])


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.zeros(VOCAB)
    logits[9] = 3.0
    freq = frequencies(logits, SamplingParams(temperature=1.0, top_p=0.01), 2000)
    assert freq[9] == 1.0


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 20.0])  # flat .. peaked
def test_top_p_from_a_partial_top_k_cuts_where_a_full_sort_does(scale: float) -> None:
    # The host finds the cut from the top 64 (then 512, 4096, ...) of each row; the device
    # path sorts the whole row. Both must keep exactly the same tokens, for rows whose kept
    # set is a handful of tokens and for rows that need most of the vocabulary.
    vocab = 20_000
    top_ps = [0.01, 0.3, 0.9, 0.999, 1.0, 0.95]
    rows = torch.randn(len(top_ps), vocab, generator=torch.Generator().manual_seed(5)) * scale
    probs = torch.softmax(rows, dim=-1)
    top_p = torch.tensor(top_ps).unsqueeze(1)
    partial = sampler_module._top_p_floors_partial(probs, top_p, [p < 1 for p in top_ps])
    assert torch.equal(partial[:4], sampler_module._top_p_floors_sorted(probs, top_p)[:4])
    assert partial[4].item() == 0.0  # top_p 1.0: no cut at all
    kept = sampler_module._apply_top_p(rows, top_ps) > -math.inf
    for i, p in enumerate(top_ps):
        order = probs[i].double().argsort(descending=True)
        mass_before = probs[i].double()[order].cumsum(0) - probs[i].double()[order]
        reference = int((mass_before < p).sum()) if p < 1 else vocab
        assert int(kept[i].sum()) == reference, (p, scale)
        assert kept[i][order[:reference]].all()


def test_top_p_keeps_every_token_tied_with_the_last_one_it_needs() -> None:
    # bf16 logits have few distinct values: ties at the cut are common. Five tokens of
    # 0.2 each: top_p 0.5 needs three of them, and keeps all five (the same on both paths).
    logits = torch.full((1, 300), -math.inf)
    logits[0, 100:105] = 1.0
    for floors in (sampler_module._top_p_floors_sorted, sampler_module._top_p_floors_partial):
        probs = torch.softmax(logits, dim=-1)
        args = (probs, torch.tensor([[0.5]])) + (([True],) if "partial" in floors.__name__ else ())
        assert floors(*args).item() == pytest.approx(0.2)
    assert (sampler_module._apply_top_p(logits, [0.5]) > -math.inf).sum() == 5


# ---- seeds ------------------------------------------------------------------------------
def generate(sampler: Sampler, batch: list[SamplingParams], steps: int, seed_logits: int,
             resumed: list[int] | None = None) -> list[list[int]]:
    """`resumed`: row 0 continues after these output tokens (as a migrated request does)."""
    states = [SamplingState.create(p, [1, 2]) for p in batch]
    if resumed:
        states[0].output_token_ids.extend(resumed)
    for step in range(len(resumed or ()), steps):
        # Row r's logits depend only on (step, r), so row 0 sees the same logits in any batch.
        logits = torch.cat([logits_rows(1, (seed_logits + step) * 100 + r, vocab=50)
                            for r in range(len(batch))]) * 0.3  # high entropy
        out = sampler.sample(logits, batch, states)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(t)
    return [s.output_token_ids for s in states]


def test_seed_gives_same_tokens_alone_or_batched() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=30)
    # the same logits for the seeded row in both runs: it is row 0 each time
    alone = generate(Sampler((EOS,), seed=1), [seeded], 30, 100)[0]
    others = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=4)]
    batched = generate(Sampler((EOS,), seed=2), [seeded, *others], 30, 100)[0]
    assert alone == batched
    other_seed = generate(Sampler((EOS,), seed=1), [SamplingParams(temperature=1.0, top_p=0.9, seed=43)],
                          30, 100)[0]
    assert other_seed != alone


def test_a_seeded_request_resumed_elsewhere_continues_with_the_same_draws() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=-3, max_tokens=40)
    whole = generate(Sampler((EOS,), seed=1), [seeded], 40, 200)[0]
    # Another worker (another sampler, other rows) picks it up after 17 tokens.
    resumed = generate(Sampler((EOS,), seed=99), [seeded, SamplingParams(temperature=1.0)],
                       40, 200, resumed=whole[:17])[0]
    assert resumed == whole
    assert len(set(whole)) > 5  # high entropy: a wrong draw would show


def test_position_seeds_differ_between_positions_and_seeds() -> None:
    seeds = {position_seed(seed, position) for seed in (0, 1, -1, 2**63) for position in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)


def test_unseeded_rows_differ_between_sampler_seeds() -> None:
    params = [SamplingParams(temperature=1.0)]
    a = generate(Sampler((EOS,), seed=1), params, 20, 0)[0]
    b = generate(Sampler((EOS,), seed=2), params, 20, 0)[0]
    assert a != b


# ---- logprobs ---------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax() -> None:
    logits = logits_rows(3, 11)
    params = [SamplingParams(temperature=0.5, top_k=2, logprobs=4, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=1.0)]
    states = [SamplingState.create(p, [0, 1, 2]) for p in params]
    out = Sampler((EOS,), seed=0).sample(logits, params, states)
    raw = torch.log_softmax(logits.double(), -1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert len(first.top_token_ids) == len(first.top_logprobs) == 4
    assert list(first.top_token_ids) == raw[0].argsort(descending=True)[:4].tolist()
    assert first.top_logprobs == pytest.approx(raw[0, list(first.top_token_ids)].tolist(), abs=1e-5)
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-5)
    second = out.logprobs[1]
    assert second is not None and second.top_token_ids == () and second.top_logprobs == ()
    assert second.logprob == pytest.approx(raw[1].max().item(), abs=1e-5)
    assert out.logprobs[2] is None


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler((EOS,)).sample(torch.zeros(2, VOCAB), [SamplingParams()], [SamplingState([])])


def test_a_sampler_output_that_breaks_its_invariants_is_caught() -> None:
    from engine.sampler_output import SamplerOutput, TokenLogprobs

    plain, asks = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1)
    SamplerOutput([3, 0], [None, None]).check_invariants([plain, plain], 4)
    with pytest.raises(AssertionError, match="outside"):
        SamplerOutput([3, 4], [None, None]).check_invariants([plain, plain], 4)
    with pytest.raises(AssertionError, match="outside"):
        SamplerOutput([-1], [None]).check_invariants([plain], 4)
    with pytest.raises(AssertionError, match="where none asked"):
        SamplerOutput([1], [None]).check_invariants([asks], 4)
    with pytest.raises(AssertionError, match="where none asked"):
        SamplerOutput([1], [TokenLogprobs(1, -0.1, (), ())]).check_invariants([plain], 4)
    with pytest.raises(AssertionError, match="another token"):
        SamplerOutput([1], [TokenLogprobs(2, -0.1, (), ())]).check_invariants([asks], 4)


@pytest.mark.parametrize("params, plain", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, max_tokens=3, stop=["x"], ignore_eos=True), True),
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.0, logprobs=2), False),
    (SamplingParams(temperature=0.0, min_tokens=4), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), False),
    (SamplingParams(temperature=0.0, frequency_penalty=0.5), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
])
def test_a_plain_row_is_greedy_with_nothing_to_edit_or_report(params, plain) -> None:
    assert SamplingState.create(params, [1]).plain is plain


def test_a_batch_of_plain_rows_gets_the_argmax_and_one_other_row_the_general_pass() -> None:
    logits = logits_rows(6, seed=4)
    plain = [SamplingParams(temperature=0.0)] * 6
    out = Sampler((EOS,), seed=0).sample(logits, plain,
                                         [SamplingState.create(p, [1]) for p in plain])
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.logprobs == [None] * 6
    # One row asking for logprobs: every row goes through the general pass, same tokens.
    mixed = [*plain[:5], SamplingParams(temperature=0.0, logprobs=1)]
    out = Sampler((EOS,), seed=0).sample(logits, mixed,
                                         [SamplingState.create(p, [1]) for p in mixed])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs[:5] == [None] * 5 and out.logprobs[5] is not None


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_a_row_of_nan_logits_does_not_fail_the_rows_beside_it(top_p: float) -> None:
    """A model whose activations overflowed gives NaN logits for a row: that row gets some
    token, as a greedy row does, and the batch's other rows their usual draws."""
    logits = logits_rows(3, seed=5)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.8, top_p=top_p, seed=7, max_tokens=4)] * 3
    got = Sampler((0,), seed=0).sample(logits, params, [SamplingState.create(p, (1, 2))
                                                        for p in params]).token_ids
    clean = logits[[0, 2]]
    want = Sampler((0,), seed=0).sample(clean, params[:2], [SamplingState.create(p, (1, 2))
                                                            for p in params[:2]]).token_ids
    assert [got[0], got[2]] == want and 0 <= got[1] < VOCAB

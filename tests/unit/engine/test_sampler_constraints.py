"""Grammar masks and logit_bias in the sampler, on a fake vocabulary with a scripted matcher."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.logit_masks import allowed_from_bitmask
from engine.sampler import Sampler, SamplingState
from protocol.grammar_spec import GrammarKind, GrammarSpec
from protocol.sampling_params import SamplingParams
from text.grammar import GrammarMatcher

EOS = 3
VOCAB = 70  # three 32-bit words, the last one partly used
SPEC = GrammarSpec(GrammarKind.REGEX, "scripted")


class ScriptedMatcher(GrammarMatcher):
    """Allows the tokens of `script[i]` after i accepted tokens; then nothing but EOS."""

    def __init__(self, script: list[set[int]]) -> None:
        self.script = script
        self.accepted: list[int] = []

    @property
    def is_usable(self) -> bool:
        return len(self.accepted) < len(self.script)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (EOS,)

    def write_mask(self, address: int, num_bytes: int) -> None:
        words = [0] * (num_bytes // 4)
        for t in self.script[len(self.accepted)]:
            words[t // 32] |= 1 << (t % 32)
        data = b"".join(w.to_bytes(4, "little") for w in words)
        ctypes.memmove(address, data, num_bytes)

    def accept(self, token_id: int) -> bool:
        ok = self.is_usable and token_id in self.script[len(self.accepted)]
        self.accepted.append(token_id)
        return ok


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def state_for(params: SamplingParams, matcher: GrammarMatcher | None = None) -> SamplingState:
    return SamplingState.create(params, [1, 2], grammar=matcher)


def test_bitmask_expansion_matches_bits_including_the_sign_bit():
    allowed = {0, 5, 31, 32, 63, 64, 69}
    words = torch.zeros(1, 3, dtype=torch.int32)
    for t in allowed:
        words[0, t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
    mask = allowed_from_bitmask(words, VOCAB)
    assert mask.shape == (1, VOCAB)
    assert set(mask[0].nonzero().flatten().tolist()) == allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_rows_sample_only_allowed_tokens_and_others_are_untouched(temperature):
    script = [{10, 40, 65}, {31, 33}, {7}]
    greedy = SamplingParams(temperature=0.0)
    constrained = SamplingParams(temperature=temperature, grammar=SPEC)
    sampler = Sampler((EOS,), seed=0)
    for seed in range(20):
        matcher = ScriptedMatcher(script)
        states = [state_for(greedy), state_for(constrained, matcher)]
        for step, allowed in enumerate(script + [{EOS}]):
            logits = logits_rows(2, seed * 10 + step)
            out = sampler.sample(logits, [greedy, constrained], states)
            assert out.token_ids[0] == int(logits[0].argmax())  # the free row: its argmax
            assert out.token_ids[1] in allowed
            if temperature == 0.0:
                best = max(allowed, key=lambda t: float(logits[1, t]))
                assert out.token_ids[1] == best
            for s, t in zip(states, out.token_ids):
                s.output_token_ids.append(t)
        # `sample` moved the matcher past each token it drew: every scripted step consumed.
        assert len(matcher.accepted) == len(script) + 1 and not matcher.is_usable


def test_a_row_without_grammar_in_the_batch_keeps_its_plain_fast_path():
    params = SamplingParams(temperature=0.0)
    assert state_for(params).plain
    constrained = SamplingParams(temperature=0.0, grammar=SPEC)
    assert not state_for(constrained, ScriptedMatcher([{1}])).plain
    assert not state_for(SamplingParams(temperature=0.0, logit_bias=((1, 1.0),))).plain


def test_min_tokens_does_not_fight_the_grammar_over_eos():
    params = SamplingParams(temperature=0.0, grammar=SPEC, min_tokens=5)
    matcher = ScriptedMatcher([])  # ended: only EOS
    out = Sampler((EOS,), seed=0).sample(logits_rows(1), [params], [state_for(params, matcher)])
    assert out.token_ids == [EOS]


def test_matcher_and_grammar_go_together():
    with pytest.raises(ValueError):
        state_for(SamplingParams(grammar=SPEC))
    with pytest.raises(ValueError):
        state_for(SamplingParams(), ScriptedMatcher([{1}]))


def test_logit_bias_minus_100_bans_the_argmax_and_plus_100_forces_a_token():
    logits = logits_rows(1, 3)
    top = int(logits[0].argmax())
    ban = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    out = Sampler((EOS,), seed=0).sample(logits, [ban], [state_for(ban)])
    assert out.token_ids[0] != top
    expected = logits[0].clone()
    expected[top] -= 100
    assert out.token_ids[0] == int(expected.argmax())
    low = int(logits[0].argmin())
    force = SamplingParams(temperature=1.0, logit_bias=((low, 100.0),))
    sampler = Sampler((EOS,), seed=1)
    picks = {sampler.sample(logits, [force], [state_for(force)]).token_ids[0] for _ in range(50)}
    assert picks == {low}


def test_logit_bias_leaves_logprobs_raw_and_other_rows_alone():
    logits = logits_rows(2, 4)
    top = int(logits[0].argmax())
    biased = SamplingParams(temperature=0.0, logprobs=1, logit_bias=((top, -100.0),))
    plain = SamplingParams(temperature=0.0, logprobs=1)
    out = Sampler((EOS,), seed=0).sample(logits, [biased, plain],
                                         [state_for(biased), state_for(plain)])
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs[0]
    assert lp is not None and lp.top_token_ids == (top,)
    assert lp.top_logprobs[0] == pytest.approx(float(raw[0, top]))
    assert out.token_ids[1] == int(logits[1].argmax())

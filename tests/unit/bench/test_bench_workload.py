"""Workload specs, length distributions, prompt planning and arrival processes."""

import random
import statistics

import pytest

from bench.arrivals import arrival_gaps_s
from bench.corpus import Corpus
from bench.planner import RequestPlanner
from bench.workload import LengthDist, load_workload, parse_workload, preset_names

TWO_CLASS = """
name = "two"
[[classes]]
name = "short"
weight = 3
tier = "interactive"
input_len = 40
output_len = { kind = "uniform", low = 10, high = 20 }
[[classes]]
name = "long"
weight = 1
tier = "batch"
api_key = "sk-batch"
input_len = { kind = "lognormal", mean = 400, sd = 100, min = 100 }
output_len = 50
shared_prefix_fraction = 0.5
prefix_len = 200
num_prefixes = 2
"""


def test_presets_ship_with_the_package():
    assert {"chat", "rag", "mixed", "steady", "multi_turn", "long_chat", "shared_corpus"} <= \
        set(preset_names())
    for name in preset_names():
        assert load_workload(name).classes
    mixed = load_workload("mixed")
    assert mixed.tiers == ["batch", "interactive"]
    rag = load_workload("rag")
    assert rag.classes[0].shared_prefix_fraction > 0 and rag.classes[0].prefix_len > 0


def test_unknown_preset_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="presets: chat"):
        load_workload("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[classes]]\nname = "a"\ninput_len = 5\noutput_len = 5\n'
                   'colour = "red"\n')
    with pytest.raises(ValueError, match="colour"):
        load_workload(str(bad))
    with pytest.raises(ValueError, match="prefix_len"):
        parse_workload('name = "x"\n[[classes]]\nname = "a"\ninput_len = 5\noutput_len = 5\n'
                       'shared_prefix_fraction = 0.5\n')
    with pytest.raises(ValueError, match="low <= high"):
        LengthDist(kind="uniform", low=9, high=3)


def test_lognormal_matches_the_given_mean_and_sd():
    dist = LengthDist(kind="lognormal", mean=300, sd=90)
    rng = random.Random(1)
    samples = [dist.sample(rng) for _ in range(20000)]
    assert statistics.mean(samples) == pytest.approx(300, rel=0.03)
    assert statistics.stdev(samples) == pytest.approx(90, rel=0.08)


def test_lengths_are_clamped():
    dist = LengthDist(kind="lognormal", mean=100, sd=300, min=20, max=150)
    rng = random.Random(2)
    samples = [dist.sample(rng) for _ in range(2000)]
    assert min(samples) == 20 and max(samples) == 150


def _plan(seed: int, n: int):
    planner = RequestPlanner(parse_workload(TWO_CLASS), Corpus.load(), seed)
    return [planner.next_request() for _ in range(n)]


def test_same_seed_same_requests_other_seed_other_requests():
    first, again, other = _plan(7, 200), _plan(7, 200), _plan(8, 200)
    assert first == again
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert [r.index for r in first] == list(range(200))


def test_class_mix_prefixes_and_tiers_follow_the_spec():
    requests = _plan(3, 2000)
    long_reqs = [r for r in requests if r.class_name == "long"]
    assert len(long_reqs) / len(requests) == pytest.approx(0.25, abs=0.04)
    assert all(r.tier == "batch" and r.api_key == "sk-batch" for r in long_reqs)
    shared = [r for r in long_reqs if r.prefix_id is not None]
    assert len(shared) / len(long_reqs) == pytest.approx(0.5, abs=0.08)
    # Requests on the same prefix share its text exactly; different prefixes differ.
    by_prefix = {}
    for r in shared:
        by_prefix.setdefault(r.prefix_id, []).append(r.prompt.split("\n\n[")[0])
    assert set(by_prefix) == {0, 1}
    assert all(len(set(texts)) == 1 for texts in by_prefix.values())
    assert by_prefix[0][0] != by_prefix[1][0]
    short = [r for r in requests if r.class_name == "short"]
    assert all(10 <= r.max_tokens <= 20 and r.prefix_id is None for r in short)


CONVERSATIONS = """
name = "talk"
[[classes]]
name = "turn"
input_len = { kind = "uniform", low = 20, high = 60 }
output_len = { kind = "uniform", low = 10, high = 30 }
turns = 3
num_conversations = 4
"""


def test_each_turn_resends_its_conversations_history():
    planner = RequestPlanner(parse_workload(CONVERSATIONS), Corpus.load(), 5)
    requests = [planner.next_request() for _ in range(200)]
    by_conversation: dict[int, list] = {}
    for r in requests:
        assert r.conversation_id is not None and r.prefix_id is None
        by_conversation.setdefault(r.conversation_id, []).append(r)
    assert len(by_conversation) > 4  # finished conversations gave their slots to new ones
    finished = [turns for turns in by_conversation.values() if len(turns) == 3]
    assert finished and all(len(turns) <= 3 for turns in by_conversation.values())
    for turns in finished:
        first, second, third = turns
        # A turn opens with the whole previous turn, then its stood-in answer, then new text.
        assert second.prompt.startswith(first.prompt + "\n\n")
        assert third.prompt.startswith(second.prompt + "\n\n")
        answer = second.prompt[len(first.prompt) + 2:].split("\n\n[")[0]
        assert 10 <= len(answer.split()) * 1.3 <= 30 * 1.3 + 2
        assert first.input_len < second.input_len < third.input_len
        assert second.input_len > first.input_len + first.max_tokens
    # Two conversations share nothing but what every prompt starts with.
    firsts = [turns[0].prompt for turns in by_conversation.values()]
    assert len({p.split("] ", 1)[1][:40] for p in firsts}) == len(firsts)
    again = RequestPlanner(parse_workload(CONVERSATIONS), Corpus.load(), 5)
    assert [again.next_request() for _ in range(200)] == requests


def test_a_conversation_with_a_shared_prefix_is_refused():
    with pytest.raises(ValueError, match="turns"):
        parse_workload(CONVERSATIONS + "shared_prefix_fraction = 0.5\nprefix_len = 8\n")


def test_prompt_length_tracks_the_word_ratio():
    corpus = Corpus.load(tokens_per_word=1.3)
    for num_tokens in (13, 130, 1300, 13000):  # 13000 wraps around the corpus
        words = len(corpus.passage(100, num_tokens).split())
        assert words == round(num_tokens / 1.3)


def test_prompt_length_is_exact_with_a_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from bench.corpus import default_corpus_text

    tok.train_from_iterator([default_corpus_text()],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = Corpus.load(str(tmp_path))
    for start, num_tokens in ((0, 50), (777, 300)):
        text = corpus.passage(start, num_tokens)
        assert len(tok.encode(text, add_special_tokens=False).ids) == num_tokens


def test_arrivals_have_the_set_rate_and_burstiness():
    poisson = arrival_gaps_s(random.Random(0), 20.0)
    gaps = [next(poisson) for _ in range(20000)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)
    bursty = arrival_gaps_s(random.Random(0), 20.0, "gamma", burstiness=0.25)
    gaps = [next(bursty) for _ in range(20000)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    # Gamma(shape k) has coefficient of variation 1/sqrt(k): 2 for k = 0.25.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)

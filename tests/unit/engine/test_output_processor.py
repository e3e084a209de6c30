"""OutputProcessor.process_resolved (the per-row loop of an overlapped step, compiled:
engine/native) against `process`, token by token, with the real SmolLM2 vocabulary: the
same outputs, the same finishes, the same state left behind, whatever the stop rules."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager
from engine.output_processor import OutputProcessor, RequestOutput
from engine.request import Request
from engine.sampler import SamplingState
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from protocol.sampling_params import SamplingParams
from tests.unit.text.test_detokenizer import TOK

EOS = TOK.eos_token_ids[0]
WORDS = [TOK.encode(w, add_special_tokens=False)[0] for w in (" the", " end", " a", ".", "\n")]
BYTE = [TOK.token_to_id(c) for c in ("Ã", "©")]  # "é" split in two byte tokens


def drive(params: list[SamplingParams], tokens: list[list[int]], batched: bool
          ) -> tuple[list[RequestOutput], list[tuple[str, str, int]]]:
    """Steps the requests as an overlapped engine does (PLACEHOLDER recorded, then resolved)
    and postprocesses each step's rows either through `process_resolved` or one by one."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          KVCacheManager(BlockPool(num_blocks=64, block_size=4)))
    outputs = OutputProcessor(TOK, scheduler)
    for i, p in enumerate(params):
        request = Request(f"r{i}", (5, 6, 7), p)
        scheduler.add_request(request)
        outputs.track(request, SamplingState.create(p, request.prompt_token_ids))
    made: list[RequestOutput] = []
    for step in range(max(len(t) for t in tokens)):
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, None)
        rows = [outputs.tracked[c.request_id] for c in schedule.chunks
                if c.sample and c.request_id in outputs.tracked]
        ids = [tokens[int(t.request.request_id[1:])][step] for t in rows]
        if batched:  # resolves the PLACEHOLDERs itself
            made += outputs.process_resolved(rows, ids, [None] * len(rows))
        else:
            for tracked, token_id in zip(rows, ids):
                tracked.request.resolve_placeholder(token_id)
                out = outputs.process(tracked.request.request_id, token_id, None, False)
                assert out is not None
                made.append(out)
        made += [outputs.finish_output(outputs.tracked[r.request_id], [])
                 for r in scheduler.drain_finished() if r.request_id in outputs.tracked]
        outputs.check_invariants()
    left = [(rid, t.text, t.num_emitted_chars) for rid, t in sorted(outputs.tracked.items())]
    return made, left


@st.composite
def params_st(draw) -> SamplingParams:
    max_tokens = draw(st.integers(1, 12))
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0,
        stop=tuple(draw(st.lists(st.sampled_from(["end", "\n", "é", "a."]), max_size=2))),
        stop_token_ids=tuple(draw(st.lists(st.sampled_from(WORDS), max_size=1))),
        ignore_eos=draw(st.booleans()), min_tokens=draw(st.integers(0, min(3, max_tokens))),
        include_stop_str_in_output=draw(st.booleans()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), params=st.lists(params_st(), min_size=1, max_size=4))
def test_the_batched_loop_makes_what_process_makes(data, params) -> None:
    tokens = [data.draw(st.lists(st.sampled_from([EOS, *WORDS, *BYTE]), min_size=12,
                                 max_size=12)) for _ in params]
    batched, left_batched = drive(params, tokens, batched=True)
    one_by_one, left_one_by_one = drive(params, tokens, batched=False)
    assert batched == one_by_one
    assert left_batched == left_one_by_one
    assert sum(o.finished for o in batched) == len(params)  # every request ends, once
    for i, p in enumerate(params):  # without stop strings, all of the output's text streams
        mine = [o for o in batched if o.request_id == f"r{i}"]
        if not p.stop:  # an incomplete last character too, as U+FFFD, whatever the finish
            text = TOK.decode([t for o in mine for t in o.new_token_ids])
            assert "".join(o.new_text for o in mine) == text


def test_bytes_held_for_a_character_are_output_at_every_finish_but_a_stop_string() -> None:
    """A request that ends mid-character (max_tokens, EOS, a stop token) outputs what its
    tokens decode to, the incomplete character as U+FFFD, as the tokenizer's decode and a
    request ended by the pool's limit do; a stop string cuts the text where it starts."""
    ends = {"length": (SamplingParams(max_tokens=2, temperature=0.0), [WORDS[0], BYTE[0]]),
            "EOS": (SamplingParams(max_tokens=8, temperature=0.0), [WORDS[0], BYTE[0], EOS]),
            "stop token": (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=(EOS,)), [WORDS[0], BYTE[0], EOS])}
    for name, (params, tokens) in ends.items():
        made, _ = drive([params], [tokens + [WORDS[2]] * (12 - len(tokens))], batched=True)
        assert "".join(o.new_text for o in made) == " the\ufffd", name
        assert made[-1].finished
    made, _ = drive([SamplingParams(max_tokens=8, temperature=0.0, stop=(" end",))],
                    [[WORDS[0], WORDS[1], BYTE[0]] + [WORDS[2]] * 9], batched=True)
    assert "".join(o.new_text for o in made) == " the"


def test_the_common_row_streams_its_text_and_goes_on() -> None:
    made, left = drive([SamplingParams(max_tokens=4, temperature=0.0)],
                       [[BYTE[0], BYTE[1], WORDS[0], EOS]], batched=True)
    assert [(o.new_text, o.num_output_tokens, o.finish_reason) for o in made] == [
        ("", 1, None), ("é", 2, None), (" the", 3, None), ("", 4, "stop")]
    assert left == []

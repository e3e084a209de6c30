"""The compiled step core (engine/native) on its own: its refusals, that a refused call
changes nothing, and that no call leaks or drops a reference (a C loop over Python objects
can do both silently; the engine's own tests hold what each function computes)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from engine.block_pool import BlockPool
from engine.block_table_rows import BlockTableRows
from engine.kv_cache import KVCacheManager
from engine.output_processor import OutputProcessor
from engine.native import fill_decode_rows, placeholder_sources, schedule_decodes
from engine.request import PLACEHOLDER, Request, RequestStatus
from engine.sampler import SamplingState
from engine.schedule_output import BLOCK_IDS, ScheduleDraft, ScheduledChunk
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from protocol.sampling_params import SamplingParams
from tests.unit.text.test_detokenizer import TOK

BIG = 10**6  # token and position values above the small-int cache: their counts are real


def _decoding_scheduler(num: int) -> tuple[Scheduler, list[Request]]:
    """A scheduler whose `num` requests each decode (prompt computed, one token out)."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=num, max_num_batched_tokens=256),
                          KVCacheManager(BlockPool(num_blocks=64, block_size=4)))
    requests = [Request(f"r{i}", (5, 6, 7), SamplingParams(max_tokens=50, ignore_eos=True))
                for i in range(num)]
    for request in requests:
        scheduler.add_request(request)
    schedule = scheduler.schedule()
    scheduler.update_from_output(schedule, {c.request_id: 9 for c in schedule.chunks})
    return scheduler, requests


def test_a_step_missing_a_token_is_refused_and_changes_nothing() -> None:
    scheduler, requests = _decoding_scheduler(3)
    schedule = scheduler.schedule()
    before = [(r.num_computed_tokens, r.num_steps, list(r.output_token_ids)) for r in requests]
    with pytest.raises(ValueError, match=r"no sampled token for \['r1'\]"):
        scheduler.update_from_output(schedule, {"r0": 1, "r2": 2})
    assert [(r.num_computed_tokens, r.num_steps, list(r.output_token_ids))
            for r in requests] == before
    scheduler.update_from_output(schedule, {"r0": 1, "r1": 3, "r2": 2})  # still outstanding
    assert [r.output_token_ids[-1] for r in requests] == [1, 3, 2]
    scheduler.check_invariants()


def test_buffers_that_are_not_int32_or_too_short_are_refused() -> None:
    chunks = (ScheduledChunk.decode("a", 5, 3, (7,)),)
    good = [np.zeros(4, dtype=np.int32) for _ in range(4)]
    with pytest.raises(TypeError, match="int32"):
        fill_decode_rows(chunks, 1, 4, np.zeros(4, dtype=np.int64), *good[1:])
    with pytest.raises(ValueError, match="slot_mapping: 1 items needed"):
        fill_decode_rows(chunks, 1, 4, good[0], good[1], np.zeros(0, dtype=np.int32), good[3])
    with pytest.raises(ValueError, match="bad row count"):
        fill_decode_rows(chunks, 2, 4, *good)
    assert fill_decode_rows(chunks, 1, 4, *good) is None  # every row samples
    assert [b[0] for b in good] == [5, 3, 7 * 4 + 3, 4]


def test_a_row_that_does_not_sample_is_named() -> None:
    chunks = (ScheduledChunk.decode("a", 5, 0, (1,)), ScheduledChunk("b", (6,), 1, (2,), False))
    buffers = [np.zeros(2, dtype=np.int32) for _ in range(4)]
    assert fill_decode_rows(chunks, 2, 4, *buffers) == [0]


def test_a_request_reloading_its_blocks_sits_out_its_decode() -> None:
    _, requests = _decoding_scheduler(2)
    step = ScheduleDraft(16, 2)
    prefills = schedule_decodes(requests, frozenset({"r0"}), step, 4, RequestStatus.RUNNING,
                                ScheduledChunk, tuple.__new__, lambda r: None)
    assert prefills == [] and list(step.chunks) == ["r1"] and step.budget == 15
    assert step.chunks["r1"] == ("r1", (9,), 3, requests[1].block_ids, True)


def _counts(objects: list[object]) -> list[int]:
    return [sys.getrefcount(o) for o in objects]


def test_no_call_leaks_or_drops_a_reference() -> None:
    """Each function, called many times over the same objects, leaves every object's
    reference count as it found it (a leak grows it by the calls; a dropped reference
    shrinks it and would free an object still in use)."""
    position = BIG + 2
    blocks = tuple(range(BIG, BIG + (position // 4) + 1))
    chunks = (ScheduledChunk.decode("row", BIG + 1, position, blocks),
              ScheduledChunk.decode("next", PLACEHOLDER, position, blocks))
    rows = {"next": BIG + 3}
    objects: list[object] = [*chunks, blocks, rows, rows["next"], chunks[0].request_id,
                             chunks[0].token_ids]
    buffers = [np.zeros(2, dtype=np.int32) for _ in range(4)]
    table = np.zeros((2, len(blocks)), dtype=np.int32)
    before = _counts(objects)
    for _ in range(200):
        fill_decode_rows(chunks, 2, 4, *buffers)
        assert placeholder_sources(chunks, rows, PLACEHOLDER) == ([1], [BIG + 3])
        BlockTableRows().write(table, chunks, field=BLOCK_IDS)
    assert _counts(objects) == before

    # The scheduler's and the output processor's: overlapped steps, as the engine runs them.
    scheduler, requests = _decoding_scheduler(2)
    outputs = OutputProcessor(TOK, scheduler)
    tracked = [outputs.track(r, SamplingState.create(r.sampling_params, r.prompt_token_ids))
               for r in requests]
    for t, r in zip(tracked, requests):
        outputs.join_first_token(t, r.output_token_ids[-1])
    watched: list[object] = [*requests, *tracked, *(r.output_token_ids for r in requests),
                             *(r.request_id for r in requests),
                             *(t.detokenizer for t in tracked)]
    token = TOK.encode(" the", add_special_tokens=False)[0]
    before = _counts(watched)
    for _ in range(20):
        schedule = scheduler.schedule()
        scheduler.update_from_output(schedule, None)  # PLACEHOLDERs
        made = outputs.process_resolved(tracked, [token, token], [None, None])
        assert [o.new_text for o in made] == [" the", " the"]
        del schedule, made
    assert _counts(watched) == before

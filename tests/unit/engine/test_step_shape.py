"""Step and queue shapes: what the step-time model is fitted on and predicts from."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.request import Request, RequestStatus
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from engine.step_shape import QueueShape, StepShape, queue_shape, step_shape
from protocol.sampling_params import SamplingParams


def chunk(rid: str, n: int, start: int) -> ScheduledChunk:
    return ScheduledChunk(rid, tuple(range(n)), start, (0,), sample=True)


def test_a_step_is_split_into_prefill_tokens_and_decoding_sequences() -> None:
    schedule = ScheduleOutput((chunk("a", 100, 0), chunk("b", 28, 64), chunk("c", 1, 200),
                               chunk("d", 1, 31), chunk("e", 1, 0)))
    assert step_shape(schedule) == StepShape(prefill_tokens=129, decode_seqs=2,
                                             context_tokens=201 + 32)
    assert step_shape(None) == StepShape()


def request(rid: str, prompt: int, status: RequestStatus, computed: int = 0,
            outputs: int = 0) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams())
    r.status = status
    r.num_computed_tokens = computed
    r.output_token_ids.extend(range(outputs))
    return r


def test_the_queue_counts_prompt_tokens_left_and_decoding_context() -> None:
    requests = [request("w", 300, RequestStatus.WAITING),
                request("p", 500, RequestStatus.RUNNING, computed=200),
                request("d", 50, RequestStatus.RUNNING, computed=59, outputs=10),
                request("done", 80, RequestStatus.PREFILLED, computed=80)]
    assert queue_shape(requests) == QueueShape(prefill_tokens=300 + 300, decode_seqs=1,
                                               context_tokens=60)


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), max_size=10))
def test_a_step_shape_is_the_rule_applied_to_each_chunk(shapes: list[tuple[int, int]]) -> None:
    """A one-token chunk after position 0 is a decode (context: its end), anything else
    prefills its tokens, whatever the order of the chunks."""
    schedule = ScheduleOutput(tuple(chunk(f"r{i}", n, start) for i, (n, start)
                                    in enumerate(shapes)))
    decodes = [(n, start) for n, start in shapes if n == 1 and start > 0]
    assert step_shape(schedule) == StepShape(
        prefill_tokens=sum(n for n, start in shapes if not (n == 1 and start > 0)),
        decode_seqs=len(decodes), context_tokens=sum(start + 1 for _, start in decodes))

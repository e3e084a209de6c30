"""Engine outputs merged into one frame keep each token's text apart."""

from __future__ import annotations

from engine.llm_engine import RequestOutput
from engine.sampler import TokenLogprobs
from protocol.finish_reason import FinishReason
from worker.output_frames import merge_outputs


def output(token_ids: list[int], text: str, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput("r", token_ids, text, [None] * len(token_ids), finish, 3, 2, 0,
                         num_steps=4)


def test_one_output_is_one_text() -> None:
    frame = merge_outputs("r", [output([5], "a")])
    assert (frame.token_ids, frame.text, frame.texts) == ([5], "a", None)


def test_several_one_token_outputs_keep_their_texts_and_the_last_finishes() -> None:
    frame = merge_outputs("r", [output([5], "a"), output([6], ""),
                                output([7], "bc", FinishReason.STOP)])
    assert frame.token_ids == [5, 6, 7] and frame.text == "" and frame.texts == ["a", "", "bc"]
    assert frame.finish_reason is FinishReason.STOP
    assert frame.usage is not None and frame.usage.num_steps == 4


def test_an_output_of_several_tokens_falls_back_to_one_text() -> None:
    frame = merge_outputs("r", [output([5, 6], "ab"), output([7], "c")])
    assert (frame.text, frame.texts) == ("abc", None)


def test_the_one_plain_output_frame_is_what_the_general_merge_makes() -> None:
    """A single unfinished output without logprobs takes a shortcut; same frame."""
    from protocol.messages import TokenFrame

    plain = merge_outputs("r", [output([5], "a")])
    assert plain == TokenFrame(request_id="r", token_ids=[5], text="a")
    with_logprobs = RequestOutput("r", [5], "a", [TokenLogprobs(5, -0.5, (5,), (-0.5,))],
                                  None, 3, 2, 0)
    assert merge_outputs("r", [with_logprobs]).logprobs is not None
    assert merge_outputs("r", [output([5], "a", FinishReason.LENGTH)]).usage is not None

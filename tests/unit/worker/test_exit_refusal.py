"""A worker takes the operations agent's exit request only for an epoch it registered."""

from __future__ import annotations

from protocol.agent_messages import ExitRequest
from worker.runtime import exit_refusal


def test_the_epoch_judged_or_none_is_taken() -> None:
    assert exit_refusal(ExitRequest(reason="hung", epoch=3), {3}) is None
    assert exit_refusal(ExitRequest(reason="hung"), {3}) is None  # an agent that names none


def test_an_earlier_role_of_the_same_process_is_still_this_process() -> None:
    assert exit_refusal(ExitRequest(epoch=3), {3, 4}) is None


def test_the_replacement_at_the_same_address_refuses_the_exit_meant_for_the_dead() -> None:
    refusal = exit_refusal(ExitRequest(epoch=1), {2})
    assert refusal is not None and "epoch 1" in refusal
    assert exit_refusal(ExitRequest(epoch=1), set()) is not None  # not registered yet

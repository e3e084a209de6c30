"""How many prompt tokens a step that also decodes may compute (pure policy).

A worker that both prefills and decodes (a `both` worker, one engine and one KV pool on its
device) shares each step between its decoding requests and the prompts waiting for their
first token. A fixed budget (`--max-num-batched-tokens`) either stretches the decode rows'
step past their time-per-output-token target (big chunks on a big model) or prefills more
slowly than the target allows (small chunks). Held to the target instead, a step takes the
prompt tokens that the tightest TPOT target among its decoding rows leaves, by the worker's
own fitted step model (worker/step_fit.py):

    room   = tpot_target * HEADROOM - step_s(0 prompt tokens, the decode rows, their context)
    budget = clamp(room / prefill_token_s, MIN_PREFILL_TOKENS, the fixed budget left)

Decode rows hold their target; prefill takes whatever the step has left, up to the fixed
budget, which still bounds every step (it sizes the runner's buffers and graphs).

Where the target cannot be held (the decode rows alone already take longer than it, as on a
CPU, where a decode step of the default model takes 54 ms against the 50 ms of the strictest
shipped tier), or nothing is known to hold it by (no model yet, no prefill term fitted, no
decoding row with a target), the fixed budget applies unchanged: the policy never slows a
prompt for a target it cannot keep. At least MIN_PREFILL_TOKENS per step, so a prompt always
progresses.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.request import Request
from protocol.worker_load import StepModel

STEP_BUDGET_CHOICES = ("auto", "tpot", "fixed")
HEADROOM = 0.9  # of the target: the model's error and the step's jitter
MIN_PREFILL_TOKENS = 32  # per step, however tight the target: every prompt progresses


def prefill_token_budget(model: StepModel | None, num_decodes: int, decode_context_tokens: int,
                         tightest_tpot_s: float | None, fixed_left: int) -> int:
    """The prompt tokens a step may add to `num_decodes` decode rows attending over
    `decode_context_tokens`, given the tightest TPOT target among them (None: none has one)
    and the fixed budget left after them (`fixed_left`). Never above `fixed_left`."""
    if fixed_left <= 0:
        return max(fixed_left, 0)
    if (model is None or num_decodes == 0 or tightest_tpot_s is None
            or model.num_prefill_samples == 0 or model.num_decode_samples == 0
            or model.prefill_token_s <= 0):
        return fixed_left
    room_s = tightest_tpot_s * HEADROOM - model.step_s(0, num_decodes, decode_context_tokens)
    if room_s <= 0:
        return fixed_left  # the decode rows miss it anyway: holding prompts back buys nothing
    return max(min(int(room_s / model.prefill_token_s), fixed_left),
               min(MIN_PREFILL_TOKENS, fixed_left))


def budget_beside(model: StepModel, seated: Sequence[Request], chunks: Collection[str],
                  fixed_left: int) -> int:
    """`prefill_token_budget` for a step whose decode rows are the `seated` requests with a
    chunk (by id) in `chunks`."""
    decodes = [r for r in seated if r.request_id in chunks]
    targets = [r.tpot_s for r in decodes if r.tpot_s is not None]
    return prefill_token_budget(model, len(decodes), sum(r.num_computed_tokens for r in decodes),
                                min(targets) if targets else None, fixed_left)


def holds_tpot(option: str, device: str) -> bool:
    """`option` is one of STEP_BUDGET_CHOICES. auto: fixed everywhere until `tpot` has been
    measured against it on a GPU (docs/performance.md, "Steps held to TPOT"); on the CPU a
    decode step of the default model (54 ms) already misses the strictest shipped TPOT
    (50 ms), so there the budget would be the fixed one anyway."""
    if option not in STEP_BUDGET_CHOICES:
        raise ValueError(f"step budget {option!r}: one of {', '.join(STEP_BUDGET_CHOICES)}")
    return option == "tpot"

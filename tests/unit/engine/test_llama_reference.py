"""Our loader + model + paged attention against transformers, the independent reference.

Tiny random checkpoints (written by transformers) cover every supported variant; the
default GGUF model is compared with transformers' own GGUF dequantization and conversion.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.kv_storage import KVStorage
from engine.loader import load_model
from engine.schedule_output import ScheduledChunk, ScheduleOutput

pytestmark = pytest.mark.usefixtures("single_thread")

VARIANTS = ["llama3_rope", "llama_head_dim", "llama_tied", "llama_untied", "qwen2_bias",
            "sharded", "qwen3", "gemma2", "mistral_window",
            "qwen3_window", "qwen3_moe", "qwen3_moe_sparse_step",
            "mixtral", "qwen2_moe"]  # the checkpoints conftest.write_tiny_model knows

PROMPTS = [[5], [17, 3, 99, 250, 42, 8, 311], [(7 * i + 3) % 320 for i in range(19)]]
NUM_GREEDY = 32
# Non-contiguous, out-of-order block ids so block-table indexing is really exercised.
BLOCKS = [list(range(60, 40, -1)), [3, 9, 1, 30, 7, 22, 15, 2, 11, 4, 33, 5, 6, 8, 10, 12],
          list(range(13, 29))]


def reference_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by transformers with its own KV cache."""
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out


def reference_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((ours - reference).abs().max() / reference.abs().max())


def all_position_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Our logits at every prompt position (the runner returns only the last one)."""
    block_size = 4
    kv = KVStorage.for_model(model.config, 16, block_size, torch.float32)
    schedule = ScheduleOutput((ScheduledChunk("r", tuple(prompt), 0, tuple(range(15, -1, -1)),
                                              True),))
    meta = AttentionMetadata.from_schedule(schedule, block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), kv, meta)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(tiny_model, stepper, variant):
    tiny = tiny_model(variant)
    loaded = load_model(str(tiny.path))
    runner = stepper(loaded.model)
    for prompt, blocks in zip(PROMPTS, BLOCKS):
        ours = runner.step(("r" + str(len(prompt)), prompt, 0, blocks, True))
        reference = reference_logits(tiny.reference, prompt)
        assert ours.shape == (1, 320) and ours.dtype == torch.float32
        assert rel_error(ours[0], reference[-1]) < 1e-4
    every = all_position_logits(loaded.model, PROMPTS[2])
    assert rel_error(every, reference_logits(tiny.reference, PROMPTS[2])) < 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decode_through_paged_cache_matches_transformers(tiny_model, stepper, variant):
    tiny = tiny_model(variant)
    model = load_model(str(tiny.path)).model
    for prompt, blocks in zip(PROMPTS, BLOCKS):
        expected = reference_greedy(tiny.reference, prompt, NUM_GREEDY)
        assert stepper(model).greedy(prompt, NUM_GREEDY, blocks) == expected
    # The test only means something if the continuations are not all one repeated token.
    assert len(set(expected)) > 3


def test_bfloat16_model_tracks_float32_reference(tiny_model, stepper):
    tiny = tiny_model("llama_untied")
    loaded = load_model(str(tiny.path), dtype=torch.bfloat16)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    runner = stepper(loaded.model)
    assert runner.kv.kv.dtype == torch.bfloat16
    ours = runner.step(("r", PROMPTS[2], 0, BLOCKS[2], True))
    assert ours.dtype == torch.float32
    # bf16 keeps 8 mantissa bits; two layers of rounding stay within a few percent.
    assert rel_error(ours[0], reference_logits(tiny.reference, PROMPTS[2])[-1]) < 5e-2


# --- the default GGUF model -------------------------------------------------------------

# Token ids of SmolLM2's tokenizer for: "The capital of France is"; a chat-formatted
# "Write one sentence about the sea."; "def fibonacci(n):\n    ".
GGUF_PROMPTS = [
    [504, 3575, 282, 4649, 314],
    [1, 4093, 198, 19161, 582, 6330, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198],
    [1604, 3987, 46477, 24, 94, 727, 2367],
]


@pytest.fixture(scope="module")
def gguf_pair(single_thread, hf_reference):
    """(our LoadedModel, transformers' model built by its own GGUF loader)."""
    return load_model("default"), hf_reference.model


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_default_gguf_logits_match_transformers(gguf_pair, stepper):
    ours, reference = gguf_pair
    runner = stepper(ours.model, num_blocks=32, block_size=16)
    for i, prompt in enumerate(GGUF_PROMPTS):
        logits = runner.step((f"r{i}", prompt, 0, [3 * i, 3 * i + 1, 3 * i + 2], True))
        assert rel_error(logits[0], reference_logits(reference, prompt)[-1]) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_default_gguf_greedy_matches_transformers(gguf_pair, stepper):
    ours, reference = gguf_pair
    continuations = []
    for i, prompt in enumerate(GGUF_PROMPTS):
        expected = reference_greedy(reference, prompt, NUM_GREEDY)
        got = stepper(ours.model, num_blocks=8, block_size=16).greedy(
            prompt, NUM_GREEDY, [7, 2, 5, 0], request_id=f"r{i}")
        assert got == expected
        continuations.append(got)
    # "The capital of France is" continues with " Paris" in this model.
    assert continuations[0][0] == 7042

"""Random checkpoints in real shapes (testing/random_model.py) are real checkpoints: our
loader reads back the shape they were written from, and transformers loads the same files
and computes the same logits as our model (fp32, the toy shapes of each family)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.loader import load_model
from testing.random_model import hf_config, write_weights
from testing.shapes import SHAPES


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_a_random_checkpoint_loads_here_and_in_transformers_alike(shape, tmp_path) -> None:
    import transformers

    write_weights(tmp_path, shape, vocab_size=320, dtype_name="float32", seed=3)
    ours = load_model(str(tmp_path)).model
    assert ours.config == dataclasses.replace(SHAPES[shape], vocab_size=320, bos_token_id=1,
                                              eos_token_ids=(2,))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.tensor([[5, 17, 3, 99, 250, 42, 8, 311]])
    with torch.no_grad():
        expected = reference(prompt).logits[0, -1]
    from engine.kv_storage import KVStorage
    from engine.model_runner import ModelRunner
    from engine.schedule_output import ScheduledChunk, ScheduleOutput

    runner = ModelRunner(ours, KVStorage.for_model(ours.config, 4, 16, torch.float32), 16)
    schedule = ScheduleOutput((ScheduledChunk("r", tuple(prompt[0].tolist()), 0, (0,), True),))
    got = runner.execute(schedule, None, None)[0].float()
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-4


def test_shapes_of_other_families_are_refused_clearly() -> None:
    gemma = dataclasses.replace(SHAPES["tiny"], architecture="Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM"):
        hf_config(gemma, "float32")

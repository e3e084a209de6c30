"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on the device: the runner's default path
(on CUDA: Triton kernels for attention and norms, the fused expert block, decode steps
replayed from CUDA graphs) against transformers on the same device.

fp32 on both sides, so that a routing decision cannot flip on bf16 rounding (a flipped
expert moves a token's output by tens of percent); the Triton matmuls may use TF32, hence
a tolerance of 1e-2 of the largest logit. On the CPU the kernel path runs under Triton's
interpreter (conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_storage import KVStorage
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.schedule_output import ScheduledChunk, ScheduleOutput

pytestmark = pytest.mark.timeout(300)

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 320 for i in range(29)]
BLOCKS = [5, 2, 9, 0]
NUM_GREEDY = 12
TOLERANCE = 1e-2
_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, initializer_range=0.25, tie_word_embeddings=False)


def reference(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**_COMMON, head_dim=24, num_experts=4,
                                             num_experts_per_tok=2, moe_intermediate_size=48,
                                             norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(**_COMMON, num_local_experts=4,
                                            num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM
    config._attn_implementation = "eager"
    return model(config).eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def pair(request, tmp_path_factory):
    hf = reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_model(str(path), device=DEVICE).model
    return ours, hf.to(DEVICE)


def step(runner: ModelRunner, tokens: list[int], start: int) -> torch.Tensor:
    return runner.execute(ScheduleOutput((ScheduledChunk("r", tuple(tokens), start,
                                                         tuple(BLOCKS), True),)))


def test_default_runner_replays_graphs_and_matches_transformers(pair):
    ours, hf = pair
    kv = KVStorage.for_model(ours.config, 16, BLOCK_SIZE, torch.float32, DEVICE)
    # On the CPU the padded graph steps run eagerly: the fused block under the interpreter.
    sizes = {} if ON_CUDA else dict(use_kernels=True, cuda_graph_batch_sizes=(1, 2))
    runner = ModelRunner(ours, kv, BLOCK_SIZE, **sizes)
    assert runner.use_kernels and runner.graphs is not None
    assert runner.graphs.can_run(ScheduleOutput((ScheduledChunk("r", (1,), 40, tuple(BLOCKS),
                                                                True),)))
    sequence = list(PROMPT)
    logits = step(runner, sequence, 0)
    num_decisive = 0
    with torch.no_grad():
        for _ in range(NUM_GREEDY):
            expected = hf(torch.tensor([sequence], device=DEVICE)).logits[0, -1].float()
            scale = float(expected.abs().max())
            assert float((logits[0] - expected).abs().max()) / scale < TOLERANCE
            top2 = expected.topk(2).values
            token = int(expected.argmax())
            if float(top2[0] - top2[1]) > TOLERANCE * scale:
                assert int(logits[0].argmax()) == token
                num_decisive += 1
            sequence.append(token)
            logits = step(runner, [token], len(sequence) - 1)
    assert num_decisive >= NUM_GREEDY // 2

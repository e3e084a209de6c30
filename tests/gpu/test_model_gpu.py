"""The model's Triton kernel path against its torch path, against `transformers`, and decode
CUDA graphs against eager steps.

On a CUDA device everything runs in bf16. On the CPU the kernel path runs under Triton's
interpreter in fp32 (set in conftest.py), with the padded graph steps run eagerly: that
checks the metadata, the fused projections and the padding logic; the comparisons with
transformers and real graph replay need CUDA and are skipped there.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import Llama3RopeScaling, ModelConfig
from engine.kv_storage import KVStorage
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.schedule_output import ScheduledChunk, ScheduleOutput

pytestmark = pytest.mark.timeout(300)

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPE = torch.bfloat16 if ON_CUDA else torch.float32
BLOCK_SIZE = 16
VOCAB = 512
# Relative to the largest logit: bf16 keeps 8 mantissa bits, fp32 in the interpreter ~23.
LOGIT_TOLERANCE = 3e-2 if ON_CUDA else 1e-4
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")

PROMPTS = [[5, 17, 3, 99, 250, 42, 8, 311, 7, 7, 400],
           [(7 * i + 3) % VOCAB for i in range(37)],
           [1, 2]]
TABLES = [[9, 2, 14, 0], [3, 11, 1, 30, 7], [20, 4]]  # shuffled, non-contiguous


def hf_config(rope_llama3: bool):
    from transformers import LlamaConfig

    rope = (dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                 high_freq_factor=4.0, original_max_position_embeddings=32)
            if rope_llama3 else dict(rope_type="default", rope_theta=10000.0))
    # A large init scale gives logits clear winners, so greedy comparisons test the model
    # rather than rounding noise between near-equal logits.
    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.25,
                       tie_word_embeddings=False, rope_parameters=rope)


def model_config(rope_llama3: bool) -> ModelConfig:
    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 32) if rope_llama3 else None
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=128,
                       intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=32, rms_norm_eps=1e-5,
                       rope_theta=500000.0 if rope_llama3 else 10000.0,
                       max_position_embeddings=256, tie_word_embeddings=False,
                       rope_scaling=scaling)


# The interpreter is slow: on CPU only the Llama-3 RoPE variant (the one with scaling).
@pytest.fixture(scope="module", params=[False, True] if ON_CUDA else [True],
                ids=(["rope-default", "rope-llama3"] if ON_CUDA else ["rope-llama3"]))
def pair(request):
    """(transformers model, our model) with the same random weights, on DEVICE in DTYPE."""
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    reference = HFLlama(hf_config(request.param)).eval().to(DEVICE, DTYPE)
    ours = LlamaForCausalLM(model_config(request.param), dtype=DTYPE, device=DEVICE)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(reference.state_dict()[name])
    return reference, ours.eval()


def make_runner(model, use_kernels: bool, graph_sizes=()) -> ModelRunner:
    kv = KVStorage.for_model(model.config, 40, BLOCK_SIZE, DTYPE, DEVICE)
    return ModelRunner(model, kv, BLOCK_SIZE, use_kernels=use_kernels,
                       cuda_graph_batch_sizes=graph_sizes)


def step(runner: ModelRunner, *chunks) -> torch.Tensor:
    return runner.execute(ScheduleOutput(tuple(
        ScheduledChunk(rid, tuple(ids), start, tuple(blocks), sample)
        for rid, ids, start, blocks, sample in chunks)))


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


def greedy_batch(runner: ModelRunner, num_tokens: int, chunked: bool) -> list[list[int]]:
    """Prefill every prompt (in two chunks when `chunked`, batched with the others), then
    decode them together one token per step."""
    chunks = []
    for i, (prompt, table) in enumerate(zip(PROMPTS, TABLES)):
        cut = len(prompt) // 2 if chunked and len(prompt) > 2 else 0
        if cut:
            step(runner, (f"r{i}", prompt[:cut], 0, table, False))
        chunks.append((f"r{i}", prompt[cut:], cut, table, True))
    logits = step(runner, *chunks)
    seqs = [list(p) for p in PROMPTS]
    outs: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(num_tokens):
        for i, row in enumerate(logits):
            outs[i].append(int(row.argmax()))
            seqs[i].append(outs[i][-1])
        logits = step(runner, *[(f"r{i}", [s[-1]], len(s) - 1, TABLES[i], True)
                                for i, s in enumerate(seqs)])
    return outs


def test_kernel_path_logits_and_cache_match_torch_path(pair):
    _, model = pair
    torch_runner, kernel_runner = make_runner(model, False), make_runner(model, True)
    # A mixed step: a chunk continuing a cached prefix, a fresh prompt, and a decode row.
    for runner in (torch_runner, kernel_runner):
        step(runner, ("a", PROMPTS[1][:20], 0, TABLES[1], False),
             ("c", PROMPTS[2], 0, TABLES[2], True))
    chunks = (("a", PROMPTS[1][20:], 20, TABLES[1], True),
              ("b", PROMPTS[0], 0, TABLES[0], True),
              ("c", [9], 2, TABLES[2], True))
    expected, got = step(torch_runner, *chunks), step(kernel_runner, *chunks)
    assert got.shape == expected.shape == (3, VOCAB)
    assert rel_error(got, expected) < LOGIT_TOLERANCE
    live = [b for t in TABLES for b in t]  # blocks outside every table stay zero in both
    assert torch.allclose(kernel_runner.kv.kv[:, :, live].float(),
                          torch_runner.kv.kv[:, :, live].float(),
                          atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
    assert not kernel_runner.kv.kv[:, :, [b for b in range(40) if b not in live]].any()


def test_kernel_path_greedy_matches_torch_path(pair):
    _, model = pair
    expected = greedy_batch(make_runner(model, False), 6, chunked=False)
    assert greedy_batch(make_runner(model, True), 6, chunked=True) == expected
    assert len({t for seq in expected for t in seq}) > 3


def test_padded_decode_steps_match_unpadded_steps(pair):
    """Batches of 3 run as a padded 4 (graph sizes 2 and 4); a batch of 1 as size 2."""
    _, model = pair
    eager = make_runner(model, True)
    padded = make_runner(model, True, graph_sizes=(2, 4))
    assert padded.graphs is not None and padded.graphs.captured == True  # noqa: E712
    padded.graphs.check_invariants()
    assert greedy_batch(padded, 5, chunked=False) == greedy_batch(eager, 5, chunked=False)
    for runner in (eager, padded):
        step(runner, ("s", PROMPTS[0], 0, [33, 34], True))
    single = (("s", [77], len(PROMPTS[0]), [33, 34], True),)
    assert rel_error(step(padded, *single), step(eager, *single)) < LOGIT_TOLERANCE
    # Padding rows (slot -1) wrote nothing: the caches agree everywhere.
    assert torch.allclose(padded.kv.kv.float(), eager.kv.kv.float(),
                          atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


@needs_cuda
def test_cuda_graph_replay_gives_eager_logits(pair):
    _, model = pair
    eager = make_runner(model, True)
    graphed = make_runner(model, True, graph_sizes=(1, 2, 4, 8))
    for runner in (eager, graphed):
        step(runner, *[(f"r{i}", p, 0, t, True) for i, (p, t) in enumerate(zip(PROMPTS, TABLES))])
    chunks = [(f"r{i}", [11 + i], len(p), t, True)
              for i, (p, t) in enumerate(zip(PROMPTS, TABLES))]
    assert graphed.graphs.can_run(ScheduleOutput(tuple(
        ScheduledChunk(r, tuple(ids), s, tuple(b), smp) for r, ids, s, b, smp in chunks)))
    got, expected = step(graphed, *chunks), step(eager, *chunks)
    assert rel_error(got, expected) < LOGIT_TOLERANCE
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    # Replaying again with other inputs gives other logits: the graph reads the new inputs.
    again = step(graphed, *[(r, [ids[0] + 100], s + 1, b, smp) for r, ids, s, b, smp in chunks])
    assert rel_error(again, got) > 1e-3


@needs_cuda
def test_kernel_path_matches_transformers_in_bf16(pair):
    reference, model = pair
    runner = make_runner(model, True, graph_sizes=(1, 4))
    for i, (prompt, table) in enumerate(zip(PROMPTS, TABLES)):
        ours = step(runner, (f"p{i}", prompt, 0, table, True))
        with torch.no_grad():
            theirs = reference(torch.tensor([prompt], device=DEVICE)).logits[0, -1]
        assert rel_error(ours[0], theirs) < LOGIT_TOLERANCE


@needs_cuda
def test_greedy_matches_transformers_in_bf16(pair):
    reference, model = pair
    ours = greedy_batch(make_runner(model, True, graph_sizes=(1, 2, 4)), 8, chunked=True)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=8,
                                     min_new_tokens=8, do_sample=False)
        assert out[0, len(prompt):].tolist() == got

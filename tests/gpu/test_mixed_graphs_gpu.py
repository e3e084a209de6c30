"""Steps with prefill chunks as padded graph steps (engine/mixed_graphs.py) against the eager
kernel path and the torch path (the reference), on the model of test_model_gpu.py.

On the CPU the padded steps run eagerly under Triton's interpreter in fp32: the static
buffers, the padding, the absolute prefill rows and the sampled rows are checked there;
only real graph replay needs CUDA.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_storage import KVStorage
from engine.mixed_graphs import MixedShape
from engine.model_runner import ModelRunner
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from tests.gpu.test_model_gpu import (BLOCK_SIZE, DEVICE, DTYPE, PROMPTS, TABLES, TOLERANCE,
                                      cache_error, interpreter_budget, needs_cuda, pair,
                                      rel_error, unused_blocks)

pytestmark = pytest.mark.timeout(300)

__all__ = ["interpreter_budget", "pair"]  # the fixtures, shared with test_model_gpu.py


def runner(model, mixed_graph_tokens: int) -> ModelRunner:
    kv = KVStorage.for_model(model.config, 40, BLOCK_SIZE, DTYPE, DEVICE)
    return ModelRunner(model, kv, BLOCK_SIZE, use_kernels=True, cuda_graph_batch_sizes=(),
                       mixed_graph_tokens=mixed_graph_tokens)


def schedule(*chunks) -> ScheduleOutput:
    return ScheduleOutput(tuple(ScheduledChunk(rid, tuple(ids), start, tuple(blocks), sample)
                                for rid, ids, start, blocks, sample in chunks))


NEW_TABLE = [33, 34]
# What a serving loop meets, as the scheduler orders it (decode rows first): prompts alone,
# a prompt joining decodes, a chunk continuing a cached prefix beside decodes, a one-token
# last chunk, chunks that do not sample; with the shape each must be padded to.
STEPS = [
    ((("a", PROMPTS[1][:20], 0, TABLES[1], False),
      ("b", PROMPTS[0], 0, TABLES[0], True)), MixedShape(32, 0)),
    ((("b", [13], len(PROMPTS[0]), TABLES[0], True),
      ("a", PROMPTS[1][20:], 20, TABLES[1], True),
      ("c", PROMPTS[2][:1], 0, TABLES[2], False)), MixedShape(32, 4)),
    ((("b", [21], len(PROMPTS[0]) + 1, TABLES[0], True),
      ("a", [7], len(PROMPTS[1]), TABLES[1], True),
      ("d", [3, 1, 4, 1, 5], 0, NEW_TABLE, True),
      ("c", PROMPTS[2][1:], 1, TABLES[2], True)), MixedShape(16, 4)),
]


def test_padded_mixed_steps_match_eager_steps_and_the_torch_path(pair):
    _, model = pair
    graphed, eager = runner(model, 32), runner(model, 0)
    reference = ModelRunner(model, KVStorage.for_model(model.config, 40, BLOCK_SIZE, DTYPE,
                                                       DEVICE), BLOCK_SIZE, use_kernels=False)
    assert eager.mixed_graphs is None and graphed.mixed_graphs is not None
    graphs = graphed.mixed_graphs
    assert graphs.token_sizes == (16, 32) and graphs.decode_sizes == (0, 4, 16)
    assert len(graphs.shapes) == 6 and graphs.captured
    for chunks, shape in STEPS:
        step = schedule(*chunks)
        assert graphs.shape_for(step) == shape
        runs = graphs.num_runs
        got = graphed.execute(step)
        assert graphs.num_runs == runs + 1  # replayed, not run eagerly
        graphs.check_invariants()
        want, exact = eager.execute(step), reference.execute(step)
        num_sampled = sum(c[4] for c in chunks)
        assert got.shape == exact.shape == (num_sampled, model.config.vocab_size)
        for row in range(num_sampled):
            assert rel_error(got[row], exact[row]) < TOLERANCE, f"{shape} row {row}"
            assert rel_error(got[row], want[row]) < TOLERANCE, f"{shape} row {row}"
    live = [b for t in [*TABLES, NEW_TABLE] for b in t]
    assert cache_error(graphed.kv, reference.kv, live) < TOLERANCE
    # Padding tokens (slot -1) wrote nothing: blocks outside every table are still zero.
    assert not graphed.kv.kv[:, :, unused_blocks(*TABLES, NEW_TABLE)].any()


def test_steps_without_a_shape_run_eagerly(pair):
    """Too many tokens, too many prefill chunks, pure decodes: no shape; the runner's
    eager path gives the same logits as a runner without mixed graphs."""
    _, model = pair
    graphed, eager = runner(model, 16), runner(model, 0)
    graphs = graphed.mixed_graphs
    assert graphs is not None
    long_step = schedule(("a", PROMPTS[1], 0, TABLES[1], True))
    nine = schedule(*[(f"n{i}", [i + 1, i + 2], 0, [31 + i], True) for i in range(9)])
    decodes = schedule(("a", [5], 37, TABLES[1], True))
    for step in (long_step, nine, decodes):
        assert graphs.shape_for(step) is None
    for step in (long_step, nine, decodes):
        got, want = graphed.execute(step), eager.execute(step)
        assert rel_error(got, want) < TOLERANCE
    assert graphs.num_runs == 0 and graphs.try_run(long_step) is None


@needs_cuda
def test_graph_replay_reads_each_steps_inputs(pair):
    """Replays of one graph with other inputs give other logits, each equal to eager's."""
    _, model = pair
    graphed, eager = runner(model, 32), runner(model, 0)
    first, _ = STEPS[0]
    for r in (graphed, eager):
        r.execute(schedule(*first))
    a = (("b", [13], len(PROMPTS[0]), TABLES[0], True), ("c", PROMPTS[2], 0, TABLES[2], True))
    b = (("b", [99], len(PROMPTS[0]), TABLES[0], True), ("c", PROMPTS[2], 0, TABLES[2], True))
    assert graphed.mixed_graphs.shape_for(schedule(*a)) == MixedShape(16, 4)
    # A replay's logits are the graph's static output: a's are copied before b replays.
    got_a = graphed.execute(schedule(*a)).clone()
    got_b = graphed.execute(schedule(*b))
    want_b = eager.execute(schedule(*b))
    assert rel_error(got_b, want_b) < TOLERANCE
    assert rel_error(got_a[0], got_b[0]) > 10 * TOLERANCE

"""ModelRunner: chunked prefill, batching and prefix reuse give what running alone gives."""

from __future__ import annotations

import pytest
import torch

from engine.attention_metadata import AttentionMetadata
from engine.kv_storage import KVStorage
from engine.loader import load_model
from engine.mixed_split import mixed_split_threshold, split_mixed_step
from engine.model_runner import DeviceTokens, ModelRunner, placeholder_fill, placeholder_sources
from engine.request import PLACEHOLDER
from engine.schedule_output import ScheduledChunk, ScheduleOutput

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 320
PROMPT_A = [(11 * i + 5) % VOCAB for i in range(19)]
PROMPT_B = [4, 200, 31, 77, 9, 150, 6]
PROMPT_C = [300, 1]
# Same-length tolerance: the batched matmuls may block differently from the lone ones.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model(str(tiny_model("llama_untied").path)).model


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max() / b.abs().max()) < TOLERANCE


def continue_greedy(runner, rid, seq, logits, blocks, num_tokens):
    seq, out = list(seq), []
    for _ in range(num_tokens):
        out.append(int(logits[0].argmax()))
        seq.append(out[-1])
        logits = runner.step((rid, [out[-1]], len(seq) - 1, blocks, True))
    return out


def test_chunked_prefill_matches_one_shot_prefill(model, stepper):
    blocks = [9, 2, 14, 0, 7, 11, 3, 5, 20, 21, 22, 23, 24, 25]
    alone = stepper(model)
    whole = alone.step(("a", PROMPT_A, 0, blocks, True))

    chunked = stepper(model)
    assert chunked.step(("a", PROMPT_A[:5], 0, blocks, False)).shape == (0, VOCAB)
    assert chunked.step(("a", PROMPT_A[5:12], 5, blocks, False)).shape == (0, VOCAB)
    last = chunked.step(("a", PROMPT_A[12:], 12, blocks, True))
    assert close(last, whole)
    # Same cache contents for every prompt position, whichever way it was computed.
    assert torch.allclose(chunked.kv.kv, alone.kv.kv, rtol=0, atol=1e-5)
    assert stepper(model).greedy(PROMPT_A, 16, blocks) == alone.greedy(PROMPT_A, 16, blocks)


def test_batched_step_matches_each_sequence_alone(model, stepper):
    blocks = {"a": [0, 1, 2, 3, 4, 5], "b": [10, 9, 8, 7], "c": [20, 21, 22]}
    expected = {}
    for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", PROMPT_C)):
        expected[rid] = stepper(model).step((rid, prompt, 0, blocks[rid], True))[0]

    batched = stepper(model)
    # b's prompt is already cached except its last token; c is mid-prefill (no sample).
    batched.step(("b", PROMPT_B[:-1], 0, blocks["b"], False))
    logits = batched.step(("a", PROMPT_A, 0, blocks["a"], True),
                          ("c", PROMPT_C[:1], 0, blocks["c"], False),
                          ("b", PROMPT_B[-1:], len(PROMPT_B) - 1, blocks["b"], True))
    assert logits.shape == (2, VOCAB)
    assert close(logits[0], expected["a"]) and close(logits[1], expected["b"])
    logits = batched.step(("c", PROMPT_C[1:], 1, blocks["c"], True))
    assert close(logits[0], expected["c"])


def test_concurrent_greedy_decode_matches_alone(model, stepper):
    prompts = {"a": PROMPT_A, "b": PROMPT_B, "c": PROMPT_C}
    blocks = {"a": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [19, 18, 17, 16, 15, 14, 13],
              "c": [30, 25, 31, 26, 32, 27, 33]}
    num_tokens = 20
    alone = {rid: stepper(model).greedy(p, num_tokens, blocks[rid], rid)
             for rid, p in prompts.items()}

    batch = stepper(model)
    seqs = {rid: list(p) for rid, p in prompts.items()}
    logits = batch.step(*((rid, p, 0, blocks[rid], True) for rid, p in prompts.items()))
    out = {rid: [] for rid in prompts}
    for step in range(num_tokens):
        for row, rid in enumerate(prompts):
            out[rid].append(int(logits[row].argmax()))
            seqs[rid].append(out[rid][-1])
        if step < num_tokens - 1:
            logits = batch.step(*((rid, [seqs[rid][-1]], len(seqs[rid]) - 1, blocks[rid], True)
                                  for rid in prompts))
    assert out == alone
    assert len({tuple(v) for v in out.values()}) == 3


def test_prefix_reuse_computes_only_the_suffix(model, stepper):
    block_size = 4
    prefix = PROMPT_A[:12]  # three full blocks
    suffix = [8, 250, 3, 99, 17]
    shared, own = [5, 1, 12], [7, 30, 31, 32]

    fresh = stepper(model, block_size=block_size)
    expected = fresh.step(("b", prefix + suffix, 0, shared + own, True))

    reuse = stepper(model, block_size=block_size)
    reuse.step(("a", prefix, 0, shared + [40], True))
    before = reuse.kv.kv[:, :, shared].clone()
    got = reuse.step(("b", suffix, len(prefix), shared + own, True))
    assert close(got, expected)
    assert torch.equal(reuse.kv.kv[:, :, shared], before)  # shared blocks never rewritten
    # Decoding on from either cache continues identically.
    assert continue_greedy(reuse, "b", prefix + suffix, got, shared + own, 8) == \
        continue_greedy(fresh, "b", prefix + suffix, expected, shared + own, 8)


def test_step_writes_exactly_the_scheduled_slots(model, stepper):
    runner = stepper(model, num_blocks=16, block_size=4)
    sentinel = 1234.5  # no computed K/V value comes near it
    runner.kv.kv.fill_(sentinel)
    runner.step(("a", PROMPT_B, 0, [6, 2], False), ("b", [3], 9, [0, 13, 15], True))
    written = (runner.kv.kv != sentinel).flatten(4).all(-1)  # [layer, K/V, block, slot]
    expected = torch.zeros_like(written)
    for p in range(len(PROMPT_B)):
        expected[:, :, [6, 2][p // 4], p % 4] = True
    expected[:, :, 15, 1] = True  # position 9 of b: block_ids[2], slot 1
    assert torch.equal(written, expected)


def test_on_layer_runs_after_each_layer_wrote_its_kv_and_changes_nothing(model, stepper):
    plain, tapped = stepper(model, num_blocks=8), stepper(model, num_blocks=8)
    schedule = ScheduleOutput((ScheduledChunk("a", tuple(PROMPT_A), 0, (3, 1, 6, 0, 2), True),))
    sentinel = 1234.5
    tapped.kv.kv.fill_(sentinel)
    plain.kv.kv.fill_(sentinel)
    seen: list[tuple[int, bool, bool]] = []

    def on_layer(n: int) -> None:  # layer n written, layer n + 1 not yet
        block = tapped.kv.kv[:, :, 3, 0]
        nxt = bool((block[n + 1] != sentinel).any()) if n + 1 < len(block) else False
        seen.append((n, bool((block[n] != sentinel).all()), nxt))

    logits = tapped.runner.execute(schedule, on_layer)
    assert seen == [(n, True, False) for n in range(model.config.num_layers)]
    assert not tapped.runner.records_layer_events  # CPU: nothing to record them on
    assert torch.equal(logits, plain.runner.execute(schedule))
    assert torch.equal(tapped.kv.kv, plain.kv.kv)


def test_empty_schedule_returns_no_rows(model, stepper):
    assert stepper(model).runner.execute(ScheduleOutput(())).shape == (0, VOCAB)


def test_attention_metadata_layout():
    schedule = ScheduleOutput((
        ScheduledChunk("a", (1, 2, 3), 2, (7, 3), True),
        ScheduledChunk("b", (4,), 5, (0, 9), True),
    ))
    meta = AttentionMetadata.from_schedule(schedule, block_size=4)
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 9 * 4 + 1]
    assert meta.query_start == (0, 3, 4)
    assert (meta.start_pos, meta.end_pos) == ((2, 5), (5, 6))
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        AttentionMetadata.from_schedule(
            ScheduleOutput((ScheduledChunk("c", (1,), 8, (0, 1), True),)), block_size=4)


def test_a_mixed_step_splits_its_leading_decode_rows_once_they_carry_enough_context():
    """Kernel metadata (built on CPU tensors; no kernel runs): the decode rows the scheduler
    put first go to the decode kernel when rows x context reach the threshold; a
    single-token chunk after a prefill chunk stays with the prefill kernel."""
    schedule = ScheduleOutput((
        ScheduledChunk("d0", (1,), 40, tuple(range(11)), True),
        ScheduledChunk("d1", (2,), 20, tuple(range(11, 17)), True),
        ScheduledChunk("p", (3, 4, 5), 0, (17,), True),
        ScheduledChunk("q", (6,), 8, (18, 19, 20), True),
    ))

    def kernels(min_tokens: int):
        meta = AttentionMetadata.from_schedule(schedule, block_size=4, use_kernels=True,
                                               num_kv_heads=2, mixed_split_min_tokens=min_tokens)
        assert meta.kernels is not None
        return meta.kernels

    split = kernels(2 * 41)  # 2 rows x the longest decode context, 41 positions
    assert split.num_decode_chunks == 2 and split.prefill_part is not None
    assert split.cu_seqlens_q.tolist() == [0, 1, 2, 5, 6] and split.max_query_len == 3
    rest = split.prefill_part
    assert rest.cu_seqlens_q.tolist() == [0, 3, 4] and rest.max_query_len == 3
    assert rest.context_lens.tolist() == [3, 9]
    assert rest.block_tables.tolist() == [[17, 0, 0], [18, 19, 20]]
    whole = kernels(2 * 41 + 1)
    assert whole.num_decode_chunks == 0 and whole.prefill_part is None
    assert split_mixed_step(16, 2048) is False and split_mixed_step(64, 2048) is True


def test_wide_models_split_mixed_steps_from_a_shorter_context(model):
    # Llama-3-8B (hidden 4096): its GPU-bound steps gain from 16k; Llama-3.2-1B (2048) and
    # this tiny model stay at 128k, where the split's launches do not cost a CPU-bound loop.
    assert mixed_split_threshold(4096) == 16 * 1024
    assert mixed_split_threshold(8192) == 16 * 1024
    assert mixed_split_threshold(2048) == 128 * 1024
    assert split_mixed_step(64, 512, mixed_split_threshold(4096)) is True
    assert split_mixed_step(64, 512, mixed_split_threshold(2048)) is False
    kv = KVStorage.for_model(model.config, 8, 16, torch.float32)
    assert ModelRunner(model, kv, 16).mixed_split_min_tokens == 128 * 1024
    assert ModelRunner(model, kv, 16, mixed_split_min_tokens=1).mixed_split_min_tokens == 1


def test_runner_rejects_a_pool_of_another_shape(model):
    kv = KVStorage.for_model(model.config, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="block size 16 != 8"):
        ModelRunner(model, kv, block_size=8)


def test_placeholder_fill_reads_the_previous_rows_in_order_without_an_upload():
    previous = DeviceTokens(torch.tensor([40, 41, 42, 43]), {"a": 0, "b": 1, "c": 2, "d": 3})
    rows, tokens = placeholder_fill(previous, [0, 1, 2], [0, 1, 2], torch.device("cpu"))
    assert rows == slice(0, 3) and tokens.tolist() == [40, 41, 42]
    assert tokens.data_ptr() == previous.token_ids.data_ptr()  # a view: nothing copied


def _decode(request_id: str, token: int) -> ScheduledChunk:
    return ScheduledChunk.decode(request_id, token, 5, (0,))


def test_placeholder_sources_name_each_placeholder_row_and_its_previous_row():
    previous = DeviceTokens(torch.tensor([40, 41, 42]), {"a": 2, "b": 0, "c": 1})
    prompt = ScheduledChunk("p", (7, 8, 9), 0, (1,), True)
    # A decode whose token is known (a prompt's last one) sits among the placeholders.
    schedule = ScheduleOutput((_decode("a", PLACEHOLDER), _decode("x", 12),
                               _decode("c", PLACEHOLDER), prompt))
    assert placeholder_sources(schedule, previous) == ([0, 2], [2, 1])
    assert placeholder_sources(ScheduleOutput((_decode("x", 12), prompt)), None) == ([], [])


@pytest.mark.parametrize("chunks, has_previous", [
    ((_decode("a", PLACEHOLDER),), False),  # no previous step's tokens to read
    ((ScheduledChunk("p", (7, PLACEHOLDER), 0, (1,), True),), True),  # inside a prompt
])
def test_placeholder_sources_reject_a_placeholder_out_of_place(chunks, has_previous):
    previous = DeviceTokens(torch.tensor([40]), {"a": 0}) if has_previous else None
    with pytest.raises(AssertionError, match="PLACEHOLDER outside a decode chunk"):
        placeholder_sources(ScheduleOutput(chunks), previous)


@pytest.mark.parametrize("dst, src", [([0, 1, 2], [1, 3, 0]),  # a request ended: rows moved
                                      ([1, 2], [2, 3]),  # the first row's token is known
                                      ([0, 3], [0, 1])])  # a prefill chunk between them
def test_placeholder_fill_gathers_rows_that_moved(dst, src):
    previous = DeviceTokens(torch.tensor([40, 41, 42, 43]), {})
    ids = torch.zeros(5, dtype=torch.long)
    rows, tokens = placeholder_fill(previous, dst, src, torch.device("cpu"))
    ids[rows] = tokens
    want = torch.zeros(5, dtype=torch.long)
    want[dst] = torch.tensor([40 + s for s in src])
    assert torch.equal(ids, want)

"""Grammar-constrained rows on a CUDA device: the bitmask filled on the host, expanded and
applied on the device, beside free rows, in an engine asked for overlapped steps (which
falls back to plain steps while a constrained request runs, and overlaps again after).

A random-weight model over a byte-level vocabulary (each byte one token, plus EOS): whatever
the weights, every constrained answer must parse and match its schema. On the CPU (float32,
where a batch's shape does not change a row's rounding) every free request must also get
the tokens an engine without constrained requests gives it; in bf16 on CUDA other batch
shapes may round a near-tie of these random weights the other way, so there the free rows
need only run to their length.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.engine_gpu_model import build_random_model
from engine.config import ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine
from protocol.grammar_spec import GrammarKind, GrammarSpec
from protocol.sampling_params import SamplingParams
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
VOCAB = 257  # EOS, then the 256 bytes
CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=128,
                     intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=False)
SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "c": {"enum": ["red", "green"]},
                         "s": {"type": "string", "maxLength": 6}},
          "required": ["n", "c", "s"], "additionalProperties": False}


def byte_tokenizer() -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(0,), add_bos_token=False,
                     chat_template=None, special_token_strings={"eos_token": "<eos>"})


@pytest.fixture(scope="module")
def model():
    return build_random_model(CONFIG, seed=5, device=torch.device(DEVICE), dtype=DTYPE)


def run(model, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    engine = LLMEngine.for_model(model, CONFIG, byte_tokenizer(), EngineConfig(
        num_kv_blocks=128, block_size=16, max_num_seqs=16, max_num_batched_tokens=128,
        dtype=DTYPE, device=DEVICE))
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finishes: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step(overlap=DEVICE == "cuda"):
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finishes[out.request_id] = out.finish_reason
        engine.check_invariants()
    assert engine.kv_cache.num_used_blocks == 0
    return {rid: (tokens[rid], finishes[rid]) for rid in requests}


def test_constrained_rows_parse_and_free_rows_are_undisturbed(model):
    tokenizer = byte_tokenizer()
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    free = {f"free{i}": (tokenizer.encode(f"prompt number {i}"),
                         SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i in range(4)}
    constrained = {
        f"json{i}": (tokenizer.encode(f"json {i}:"),
                     SamplingParams(max_tokens=80, temperature=1.0 if i % 2 else 0.0, seed=i,
                                    grammar=spec, logit_bias=((ord("9") + 1, 5.0),)))
        for i in range(6)}
    constrained["digits"] = (tokenizer.encode("digits:"), SamplingParams(
        max_tokens=10, temperature=1.0, seed=9,
        grammar=GrammarSpec(GrammarKind.REGEX, "[0-9]{3}")))
    alone = run(model, free)
    together = run(model, {**free, **constrained})
    for rid in free:
        assert together[rid] == alone[rid] if DEVICE == "cpu" else \
            (len(together[rid][0]), together[rid][1]) == (24, "length")
    for rid in constrained:
        ids, finish = together[rid]
        assert finish == "stop" and ids[-1] == 0, (rid, ids)
        text = tokenizer.decode(ids[:-1])
        if rid == "digits":
            assert len(text) == 3 and text.isdigit(), text
            continue
        answer = json.loads(text)
        assert set(answer) == {"n", "c", "s"}, text
        assert type(answer["n"]) is int and 0 <= answer["n"] <= 999, text
        assert answer["c"] in ("red", "green") and len(answer["s"]) <= 6, text

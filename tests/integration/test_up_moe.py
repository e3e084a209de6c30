"""`pdserve up` serving a mixture-of-experts model through the official `openai` client: a
tiny Qwen3-MoE checkpoint written by transformers itself (4 experts, 2 per token, random
weights; the default model's tokenizer beside it), 1 prefill + 1 decode worker, every
prompt handed off prefill -> decode. Greedy answers must be transformers' own greedy
tokens for the same weights, in float32 on both sides.

The reference's router margins are checked first (the k-th against the (k+1)-th expert's
probability, at every position the test generates): a near-tie that another summation
order could flip would fail the comparison for no fault of ours.
"""

from __future__ import annotations

import urllib.request

import openai
import pytest
import torch
from up_process import HANDOFF_TIER, UpProcess

from testing.random_model import export_tokenizer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROMPTS = ["Here is a list of fruits: apple, pear, plum, fig, apple, pear, plum",
           "Once upon a time"]
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("qwen3-moe")
    vocab_size = export_tokenizer(directory)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.25,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(directory)
    return directory, model


def _greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """transformers' greedy tokens, and the smallest router margin on the way."""
    tokens: list[int] = []
    margin = 1.0
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            out = model(torch.tensor([prompt + tokens]), output_router_logits=True)
            for logits in out.router_logits:
                probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True)
                margin = min(margin, float((probs.values[:, top_k - 1]
                                            - probs.values[:, top_k]).min()))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, margin


@pytest.fixture(scope="module")
def up(moe, tmp_path_factory):
    directory, _ = moe
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)
    process = UpProcess("--prefill", "1", "--decode", "1", "--no-agent", "--model",
                        str(directory), "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("up-logs"),
                        env={"PDSERVE_DTYPE": "float32"})
    yield process
    process.stop()


def test_a_moe_model_is_served_through_a_handoff_as_transformers_generates(
        moe, up: UpProcess, hf_reference) -> None:
    _, reference = moe
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    assert sorted(w["role"] for w in up.workers()) == ["decode", "prefill"]
    for prompt in PROMPTS:
        ids = hf_reference.prompt_ids(prompt)
        expected, margin = _greedy(reference, ids)
        assert margin > 1e-5, f"a router near-tie ({margin:.1e}) on {prompt!r}"
        args = dict(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True},
                    extra_headers={"x-pdserve-tier": "handoff"})
        whole = client.completions.create(**args)
        streamed = list(client.completions.create(**args, stream=True))
        text = hf_reference.tokenizer.decode(expected, skip_special_tokens=True)
        assert whole.usage.prompt_tokens == len(ids)
        assert whole.usage.completion_tokens == NUM_TOKENS
        assert whole.choices[0].text == text
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    metrics = urllib.request.urlopen(f"{up.url}/metrics", timeout=5).read().decode()
    splits = [line for line in metrics.splitlines()
              if line.startswith('pdserve_gateway_plans_total{kind="split"')]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in splits) >= 2 * len(PROMPTS)

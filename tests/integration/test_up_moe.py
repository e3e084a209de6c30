"""`pdserve up` serving a mixture-of-experts model through the official `openai` client: a
tiny Qwen3-MoE checkpoint written by transformers itself (4 experts, 2 per token, random
weights; the default model's tokenizer beside it), 1 prefill + 1 decode worker, every
prompt handed off prefill -> decode, from a prefill worker of one process to a decode worker
that is an expert-parallel group of two (`--ep decode=2`). Greedy answers must
be transformers' own greedy tokens for the same weights, in float32 on both sides.

The same model skewed (every token picks experts 0 and 1) under one colocated worker with
`--ep 2`: the experts spread over two processes, the hot one copied to the other rank by the
worker's rebalancer, each switch in the operations agent's audit trail, the busiest rank's
load falling after it, and the answers still transformers' own.

The reference's router margins are checked first (the k-th against the (k+1)-th expert's
probability, at every position the test generates): a near-tie that another summation
order could flip would fail the comparison for no fault of ours.
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from chromium_page import ChromiumPage
from up_process import HANDOFF_TIER, UpProcess

from protocol.agent_messages import HealthReport, HealthRequest
from testing.random_model import export_tokenizer
from testing.skewed_experts import skew_experts

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


def _expected(reference, hf_reference, prompt: str) -> tuple[list[int], list[int]]:
    """The prompt's ids and transformers' greedy tokens, with no router near-tie on the way."""
    ids = hf_reference.prompt_ids(prompt)
    expected, margin = _greedy(reference, ids)
    assert margin > 1e-5, f"a router near-tie ({margin:.1e}) on {prompt!r}"
    return ids, expected


def _client(up: UpProcess) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    return client, client.models.list().data[0].id


@pytest.fixture(scope="module")
def up(moe, tmp_path_factory):
    directory, _ = moe
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)
    process = UpProcess("--prefill", "1", "--decode", "1", "--ep", "decode=2", "--no-agent",
                        "--model", str(directory), "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("up-logs"),
                        env={"PDSERVE_DTYPE": "float32"})
    yield process
    process.stop()


def test_a_moe_model_is_served_through_a_handoff_as_transformers_generates(
        moe, up: UpProcess, hf_reference) -> None:
    directory, reference = moe
    client, model = _client(up)
    assert sorted(w["role"] for w in up.workers()) == ["decode", "prefill"]
    # The decode worker's expert rank: one process holding experts of this model.
    assert len(_expert_ranks(directory)) == 1
    for prompt in PROMPTS:
        ids, expected = _expected(reference, hf_reference, prompt)
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


def _expert_ranks(model) -> list[int]:
    """Pids of the expert ranks (engine/expert_exchange.py) of `model` on this host."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"engine.tensor_parallel_group" in argv and b"--ep" in argv \
                and str(model).encode() in argv:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def skewed(moe, tmp_path_factory):
    import transformers

    # Experts 0 and 1, both on rank 0 of two, take every token.
    directory = skew_experts(moe[0], tmp_path_factory.mktemp("skewed") / "model",
                             {0: 3.0, 1: 2.5})
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return directory, model.eval()


@pytest.fixture(scope="module")
def up_ep(skewed, tmp_path_factory):
    process = UpProcess("--colocated", "--workers", "1", "--ep", "2", "--model",
                        str(skewed[0]), log_dir=tmp_path_factory.mktemp("up-ep-logs"),
                        env={"PDSERVE_DTYPE": "float32",
                             "PDSERVE_EXPERT_REBALANCE_STEPS": "4"})
    yield process
    process.stop()


def test_expert_parallel_worker_copies_its_hot_expert_and_answers_as_transformers(
        skewed, up_ep: UpProcess, hf_reference, tmp_path) -> None:
    _, reference = skewed
    client, model = _client(up_ep)
    (worker,) = up_ep.workers()
    assert worker["role"] == "colocated"
    for prompt in PROMPTS * 2:
        _, expected = _expected(reference, hf_reference, prompt)
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert answer.choices[0].text == hf_reference.tokenizer.decode(
            expected, skip_special_tokens=True)
    report = up_ep.control_call(worker, HealthRequest(), HealthReport)
    load = report.load
    assert load.num_expert_rebalances >= 1, load
    assert report.num_failed == 0 and report.num_requests == 2 * len(PROMPTS)
    # Experts 0 and 1 take every token (each expert's share over the mean: 2.0 in every
    # layer), so without a copy rank 0 takes all of them: 2.0x the mean rank. With one of
    # them copied to rank 1 the busiest rank takes less.
    assert load.moe_imbalance == [2.0, 2.0], load
    assert max(load.moe_rank_imbalance) < 2.0, load
    # The agent's audit trail has the switches, with the busiest rank's load that decided
    # the last one and what the new placement makes of the same tokens.
    deadline = time.monotonic() + 30
    found: list[dict] = []
    while not found and time.monotonic() < deadline:
        events = up_ep.admin_get("/admin/agent/events?limit=1000")["events"]
        found = [e for e in events if e["rule"] == "experts"]
        time.sleep(0.2)
    assert found, up_ep.output[-3000:]
    event = found[-1]  # the oldest: the first switch
    assert event["action"] == "copy_experts" and event["outcome"].startswith("done")
    assert event["worker_id"] == worker["id"]
    # The registry's load (what /admin/workers and the cluster page show) carries them too,
    # once the worker has published a load read after the window that followed the switch
    # (the health report above is read live; the registry is refreshed every few seconds).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = up_ep.workers()[0]["load"] or {}
        if row.get("moe_rebalances", 0) >= 1 and row.get("moe_rank_imbalance", 2.0) < 2.0:
            break
        time.sleep(0.2)
    assert row["moe_imbalance"] == 2.0 and row["moe_rebalances"] >= 1, row
    assert 1.0 <= row["moe_rank_imbalance"] < 2.0, row
    with ChromiumPage(f"{up_ep.url}/dashboard", tmp_path) as page:  # the cluster page
        page.wait_for("document.body.dataset.state === 'live'", timeout_s=30)
        page.wait_for("document.querySelector('#workers tbody tr') !== null && document"
                      ".querySelector('#workers tbody tr').innerText.includes('experts:')", 30)
        shown = page.evaluate("document.querySelector('#workers tbody tr').innerText")
    assert "experts: busiest 2x the mean" in shown and "switch(es)" in shown, shown
    figures = re.search(r"took ([0-9.]+)x the mean .*?, ([0-9.]+)x for its tokens",
                        event["evidence"])
    assert figures is not None, event
    assert float(figures.group(2)) < float(figures.group(1)), event

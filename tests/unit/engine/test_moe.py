"""Mixture-of-experts models (Qwen3-MoE, Mixtral) beyond the shared reference tests
(test_llama_reference.py runs their logits and greedy decoding against transformers):
the block against its definition, the routing margins those tests rely on, the config
fields read, tensor-parallel shapes, and GGUF (qwen3moe read, Mixtral-style files
refused). The fused kernel path: tests/gpu/test_kernel_fused_moe.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import Activation, MoEConfig
from engine.hf_reader import read_config
from engine.loader import ModelLoadError, load_model
from engine.models.layers import GatedMLP
from engine.models.moe import MoEBlock
from engine.tensor_parallel_sharding import check_shardable, shard_config
from tests.unit.engine.conftest import MOE_VARIANTS
from tests.unit.engine.test_llama_reference import NUM_GREEDY, PROMPTS, reference_greedy

pytestmark = pytest.mark.usefixtures("single_thread")


def block_by_definition(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """sum over the picked experts of weight * expert(x), token by token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate(x[t]).float(), dim=-1)
        weights, ids = torch.topk(probs, block.top_k)
        if block.renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            expert = block.experts[e]
            hidden = torch.nn.functional.silu(expert.gate_proj(x[t])) * expert.up_proj(x[t])
            out[t] += weight * expert.down_proj(hidden)
    return out


@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_block_equals_the_per_token_definition(renormalize):
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=24, renormalize=renormalize,
                    layers=(0,))
    block = MoEBlock(16, moe, Activation.SILU, round_weights=True)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(37, 16)
    x[:, 0] = 1.0
    with torch.no_grad():
        # A router that never picks expert 3: an expert without tokens is skipped.
        block.gate.weight[3] = 0.0
        block.gate.weight[3, 0] = -100.0
        ours = block(x)
        expected = block_by_definition(block, x)
        _, ids = block.route(x)
    assert 3 not in ids.tolist() and len(set(ids.flatten().tolist())) == 3
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(block(x[:0]), x[:0])


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_reference_routing_has_no_near_ties(tiny_model, variant):
    """The reference tests compare routed models computed in another summation order: a
    token whose k-th and (k+1)-th router probabilities were within rounding of each other
    could pick another expert and fail them for no fault of ours. None comes close here."""
    tiny = tiny_model(variant)
    reference = tiny.reference
    top_k = reference.config.num_experts_per_tok
    for prompt in PROMPTS:
        sequence = prompt + reference_greedy(reference, prompt, NUM_GREEDY)
        with torch.no_grad():
            out = reference(torch.tensor([sequence]), output_router_logits=True)
        for router_logits in out.router_logits:
            probs = torch.softmax(router_logits.float(), dim=-1).sort(dim=-1, descending=True)
            gaps = probs.values[:, top_k - 1] - probs.values[:, top_k]
            assert float(gaps.min()) > 1e-5


def test_moe_fields_read_from_the_config(tiny_model, tmp_path):
    config = read_config(tiny_model("qwen3_moe_sparse_step").path)
    assert config.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=40,
                                   renormalize=True, layers=(1,))
    model = load_model(str(tiny_model("qwen3_moe_sparse_step").path)).model
    assert isinstance(model.model.layers[0].mlp, GatedMLP)
    assert isinstance(model.model.layers[1].mlp, MoEBlock)
    mixtral = read_config(tiny_model("mixtral").path)
    assert mixtral.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=112,
                                    renormalize=True, layers=(0, 1))
    assert (mixtral.sliding_window, mixtral.sliding_layers) == (5, (0, 1))
    qwen2 = read_config(tiny_model("qwen2_moe").path)
    assert qwen2.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=32,
                                  renormalize=False, layers=(1,), shared_intermediate_size=64)
    assert qwen2.attention_bias
    # A Hub-style Qwen3-MoE config: `num_experts`, a layer listed as dense.
    target = tmp_path / "hub_style"
    shutil.copytree(tiny_model("qwen3_moe").path, target)
    raw = json.loads((target / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    raw["mlp_only_layers"] = [0]
    (target / "config.json").write_text(json.dumps(raw))
    config = read_config(target)
    assert config.moe is not None and config.moe.layers == (1,)
    assert not config.moe.renormalize
    # Layer 0's checkpoint tensors are experts, the config now says dense: refused.
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.0\.mlp\.down"):
        load_model(str(target))


def test_tensor_parallel_splits_every_expert(tiny_model):
    """Greedy decoding over TP ranks is test_tensor_parallel.py's; here the shapes."""
    config = read_config(tiny_model("qwen3_moe_sparse_step").path)
    shard = shard_config(config, 2)
    assert shard.moe is not None and shard.moe.intermediate_size == 20
    assert shard.intermediate_size == 56 and shard.moe.num_experts == 4
    with pytest.raises(ValueError, match="expert intermediate size 40"):
        check_shardable(dataclasses.replace(config, num_heads=16, num_kv_heads=16), 16)


def write_gguf_header(path: Path, arch: str, num_experts: int) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_expert_count(num_experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_refuses_other_moe_naming_the_architecture(tmp_path):
    mixtral = tmp_path / "mixtral.gguf"
    write_gguf_header(mixtral, "llama", 8)
    with pytest.raises(ModelLoadError, match=r"mixture-of-experts GGUF .*'llama' with 8 experts"):
        load_model(str(mixtral))


def write_qwen3moe_gguf(reference: torch.nn.Module, path: Path) -> None:
    """A llama.cpp-style `qwen3moe` GGUF of `reference`: each projection of all experts in
    one 3D F16 tensor [E, out, in], attention in Q8_0, norms and router in F32, the rest
    F16.
    `reference` is updated in place to the rounded weights, so it stays exact."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    config = reference.config
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_eos_token_id(2)
    state = reference.state_dict()
    q8, f16, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16,
                    gguf.GGMLQuantizationType.F32)

    def add(gguf_name: str, hf_name: str, qtype: gguf.GGMLQuantizationType) -> None:
        weight = state[hf_name].numpy().astype(np.float32)
        if qtype == q8:
            data = quantize(weight, qtype)
            rounded = dequantize(data, qtype).reshape(weight.shape)
        else:
            data = weight.astype(np.float16 if qtype == f16 else np.float32)
            rounded = data.astype(np.float32)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        with torch.no_grad():
            state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(rounded)))

    add("token_embd.weight", "model.embed_tokens.weight", f16)
    add("output_norm.weight", "model.norm.weight", f32)
    add("output.weight", "lm_head.weight", f16)
    layer_names = {"attn_q.weight": "self_attn.q_proj.weight",
                   "attn_k.weight": "self_attn.k_proj.weight",
                   "attn_v.weight": "self_attn.v_proj.weight",
                   "attn_output.weight": "self_attn.o_proj.weight",
                   "attn_norm.weight": "input_layernorm.weight",
                   "ffn_norm.weight": "post_attention_layernorm.weight",
                   "attn_q_norm.weight": "self_attn.q_norm.weight",
                   "attn_k_norm.weight": "self_attn.k_norm.weight",
                   "ffn_gate_inp.weight": "mlp.gate.weight"}
    for n in range(config.num_hidden_layers):
        prefix = f"model.layers.{n}."
        for short, long in layer_names.items():
            add(f"blk.{n}.{short}", prefix + long,
                q8 if short.startswith("attn_") and "norm" not in short else f32)
        # transformers holds the experts fused in memory: gate_up_proj [E, 2I, H] (gate
        # rows first) and down_proj [E, H, I].
        gate_up = state[prefix + "mlp.experts.gate_up_proj"]
        size = config.moe_intermediate_size
        for projection, tensor in (("gate", gate_up[:, :size]), ("up", gate_up[:, size:]),
                                   ("down", state[prefix + "mlp.experts.down_proj"])):
            data = tensor.numpy().astype(np.float16)
            writer.add_tensor(f"blk.{n}.ffn_{projection}_exps.weight", data, raw_dtype=f16)
            with torch.no_grad():
                tensor.copy_(torch.from_numpy(data.astype(np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3moe_gguf_decodes_like_transformers(tiny_model, stepper, tmp_path):
    """From llama.cpp's format, whose experts come fused in 3D tensors; the GGUF has no
    norm_topk_prob and llama.cpp renormalises, so the reference does too."""
    import copy

    reference = copy.deepcopy(tiny_model("qwen3_moe").reference)
    reference.config.norm_topk_prob = True
    for layer in reference.model.layers:
        layer.mlp.gate.norm_topk_prob = True
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(reference, path)
    loaded = load_model(str(path))
    assert loaded.config.moe == MoEConfig(num_experts=4, top_k=2, intermediate_size=48,
                                          renormalize=True, layers=(0, 1))
    for prompt in PROMPTS[1:]:
        expected = reference_greedy(reference, prompt, NUM_GREEDY)
        assert stepper(loaded.model).greedy(prompt, NUM_GREEDY, list(range(20))) == expected

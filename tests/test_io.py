"""Model directories: round trip, and a clear error for each kind of bad checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailtamer.errors import CheckpointError
from tailtamer.model.config import Llama3RopeScaling, ModelConfig, preset_config
from tailtamer.model.io import load_model, save_model
from conftest import random_model, tiny_config


def test_round_trip_keeps_weights_and_config(tmp_path):
    model = random_model(tiny_config(tie_word_embeddings=True))
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")  # tied: stored once


@pytest.mark.parametrize("changes", [
    dict(architecture="LlamaForCausalLM", attention_bias=True, rope_theta=12345.0),
    dict(architecture="LlamaForCausalLM", rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64)),
    dict(architecture="Qwen3ForCausalLM", head_dim=24, attention_bias=True, eos_token_id=[1, 2]),
])
def test_hf_config_fields_round_trip(changes):
    cfg = tiny_config(**changes)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_reads_transformers_4_style_llama3_rope_scaling():
    raw = tiny_config(architecture="LlamaForCausalLM").to_hf()
    raw.pop("rope_parameters")
    raw["rope_scaling"] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    assert ModelConfig.from_hf(raw).rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)


def test_qwen3_head_dim_defaults_as_in_transformers():
    raw = tiny_config(architecture="Qwen3ForCausalLM").to_hf()
    raw.pop("head_dim")
    assert ModelConfig.from_hf(raw).head_dim == 128  # transformers' Qwen3Config default, not 64 / 4


def test_reads_transformers_4_style_rope_theta():
    raw = tiny_config().to_hf()
    raw.pop("rope_parameters")
    raw["rope_theta"] = 777.0
    assert ModelConfig.from_hf(raw).rope_theta == 777.0


def test_preset_sizes():
    cfg = preset_config("qwen2.5-0.5b", vocab_size=151936)
    assert 0.45e9 < cfg.num_parameters() < 0.55e9  # Qwen2.5-0.5B has 0.49B parameters


def _saved(tmp_path):
    save_model(random_model(), tmp_path)
    return tmp_path


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    (_saved(tmp_path) / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json.*not found"):
        load_model(tmp_path)


def test_malformed_config(tmp_path):
    (_saved(tmp_path) / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        load_model(tmp_path)


def test_config_missing_field(tmp_path):
    path = _saved(tmp_path) / "config.json"
    raw = json.loads(path.read_text())
    del raw["hidden_size"]
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="missing required field.*hidden_size"):
        load_model(tmp_path)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0}},
     r"rope_parameters\.rope_type 'yarn' is not supported; supported: 'default', 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}},
     r"rope_scaling\.rope_type 'linear' is not supported; supported: 'default', 'llama3'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0, "factor": 8.0}},
     "rope_parameters of rope_type 'llama3' is missing low_freq_factor, high_freq_factor, "
     "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 64}},
     r"rope_scaling\.high_freq_factor \(1\.0\) must be greater than low_freq_factor \(4\.0\)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, r"rope_scaling\.factor must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 6.5}},
     r"rope_scaling\.original_max_position_embeddings must be a positive integer, got 6\.5"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types must all be 'full_attention'"),
    ({"use_sliding_window": True}, "sliding-window attention is not supported"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer below 2\\*\\*31, got 0"),
])
def test_unsupported_config(tmp_path, change, message):
    path = _saved(tmp_path) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)


def test_missing_safetensors(tmp_path):
    (_saved(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_corrupt_safetensors(tmp_path):
    (_saved(tmp_path) / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(tmp_path)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    path = _saved(tmp_path) / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert "missing 1 tensor(s): layers.1.mlp.up_proj.weight" in str(e.value)
    assert "norm.weight: expected (64,), got (7,)" in str(e.value)


def test_bad_dtype(tmp_path):
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        load_model(_saved(tmp_path), dtype="int8")


def _generation_config(path, **fields):
    (path / "generation_config.json").write_text(json.dumps(fields))


def test_generation_config_eos_ids_are_added_to_the_config_ones(tmp_path):
    save_model(random_model(tiny_config(eos_token_id=7)), tmp_path)
    _generation_config(tmp_path, eos_token_id=[7, 9, 3], temperature=0.7)
    model = load_model(tmp_path)
    assert model.config.eos_ids == (7, 9, 3)
    _generation_config(tmp_path, eos_token_id=9)
    assert load_model(tmp_path).config.eos_ids == (7, 9)


def test_a_saved_model_keeps_its_generation_config(tmp_path):
    save_model(random_model(tiny_config(eos_token_id=7)), tmp_path / "a")
    _generation_config(tmp_path / "a", eos_token_id=[7, 9], temperature=0.7, top_p=0.8)
    save_model(load_model(tmp_path / "a"), tmp_path / "b")
    written = json.loads((tmp_path / "b" / "generation_config.json").read_text())
    assert written["eos_token_id"] == [7, 9] and written["temperature"] == 0.7 and written["top_p"] == 0.8
    assert json.loads((tmp_path / "b" / "config.json").read_text())["eos_token_id"] == [7, 9]
    assert load_model(tmp_path / "b").config.eos_ids == (7, 9)


@pytest.mark.parametrize("content,message", [
    ("{not json", r"generation_config\.json: malformed JSON"),
    ("[1, 2]", r"generation_config\.json: expected a JSON object, got list"),
    ('{"eos_token_id": "</s>"}', r"generation_config\.json: eos_token_id must be a token id or a list of token "
                                 r"ids, got '</s>'"),
    ('{"eos_token_id": [1, true]}', r"generation_config\.json: eos_token_id must be a token id"),
    ('{"eos_token_id": [1, 5000]}', r"generation_config\.json: bos_token_id, eos_token_id and pad_token_id must "
                                    r"be token ids"),
])
def test_bad_generation_config(tmp_path, content, message):
    (_saved(tmp_path) / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path)

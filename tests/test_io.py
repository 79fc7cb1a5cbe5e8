"""Model directories: round trip, and a clear error for each kind of bad checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailtamer.errors import CheckpointError
from tailtamer.model.config import ModelConfig, preset_config
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


def test_hf_config_fields_round_trip():
    cfg = tiny_config(architecture="LlamaForCausalLM", attention_bias=True, rope_theta=12345.0)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


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
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope type 'llama3'"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
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

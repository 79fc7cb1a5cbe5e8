"""Qwen3 and Llama 3.1 rope scaling against transformers (the oracle): models built and saved
by transformers, loaded here; and generation_config.json's extra stop ids.

transformers computes rotary angles in float32 even for float64 models, so float64 logits
agree to ~1e-5 of their size, not to float64 rounding; transformers against itself (our
re-saved directory) agrees to rounding.
"""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from tailtamer.errors import CheckpointError
from tailtamer.model.config import Llama3RopeScaling
from tailtamer.model.drafter import init_drafter
from tailtamer.model.io import load_model, save_model
from tailtamer.model.transformer import rotary_table
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.engine import Engine
from tailtamer.rollout.sampling import SamplingParams
from conftest import generate, tiny_config
from test_engine import _prompts

VOCAB = tiny_config().vocab_size
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)
# Llama 3.1's factors (8, 1, 4) with an original context of 64 instead of 8192: with head_dim 16
# and theta 1e4 the wavelengths 2π/f are 6.3, 20, 63, 199, ... so the first frequency is kept,
# the next two are blended and the rest divided by 8, and every position past 0 is affected.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=24),  # head_dim != hidden_size / heads (16)
    "qwen3-bias-tied": lambda: Qwen3Config(**{**SHAPE, "num_key_value_heads": 1}, head_dim=8, attention_bias=True,
                                           tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 1e6}),
    "llama3-rope": lambda: LlamaConfig(**SHAPE, rope_parameters=LLAMA3),
}
GENERATION_CASES = ["qwen3", "llama3-rope"]


def _hf_model(config, seed=0):
    """A random transformers model with weights large enough that its distributions are far
    from uniform, and non-trivial norms (q_norm / k_norm included) and biases."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise if name.endswith(".bias") else 0.3 * noise)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def hf_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(CASES[request.param]())
    hf.save_pretrained(out)
    return out, hf, request.param


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out[0]


def _without_rope_scaling(src, dst):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"]}
    raw.pop("rope_scaling", None)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_config_is_read_as_transformers_reads_it(hf_dir):
    path, hf, name = hf_dir
    cfg = load_model(path).config
    assert cfg.architecture == hf.config.architectures[0] and cfg.head_dim == hf.config.head_dim
    assert cfg.attention_bias == getattr(hf.config, "attention_bias", False)
    assert cfg.qk_norm == name.startswith("qwen3")
    assert (cfg.rope_scaling is not None) == (name == "llama3-rope")


def test_logits_match_transformers(hf_dir, tmp_path):
    path, hf, name = hf_dir
    ids = torch.randint(0, VOCAB, (2, 200), generator=torch.Generator().manual_seed(0))
    expected = _logits(hf, ids)
    got = _logits(load_model(path, "float64"), ids)
    assert (got - expected).abs().max() < 2e-4
    if name == "llama3-rope":  # the scaling matters: without it the logits are far off
        plain = _logits(load_model(_without_rope_scaling(path, tmp_path / "plain"), "float64"), ids)
        assert (plain - expected).abs().max() > 0.1 * expected.abs().max()


def test_a_saved_directory_loads_in_transformers_as_the_same_model(hf_dir, tmp_path):
    path, hf, _ = hf_dir
    save_model(load_model(path, "float64"), tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(again) is type(hf)
    ids = torch.randint(0, VOCAB, (2, 120), generator=torch.Generator().manual_seed(1))
    assert (_logits(again, ids) - _logits(hf, ids)).abs().max() < 1e-10


def test_llama3_inverse_frequencies_equal_transformers():
    hf = _hf_model(CASES["llama3-rope"]())
    scaling = Llama3RopeScaling(**{k: v for k, v in LLAMA3.items() if k not in ("rope_type", "rope_theta")})
    cos, sin = rotary_table(10000.0, 16, 2, torch.device("cpu"), torch.float64, scaling)
    ours = torch.atan2(sin[1, 8:], cos[1, :8])  # position 1: the angle is the frequency itself
    theirs = hf.model.rotary_emb.inv_freq.double()  # transformers' own llama3 computation (float32)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ratio = (plain / ours).tolist()
    assert ratio[0] == pytest.approx(1) and all(1.1 < r < 7.9 for r in ratio[1:3])  # kept, blended
    assert ratio[3:] == pytest.approx([8.0] * 5)  # divided by the factor


def _hf_greedy(hf, prompts, max_new_tokens):
    out = []
    for p in prompts:
        seq = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=1, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


# Prompts up to 60 tokens plus 30 new ones: positions well past the original context of 64.
PROMPTS = _prompts(5, seed=3, lo=1, hi=14, vocab=VOCAB) + _prompts(2, seed=4, lo=50, hi=61, vocab=VOCAB)
GREEDY = SamplingParams(temperature=0, max_new_tokens=30)


@pytest.fixture(scope="module")
def generation_case(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(CASES[request.param]())
    hf.save_pretrained(out)
    return out, load_model(out, "float64"), _hf_greedy(hf, PROMPTS, GREEDY.max_new_tokens)


@pytest.mark.parametrize("generation_case", GENERATION_CASES, indirect=True)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_generation_matches_transformers_with_and_without_speculation(generation_case, batch):
    _, target, expected = generation_case
    plain, _ = generate(target, PROMPTS, GREEDY, batch)
    assert [c.token_ids for c in plain] == expected
    spec, stats = generate(target, PROMPTS, GREEDY, batch, EagleProposer(init_drafter(target, std=0.2)), "3_2_6")
    assert [c.token_ids for c in spec] == expected
    assert stats.sd_steps > 0


@pytest.mark.parametrize("generation_case", ["llama3-rope"], indirect=True)
def test_without_rope_scaling_generation_differs(generation_case, tmp_path):
    path, _, expected = generation_case
    plain = load_model(_without_rope_scaling(path, tmp_path / "plain"), "float64")
    got, _ = generate(plain, PROMPTS, GREEDY, 4)
    assert [c.token_ids for c in got] != expected


@pytest.mark.parametrize("generation_case", ["qwen3"], indirect=True)
def test_engine_stops_on_the_generation_config_eos_id(generation_case, tmp_path):
    """config.json stops on 1 only; generation_config.json adds a token the model emits mid-way."""
    path, _, expected = generation_case
    response = next(r for r in expected if len(set(r)) > 8 and 1 not in r)
    stop = next(t for i, t in enumerate(response[:-1]) if i >= 3 and t not in response[:i])
    cut = response.index(stop) + 1
    model_dir = shutil.copytree(path, tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    prompt = PROMPTS[expected.index(response)]
    done, _ = Engine(load_model(model_dir, "float64")).generate([prompt], GREEDY)
    assert done[0].token_ids == response[:cut] and done[0].finish_reason == "stop"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()  # reads the same file
    seq = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=GREEDY.max_new_tokens, do_sample=False, pad_token_id=0)
    assert seq[0, len(prompt):].tolist() == response[:cut]


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
     r"architecture 'Qwen3MoeForCausalLM' is not supported; tailtamer loads \['LlamaForCausalLM', "
     r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     r"rope_parameters\.rope_type 'yarn' is not supported; supported: 'default', 'llama3'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_scaling\.rope_type 'dynamic' is not supported; supported: 'default', 'llama3'"),
])
def test_unsupported_architecture_and_rope_type_are_one_line_errors(tmp_path, change, message):
    _hf_model(CASES["qwen3"]()).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(tmp_path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)

"""The rollout-backend seam and the parts of the vLLM backend that need no vLLM: the drafter's
export, the layer probe that checks a publish, the drafter's data from the update's forward,
the config's checks, and the one-line refusal where vLLM is not installed."""

import json
import subprocess
import sys

import pytest
import torch

from tailtamer.config import load_train_config
from tailtamer.drafter.adaptive import AdaptiveDrafter
from tailtamer.drafter.spot import SpotConfig
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter
from tailtamer.rollout.engine import Engine
from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculator import Speculator
from tailtamer.rollout.vllm_backend import (VLLM_STRATEGIES, export_vllm_drafter, policy_tensors, vllm_drafter_tensors,
                                            vllm_installed)
from tailtamer.rollout.vllm_worker import FUSED, expected_probe, probe_input, probe_mismatch
from tailtamer.dist import Workers
from conftest import random_model, tiny_config


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(num_attention_heads=2, num_key_value_heads=1)).double()


# --- a drafter for vLLM's EAGLE loader ---------------------------------------------------------

def test_a_drafter_without_fc_bias_saves_loads_and_decodes_as_it_trains(target, tmp_path):
    drafter = init_drafter(target, seed=1, std=0.3, fc_bias=False).double()
    assert drafter.fc.bias is None
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.fc.bias is None
    ids, hidden = torch.randint(0, 100, (2, 7)), torch.randn(2, 7, 64, dtype=torch.float64)
    # the inference step (DraftStep, no fc bias) against the training pass, one pair at a time
    cache = loaded.new_cache(2, 16)
    for t in range(7):
        logits, _ = loaded.decode(ids[:, t:t + 1], hidden[:, t:t + 1], cache, slice(0, 2), torch.full((2,), t))
        assert torch.allclose(logits[:, 0], drafter(ids, hidden)[0][:, t], atol=1e-9)


def test_the_vllm_export_has_no_fc_bias_and_vllms_architecture(target, tmp_path):
    drafter = init_drafter(target, seed=1, fc_bias=False)
    export_vllm_drafter(drafter, tmp_path / "v")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["qkv_bias"] is True and "bias" not in config  # vLLM reads `bias` as attention_bias
    from safetensors.torch import load_file

    assert "fc.bias" not in load_file(tmp_path / "v" / "model.safetensors")


def test_a_drafter_with_a_zero_fc_bias_trains_for_vllm_without_one(target):
    from tailtamer.rollout.vllm_backend import bias_free

    drafter = init_drafter(target, seed=1, std=0.3).double()  # fc.bias zero-initialised, never trained
    free = bias_free(drafter)
    assert free.fc.bias is None and "fc.bias" not in dict(free.named_parameters())
    ids, hidden = torch.randint(0, 100, (2, 5)), torch.randn(2, 5, 64, dtype=torch.float64)
    assert torch.equal(free(ids, hidden)[0], drafter(ids, hidden)[0])
    with torch.no_grad():
        drafter.fc.bias[0] = 1.0
    with pytest.raises(ConfigError, match="trained fc.bias"):
        bias_free(drafter)


def test_vllm_starts_with_every_arms_draft_length_in_its_table():
    from tailtamer.rollout.vllm_backend import initial_table

    assert initial_table([7, 4, 2], 512) == [[1, 1, 7], [2, 2, 4], [3, 3, 2], [4, 512, 0]]
    assert initial_table([4], 1) == [[1, 1, 4]]


def test_a_trained_fc_bias_is_refused_and_a_zero_one_dropped(target):
    drafter = init_drafter(target, seed=1)  # fc.bias zero-initialised: nothing trained into it
    assert "fc.bias" not in vllm_drafter_tensors(drafter)
    with torch.no_grad():
        drafter.fc.bias[3] = 0.01
    with pytest.raises(ConfigError, match="trained fc.bias.*--no-fc-bias"):
        vllm_drafter_tensors(drafter)


# --- the check that an engine runs what was published ------------------------------------------

def _engine_probe(tensors: dict[str, torch.Tensor], pad_vocab: int = 0) -> dict:
    """What `vllm_worker.probe` returns from an engine holding `tensors` (transformers' names):
    vLLM's fused linear layers applied to their probe inputs, the other parameters as they are
    (the vocabulary rows padded, as vLLM pads them)."""
    linear = {n.rsplit(".", 1)[0] for n, t in tensors.items()
              if n.endswith(".weight") and t.dim() == 2 and not n.startswith(("model.embed_tokens", "lm_head"))}
    out = {}
    for module in linear:
        stem, last = module.rsplit(".", 1)
        fused = next((f for f, parts in FUSED.items() if last in parts), last)
        parts = [f"{stem}.{p}" for p in FUSED.get(fused, (last,))]
        y = probe_input(f"{stem}.{fused}", tensors[f"{parts[0]}.weight"].shape[1]) @ \
            torch.cat([tensors[f"{p}.weight"] for p in parts]).double().T
        if f"{parts[0]}.bias" in tensors:
            y = y + torch.cat([tensors[f"{p}.bias"] for p in parts]).double()
        out[f"linear {stem}.{fused}"] = y
    for name, t in tensors.items():
        if name.rsplit(".", 1)[0] not in linear:
            rows = pad_vocab if name.startswith(("model.embed_tokens", "lm_head")) else 0
            out[f"param {name}"] = torch.cat([t.double(), torch.zeros(rows, *t.shape[1:], dtype=torch.float64)])
    return out


def test_the_probe_of_the_published_weights_matches(target):
    tensors = policy_tensors(target)
    engine = _engine_probe(tensors, pad_vocab=27)
    first, worst = probe_mismatch(engine, expected_probe(engine, tensors), 1e-9)
    assert first is None and worst < 1e-9
    assert any(k.endswith("qkv_proj") for k in engine) and any(k.endswith("gate_up_proj") for k in engine)


@pytest.mark.parametrize("stale", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                                   "model.layers.1.mlp.up_proj.weight", "model.norm.weight",
                                   "model.embed_tokens.weight"])
def test_a_stale_tensor_in_the_engine_is_found(target, stale):
    tensors = policy_tensors(target)
    old = dict(tensors)
    old[stale] = tensors[stale] * 0.9  # the engine kept last step's values of one tensor
    engine = _engine_probe(old)
    first, worst = probe_mismatch(engine, expected_probe(engine, tensors), 1e-4)
    assert first is not None and worst > 1e-3


def test_a_layer_the_engine_runs_but_was_never_pushed_is_a_mismatch(target):
    tensors = policy_tensors(target)
    engine = _engine_probe(tensors)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    first, worst = probe_mismatch(engine, expected_probe(engine, tensors), 1e-4)
    assert first == "model.layers.0.mlp.down_proj" and worst == float("inf")


# --- the drafter's data from the update's forward ---------------------------------------------

def test_the_updates_forward_gives_the_drafter_the_rollouts_pairs(target):
    """The (h_t, x_(t+1)) pairs `add_sequences` takes from a training forward are those the
    engine hands over as requests finish (float64: exactly)."""
    drafter = init_drafter(target, seed=1).double()
    engine = Engine(target, eos_ids=(1,), speculator=Speculator.fixed(EagleProposer(drafter), "2_1_3"))
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    from_rollout = AdaptiveDrafter(drafter, SpotConfig(), Workers(), 0, 2, SamplingParams())
    completions, _ = engine.generate(prompts, SamplingParams(max_new_tokens=9, seed=3),
                                     keep_hidden=from_rollout.collector(0))
    seqs = [p + c.token_ids for p, c in zip(prompts, completions)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        mask[i, len(p) - 1: len(s) - 1] = True
    _, hidden = target(ids)
    from_update = AdaptiveDrafter(drafter, SpotConfig(), Workers(), 0, 2, SamplingParams())
    from_update.add_sequences(0, ids, mask, hidden)
    by_tokens = {tuple(e.tokens.tolist()): e for e in from_rollout.buffer.entries}
    assert len(from_update.buffer) == len(by_tokens) == 3
    for entry in from_update.buffer.entries:
        rolled = next(e for t, e in by_tokens.items() if entry.tokens.tolist()[: len(t)] == list(t))
        n = len(rolled.tokens)  # a rollout's entry may stop before its last token (no forward consumed it)
        assert entry.complete and len(entry.tokens) in (n, n + 1)
        assert entry.response_start == rolled.response_start
        assert torch.allclose(entry.hidden[:n], rolled.hidden, atol=1e-9)


# --- config and set-up --------------------------------------------------------------------------

def test_the_vllm_backend_takes_chains_for_the_default_arms():
    cfg = load_train_config(None, ["rollout.backend=vllm"])
    assert cfg.spec.strategies == VLLM_STRATEGIES and cfg.spec.strategy == "4_1_5"
    assert load_train_config(None, []).spec.strategies != VLLM_STRATEGIES  # our engine keeps its trees


def test_arms_left_null_take_vllms_defaults_as_absent_ones_do(tmp_path):
    """A run on our engine writes `strategies: null` into its config.yaml: resumed with
    rollout.backend=vllm it was refused for confidence-shaped arms the user never chose."""
    import yaml

    from tailtamer.config import to_dict

    written = tmp_path / "config.yaml"
    written.write_text(yaml.safe_dump(to_dict(load_train_config(None, []))))
    assert yaml.safe_load(written.read_text())["spec"]["strategies"] is None
    cfg = load_train_config(written, ["rollout.backend=vllm"])
    assert cfg.spec.strategies == VLLM_STRATEGIES


@pytest.mark.parametrize("override", ["rollout.temperature=2.5", "rollout.temperature=1e30"])
def test_a_temperature_vllm_refuses_is_refused_before_it_starts(override):
    with pytest.raises(ConfigError, match="rollout.temperature .*: vLLM samples at temperatures up to 2"):
        load_train_config(None, ["rollout.backend=vllm", override])


@pytest.mark.parametrize("override, message", [
    ("spec.strategies=[4_2_8,4_1_5,2_1_3]", "spec.strategies 4_2_8: vLLM drafts chains only"),
    ("spec.strategy=4_2_8 spec.tuner=fixed", "spec.strategy 4_2_8: vLLM drafts chains only"),
    ("spec.strategies=[7_1_8@0.3,4_1_5,2_1_3]", "spec.strategies 7_1_8@0.3: vLLM drafts chains of a fixed length"),
    ("spec.compile=true", "with rollout.backend=vllm use vllm.compile"),
    ("vllm.kv_cache_gb=0", "vllm.kv_cache_gb must be > 0"),
    ("vllm.kv_cache_gb=1e-10", "vllm.kv_cache_gb must be >= 1e-06 \\(a KiB\\), got 1e-10"),  # 0 bytes: unset
    ("spec.acceptance=synthetic", "is refused: tailtamer only verifies losslessly"),
    ("spec.drafter=suffix", "^spec.drafter=suffix runs on rollout.backend=tailtamer"),  # not vLLM's default arms
    ("spec.drafter=suffix spec.mode=on", "^spec.drafter=suffix runs on rollout.backend=tailtamer"),
])
def test_what_the_vllm_backend_cannot_run_is_refused_at_start_up(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, ["rollout.backend=vllm", *override.split()])


def test_an_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="rollout.backend must be one of tailtamer, vllm, got 'sglang'"):
        load_train_config(None, ["rollout.backend=sglang"])


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
@pytest.mark.parametrize("command", [["train", "rollout.backend=vllm", "run.out_dir=runs"],
                                     ["generate", "--backend", "vllm", "--model", "m", "--prompts", "p.jsonl",
                                      "--out", "o.jsonl"]])
def test_the_vllm_backend_without_vllm_is_one_line_naming_the_set_up(tmp_path, command):
    done = subprocess.run([sys.executable, "-m", "tailtamer", *command], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "make vllm-env" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


GENERATE_ON_VLLM = ["generate", "--backend", "vllm", "--model", "m", "--prompts", "p.jsonl", "--out", "o.jsonl"]


@pytest.mark.parametrize("command,message", [
    (["train", "rollout.backend=vllm", "spec.drafter=suffix", "run.out_dir=runs"], "spec.drafter=suffix runs on "),
    (GENERATE_ON_VLLM + ["--spec", "on", "--drafter", "suffix"], "--drafter=suffix runs on "),
    (GENERATE_ON_VLLM + ["--dtype", "float64"], "--dtype float64: vLLM runs float32 or bfloat16"),
    (GENERATE_ON_VLLM + ["--kv-cache-gb", "0"], "--kv-cache-gb must be > 0"),
    (["generate"] + GENERATE_ON_VLLM[3:] + ["--kv-cache-gb", "2"],  # --backend tailtamer
     "--kv-cache-gb sizes vLLM's KV cache")])
def test_what_vllm_cannot_run_is_refused_whether_or_not_vllm_is_installed(tmp_path, command, message):
    """What vLLM cannot run is said first: installing vLLM would not make it run."""
    done = subprocess.run([sys.executable, "-m", "tailtamer", *command], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith(f"error: {message}"), done.stderr
    assert list(tmp_path.iterdir()) == []

"""The EAGLE drafter: checkpoints, sharing, the h_t <-> x_{t+1} pairing, loss and training."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tailtamer.drafter.train import DrafterTrainConfig, eagle_loss, eagle_pairs, pack, train_drafter, unrolled_loss
from tailtamer.errors import CheckpointError, ConfigError
from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter, weights_checksum
from conftest import random_model, tiny_config, token_prompts


@pytest.fixture
def target():
    return random_model(tiny_config())


def test_checkpoint_has_sglang_eagle_names_and_no_shared_tensors(target, tmp_path):
    save_drafter(init_drafter(target), tmp_path)
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("embed_tokens" in k or "lm_head" in k or "input_layernorm" in k or k.startswith("model.")
                   for k in keys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    assert cfg["qkv_bias"] is True  # for loaders that read the flag (EAGLE's), not the architecture
    assert load_file(tmp_path / "model.safetensors")["fc.weight"].shape == (64, 128)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_llama_drafter_config_says_whether_q_k_v_have_bias(tmp_path, attention_bias):
    target = random_model(tiny_config(architecture="LlamaForCausalLM", attention_bias=attention_bias))
    save_drafter(init_drafter(target), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["qkv_bias"] is attention_bias and cfg["attention_bias"] is attention_bias
    assert ("layers.0.self_attn.q_proj.bias" in load_file(tmp_path / "model.safetensors")) is attention_bias


@pytest.fixture
def qwen3_target():
    return random_model(tiny_config(architecture="Qwen3ForCausalLM", head_dim=24))


def test_a_qwen3_targets_drafter_is_a_llama_eagle_one(qwen3_target, tmp_path):
    """SGLang's LlamaForCausalLMEagle layout: a Llama layer (no q/k norms) of the target's head_dim."""
    drafter = init_drafter(qwen3_target, seed=2)
    assert drafter.layers[0].self_attn.q_norm is None
    save_drafter(drafter, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["model_type"] == "llama"
    assert cfg["head_dim"] == 24 and cfg["qkv_bias"] is False and cfg["attention_bias"] is False
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any("q_norm" in k or "k_norm" in k for k in keys)
    loaded = load_drafter(tmp_path, qwen3_target)
    assert weights_checksum(loaded) == weights_checksum(drafter)
    seq = torch.randint(5, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, h = qwen3_target(seq)
        full, _ = loaded(seq[:, 1:], h[:, :-1])
        step, _ = loaded.decode(seq[:, 1:], h[:, :-1], loaded.new_cache(1, 32), slice(0, 1), torch.tensor([0]))
    assert (step - full).abs().max() < 1e-4


def test_a_qwen2_drafter_does_not_fit_a_qwen3_target(qwen3_target, tmp_path):
    other = random_model(tiny_config(head_dim=24))
    save_drafter(init_drafter(other), tmp_path)
    with pytest.raises(CheckpointError, match="architecture: drafter Qwen2ForCausalLMEagle but a Qwen3ForCausalLM "
                                              "target takes LlamaForCausalLMEagle"):
        load_drafter(tmp_path, qwen3_target)


def test_round_trip_and_checksum(target, tmp_path):
    drafter = init_drafter(target, seed=3)
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert weights_checksum(loaded) == weights_checksum(drafter)
    assert weights_checksum(init_drafter(target, seed=4)) != weights_checksum(drafter)
    assert loaded.target is target  # shared by reference
    assert not any(p is target.embed_tokens.weight or p is target.lm_head.weight for p in loaded.parameters())


def test_embedding_and_head_in_a_foreign_checkpoint_are_ignored(target, tmp_path):
    save_drafter(init_drafter(target), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.zeros(101, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_drafter(tmp_path, target)
    assert torch.equal(loaded.target.embed_tokens.weight, target.embed_tokens.weight)


@pytest.mark.parametrize("change,message", [({"hidden_size": 32, "num_attention_heads": 2}, "hidden_size: drafter 32"),
                                            ({"vocab_size": 50}, "vocab_size: drafter 50 vs target 101")])
def test_mismatched_target_is_a_clear_error(target, tmp_path, change, message):
    other = random_model(tiny_config(**change))
    save_drafter(init_drafter(other), tmp_path)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(tmp_path, target)


def test_bad_drafter_dirs(target, tmp_path):
    with pytest.raises(CheckpointError, match="drafter directory not found"):
        load_drafter(tmp_path / "none", target)
    from tailtamer.model.io import save_model

    save_model(target, tmp_path)
    with pytest.raises(CheckpointError, match="is not an EAGLE drafter"):
        load_drafter(tmp_path, target)


def test_pairs_align_h_t_with_x_t_plus_1():
    ids = torch.tensor([[10, 11, 12, 13, 0]])
    hidden = torch.arange(5.0).view(1, 5, 1).expand(1, 5, 2)  # h_t = t
    logits = torch.arange(5.0).view(1, 5, 1) * 100
    valid = torch.tensor([[True, True, True, True, False]])
    x, h_in, h_next, logits_next, mask = eagle_pairs(ids, hidden, logits, valid)
    assert x.tolist() == [[11, 12, 13, 0]]
    assert h_in[0, :, 0].tolist() == [0, 1, 2, 3]  # paired with x_{t+1}
    assert h_next[0, :, 0].tolist() == [1, 2, 3, 4]
    assert logits_next[0, :, 0].tolist() == [100, 200, 300, 400]
    assert mask.tolist() == [[True, True, True, False]]


def test_eagle_loss_against_hand_computation():
    pred_h = torch.tensor([[[0.0, 2.0], [1.0, 1.0]]])
    true_h = torch.tensor([[[0.5, 0.0], [1.0, 1.0]]])
    pred_l = torch.tensor([[[0.0, 0.0], [9.0, 9.0]]])
    true_l = torch.tensor([[[0.0, 0.0], [0.0, 5.0]]])
    mask = torch.tensor([[True, False]])
    loss, v, p = eagle_loss(pred_h, pred_l, true_h, true_l, mask, value_weight=1.0, prob_weight=0.1)
    # SmoothL1 per dim: |0.5| < 1 -> 0.5 * 0.25 = 0.125; |2| -> 1.5; mean 0.8125. Soft CE: ln 2.
    assert v.item() == pytest.approx(0.8125)
    assert p.item() == pytest.approx(torch.log(torch.tensor(2.0)).item())
    assert loss.item() == pytest.approx(0.8125 + 0.1 * 0.6931, abs=1e-4)


def test_training_improves_agreement_and_never_touches_the_target(target):
    gen = torch.Generator().manual_seed(1)
    # A predictable language: repeated short patterns, so a drafter can learn the target's view of it.
    seqs = [(torch.randint(5, 30, (4,), generator=gen).tolist() * 8) for _ in range(40)]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    flags = [p.requires_grad for p in target.parameters()]
    drafter, info = train_drafter(target, seqs, DrafterTrainConfig(steps=200, batch_size=8, lr=3e-3),
                                  log=lambda _: None)
    assert info["final"]["top1"] > 0.5
    assert info["final"]["loss"] < 0.8 * _first_loss(target, seqs)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert [p.requires_grad for p in target.parameters()] == flags


def test_cached_target_features_train_the_drafter_the_target_would(target):
    """Each sequence's hidden states computed once (in length-sorted batches) and reused
    train the same drafter as running the target at every step; a budget too small for them
    falls back to the latter."""
    from tailtamer.drafter.train import target_features

    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(5, 30, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 40, (30,), generator=gen)]
    with torch.no_grad():
        alone = [target(torch.tensor([s]))[1][0] for s in seqs]
    with pytest.MonkeyPatch.context() as mp:  # the hidden states only: no (B, T, V) logits to throw away
        mp.setattr(target.lm_head, "forward", lambda _: pytest.fail("target_features ran the LM head"))
        features = target_features(target, seqs, 1 << 30, batch_tokens=64)
    assert all(f.shape == a.shape and (f - a).abs().max() < 1e-5 for f, a in zip(features, alone))
    assert target_features(target, seqs, 100) is None
    key = DrafterTrainConfig().key()  # the budget is memory, not what is trained
    assert DrafterTrainConfig(feature_cache_mb=0).key() == key != DrafterTrainConfig(steps=5).key()
    runs = [train_drafter(target, seqs, DrafterTrainConfig(steps=20, batch_size=4, lr=3e-3, feature_cache_mb=mb),
                          log=lambda _: None) for mb in (0, 64)]
    assert runs[0][1]["final"]["loss"] == pytest.approx(runs[1][1]["final"]["loss"], rel=1e-4)
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert (a - b).abs().max() < 1e-4


def test_feature_budget_is_the_setting_capped_at_half_the_free_memory(target, monkeypatch):
    """The warm-up keeps the target's features only within half the device's free memory;
    past it the target runs every step, and one line says so."""
    import tailtamer.drafter.train as train
    from tailtamer.drafter.train import feature_budget

    assert feature_budget(2048, None) == 2048 << 20  # free memory unknown: the setting
    assert feature_budget(2048, 1 << 30) == 1 << 29  # 1 GiB free: half of it
    assert feature_budget(64, 1 << 40) == 64 << 20
    seqs = [list(range(5, 25))] * 8  # 160 tokens of 64 float32 features: 40 KiB
    for free, cached in ((1 << 30, True), (40 << 10, False)):  # 20 KiB usable: too little
        monkeypatch.setattr(train, "available_memory", lambda *_args, free=free: free)
        logs: list[str] = []
        train_drafter(target, seqs, DrafterTrainConfig(steps=1, batch_size=4, feature_cache_mb=64), log=logs.append)
        said = [line for line in logs if "budget" in line]
        assert said == ([] if cached else ["drafter training: the target's features take 40 KiB, over the 20 KiB "
                                           "budget (feature_cache_mb, at most half the free memory): the target "
                                           "runs at every step instead"]), free
        computing = "drafter training: the target's hidden states of 8 sequences (160 tokens), once"
        assert (computing in logs) == cached  # said before the silent minute it can take


def _first_loss(target, seqs):
    _, info = train_drafter(target, seqs, DrafterTrainConfig(steps=1, batch_size=8), log=lambda _: None)
    return info["final"]["loss"]


@pytest.mark.parametrize("kwargs", [{"steps": 0}, {"value_weight": 0.0, "prob_weight": 0.0}, {"prob_weight": -1.0},
                                    {"feature_cache_mb": -1}, {"unroll": 0}])
def test_bad_training_config(kwargs):
    with pytest.raises(ConfigError):
        DrafterTrainConfig(**kwargs)


def test_soft_ce_matches_cross_entropy_for_one_hot_targets():
    logits = torch.randn(1, 3, 7)
    target_logits = torch.full((1, 3, 7), -1e4)
    target_logits[0, torch.arange(3), torch.tensor([1, 4, 6])] = 0.0
    _, _, p = eagle_loss(torch.zeros(1, 3, 2), logits, torch.zeros(1, 3, 2), target_logits, torch.ones(1, 3, dtype=torch.bool))
    assert p.item() == pytest.approx(F.cross_entropy(logits[0], torch.tensor([1, 4, 6])).item(), rel=1e-5)


def _perturbed_drafter(target, seed):
    """A random drafter with random biases and norm weights, so that each folded term shows."""
    drafter = init_drafter(target, seed=seed, std=0.3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return drafter


@pytest.mark.parametrize("arch", [dict(), dict(num_key_value_heads=4),
                                  dict(architecture="LlamaForCausalLM", attention_bias=True, mlp_bias=True),
                                  dict(architecture="LlamaForCausalLM", head_dim=24)])
def test_the_inference_step_computes_what_the_training_pass_does(arch):
    """`DraftStep` (rotary folded into the q/k projection, the norm's weight into gate/up,
    transposed weights, fused residuals) against the module path, in float64: every bias
    (q/k/v, o, MLP), GQA or not, a head_dim other than hidden/heads; and the cache rows it
    writes are the ones the next call reads."""
    target = random_model(tiny_config(**arch)).double()
    drafter = _perturbed_drafter(target, seed=3)
    seq = torch.randint(5, 100, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, h = target(seq)
        full, features = drafter(seq[:, 1:], h[:, :-1])
        cache = drafter.new_cache(2, 64)
        a, fa = drafter.decode(seq[:, 1:12], h[:, :11], cache, slice(0, 2), torch.tensor([0, 0]))
        b, fb = drafter.decode(seq[:, 12:21], h[:, 11:20], cache, slice(0, 2), torch.tensor([11, 11]))
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=0, atol=1e-9)
    torch.testing.assert_close(torch.cat([fa, fb], 1), features, rtol=0, atol=1e-9)


def test_the_inference_step_follows_the_drafters_weights():
    """Its derived weights are rebuilt when the drafter changes in place (a published average
    loaded into it, a tracked write) or moves to another dtype, on request after its
    parameters are replaced (`assign=True`), and at every rollout, after changes no version
    counter records (a fused optimizer step, as the spot trainer takes): never stale in the
    engine."""
    from tailtamer.adamw import adamw
    from tailtamer.rollout.eagle import EagleProposer

    target = random_model(tiny_config()).double()
    drafter, other = _perturbed_drafter(target, seed=3), _perturbed_drafter(target, seed=4)
    seq = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(2))

    def agrees():
        with torch.no_grad():
            _, h = target(seq)
            full, _ = drafter(seq[:, 1:], h[:, :-1])
            step, _ = drafter.decode(seq[:, 1:], h[:, :-1], drafter.new_cache(1, 32), slice(0, 1), torch.tensor([0]))
        # float32: two orders of summation differ by up to ~2e-5 of the largest feature on some
        # CPUs (AMD EPYC, weights scaled 1.5 after a step at lr 0.1); a stale weight differs by O(1)
        return (step - full).abs().max() / full.abs().max() < (1e-12 if full.dtype == torch.float64 else 1e-4)

    assert agrees()
    drafter.load_state_dict(other.state_dict())
    assert agrees()
    with torch.no_grad():
        drafter.layers[0].post_attention_layernorm.weight.mul_(2)
    assert agrees()
    drafter.load_state_dict({k: v * 1.5 for k, v in other.state_dict().items()}, assign=True)
    drafter.step(rebuild=True)  # new parameter objects: listed again
    assert agrees()
    optimizer = adamw(drafter.parameters(), lr=0.1)
    assert optimizer.defaults["fused"]  # its step bumps no version counter
    drafter(seq[:, 1:], target(seq)[1][:, :-1].detach())[0].square().mean().backward()
    optimizer.step()
    EagleProposer(drafter).reserve(1, 16)  # what the engine does at every generate
    assert agrees()
    target.float(), drafter.float()
    assert drafter.step().fc_ht.dtype == torch.float32 and agrees()


def test_a_drafter_built_under_inference_mode_decodes():
    with torch.inference_mode():
        target = random_model(tiny_config())
        drafter = _perturbed_drafter(target, seed=3)
        seq = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(2))
        _, h = target(seq)
        full, _ = drafter(seq[:, 1:], h[:, :-1])
        step, _ = drafter.decode(seq[:, 1:], h[:, :-1], drafter.new_cache(1, 32), slice(0, 1), torch.tensor([0]))
    # logits up to ~200 here: float32 rounding of sums taken in another order (the float64 test is exact)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("unroll", [2, 3])
def test_an_unrolled_level_is_what_a_chain_drafts_there(target, monkeypatch, unroll):
    """Level m + 1 of `unrolled_loss` at row j computes what a drafter run over the true pairs
    0..j, then its own levels 2..m + 1 (each fed the level before's feature and the next true
    token), gives at its last row; its loss is taken against row j + m's targets, and only
    inside row j's sequence (two packed sequences)."""
    drafter = _perturbed_drafter(target.double(), 3)
    g = torch.Generator().manual_seed(4)
    lengths, H = [7, 5], target.config.hidden_size
    samples = [(torch.randint(3, 90, (n,), generator=g), torch.randn(n, H, generator=g, dtype=torch.float64),
                torch.randn(n, H, generator=g, dtype=torch.float64), torch.rand(n, generator=g) < 0.8) for n in lengths]
    tokens, h_in, h_next, mask, positions, attn = pack(samples)
    target_logits = torch.randn(1, sum(lengths), target.config.vocab_size, generator=g, dtype=torch.float64)
    seen = []
    monkeypatch.setattr("tailtamer.drafter.train.eagle_loss", lambda *a: seen.append(a) or eagle_loss(*a))
    loss, vloss, ploss, _ = unrolled_loss(drafter, tokens, h_in, h_next, target_logits, mask, positions, attn, unroll)
    assert len(seen) == unroll
    starts = [0, lengths[0]]
    with torch.no_grad():
        for m in range(1, unroll):
            got_hidden, got_target, got_mask = seen[m][0][0], seen[m][2][0], seen[m][4][0]
            for seq, (start, n) in enumerate(zip(starts, lengths)):
                for j in range(start, start + n):
                    counted = j + m < start + n and bool(mask[0, j + m])
                    assert bool(got_mask[j]) == counted, (m, j)
                    if j + m >= start + n:
                        continue
                    # the true pairs up to j, then levels 2..m + 1 at positions j + 1 .. j + m
                    ids, feats = tokens[0, start: j + 1].tolist(), [h_in[0, start: j + 1]]
                    _, out = drafter(torch.tensor([ids]), feats[0][None])
                    last = out[0, -1:]
                    for k in range(1, m + 1):
                        ids.append(int(tokens[0, j + k]))
                        feats.append(last)
                        _, out = drafter(torch.tensor([ids]), torch.cat(feats)[None])
                        last = out[0, -1:]
                    torch.testing.assert_close(got_hidden[j], last[0])
                    torch.testing.assert_close(got_target[j], h_next[0, j + m])
    assert torch.isfinite(loss) and loss > seen[0][0].new_tensor(0)


def test_a_stopped_drafter_training_goes_on_where_it_was(target, tmp_path, monkeypatch):
    """`drafter train` on a real model can take hours; a Ctrl-C lost all of it. It now stops
    after the step with its state saved beside --out, named by what it trains from (the
    config, the target's weights, the data, the starting drafter), and the same call goes on
    to the very weights of an uninterrupted run; other inputs never read that state."""
    import os
    import signal

    import tailtamer.drafter.train as train
    from tailtamer.drafter.train import training_state
    from tailtamer.stopping import Interrupted

    seqs = [p + p[::-1] for p in token_prompts(24, seed=4)]
    cfg = DrafterTrainConfig(steps=12, batch_size=4, lr=3e-3)
    straight, info = train_drafter(target, seqs, cfg, log=lambda _: None)
    state = training_state(tmp_path / "d", target, seqs, cfg)
    assert state.key != training_state(tmp_path / "d", target, seqs[1:], cfg).key  # other data, another state
    assert state.key != training_state(tmp_path / "d", target, seqs, DrafterTrainConfig(steps=13, batch_size=4,
                                                                                         lr=3e-3)).key
    loss = train.unrolled_loss
    for start, at in ((0, 3), (3, 8)):  # the second goes on from the first's stop
        calls = []

        def ctrl_c(*args, **kwargs):  # in the middle of step `at`, as a terminal sends it
            calls.append(1)
            if start + len(calls) == at:
                os.kill(os.getpid(), signal.SIGINT)
            return loss(*args, **kwargs)

        monkeypatch.setattr(train, "unrolled_loss", ctrl_c)
        with pytest.raises(Interrupted, match=rf"^stopped by Ctrl-C after step {at} of 12 of the drafter's training; "
                                              rf"saved in {re.escape(str(state.path))}: the same command goes on"):
            train_drafter(target, seqs, cfg, log=lambda _: None, state=state)
    monkeypatch.setattr(train, "unrolled_loss", loss)
    logs = []
    resumed, resumed_info = train_drafter(target, seqs, cfg, log=logs.append, state=state)
    assert any(line.startswith("going on from step 8, saved in ") for line in logs), logs
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    assert resumed_info["final"] == info["final"]
    # the finished state stays until the caller has written the drafter
    assert state.path.exists()
    again, _ = train_drafter(target, seqs, cfg, log=lambda _: None, state=state)
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), again.state_dict().values()))


def test_drafter_train_removes_its_state_once_the_drafter_is_written(model_dir, tmp_path, monkeypatch):
    """The finished training's state is kept until the drafter is in place (a write that fails
    says where it is; the same command then writes the drafter from it), then removed."""
    import tailtamer.atomic as atomic
    from tailtamer.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "12+34=46 and 46-34=12"}) + "\n" for _ in range(8)))
    argv = ["drafter", "train", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "dr"),
            "--steps", "3"]
    rename = atomic.os.rename

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "rename", full)
    assert main(argv) == 2
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("dr.partial-")]
    assert len(kept) == 1 and not (tmp_path / "dr").exists()
    monkeypatch.setattr(atomic.os, "rename", rename)
    assert main(argv) == 0
    assert (tmp_path / "dr" / "model.safetensors").is_file() and not kept[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "dr", "model"]  # model: model_dir


def test_a_drafter_state_keeps_its_inputs_and_its_path(target, tmp_path, monkeypatch):
    """The state's name covers the target's config (rope_theta changes the hidden states, not
    the weights); a resume keeps the feature path its first part took (cached features and the
    target run every step agree to 7 digits, not to the bit); a state that fails part-way
    through loading is reset to the start; a diverged training removes its state (going on from
    it diverges again); other inputs' states are named when one is removed."""
    import dataclasses
    import os
    import signal

    import tailtamer.drafter.train as train
    from tailtamer.drafter.train import training_state
    from tailtamer.model.transformer import Transformer
    from tailtamer.stopping import Interrupted

    seqs = [p + p[::-1] for p in token_prompts(24, seed=4)]
    cfg = DrafterTrainConfig(steps=10, batch_size=4, lr=3e-3)
    other = Transformer(dataclasses.replace(target.config, rope_theta=target.config.rope_theta * 2))
    other.load_state_dict(target.state_dict())
    assert training_state(tmp_path / "d", other, seqs, cfg).key != training_state(tmp_path / "d", target, seqs, cfg).key
    # stopped without the feature cache, resumed with it: the resume runs the target every step, as before
    uncached = dataclasses.replace(cfg, feature_cache_mb=0)
    straight, _ = train_drafter(target, seqs, uncached, log=lambda _: None)
    state = training_state(tmp_path / "d", target, seqs, cfg)
    assert state == training_state(tmp_path / "d", target, seqs, uncached)  # the cache is memory, not an input
    loss, calls = train.unrolled_loss, []

    def ctrl_c(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return loss(*args, **kwargs)

    monkeypatch.setattr(train, "unrolled_loss", ctrl_c)
    with pytest.raises(Interrupted):
        train_drafter(target, seqs, uncached, log=lambda _: None, state=state)
    monkeypatch.setattr(train, "unrolled_loss", loss)
    logs = []
    resumed, _ = train_drafter(target, seqs, cfg, log=logs.append, state=state)
    assert not any("hidden states" in line for line in logs), logs
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    # a state whose drafter and optimizer load and whose torch RNG state does not: reset, trained from the start
    saved = torch.load(state.path, weights_only=True)
    saved.update(step=5, torch_rng=torch.zeros(3, dtype=torch.uint8))
    torch.save(saved, state.path)
    logs = []
    fresh, _ = train_drafter(target, seqs, uncached, log=logs.append, state=state)
    assert any(line.startswith(f"{state.path}: cannot go on from it (") for line in logs), logs
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), fresh.state_dict().values()))
    # a training that diverges takes its state away, and names the other inputs' states it leaves
    beside = training_state(tmp_path / "d", target, seqs[1:], cfg).path
    beside.write_bytes(b"another input's state")
    logs = []
    with pytest.raises(train.TrainingDiverged):
        train_drafter(target, seqs, dataclasses.replace(cfg, lr=1e38), log=logs.append,
                      state=training_state(tmp_path / "d", target, seqs, dataclasses.replace(cfg, lr=1e38)))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([state.path.name, beside.name])
    assert any(line.startswith(f"states of stopped trainings from other inputs are kept in {tmp_path}: ")
               and beside.name in line and state.path.name in line for line in logs), logs


def test_a_state_that_cannot_be_removed_is_said(tmp_path):
    """A directory where the state file goes made a traceback after the output was written."""
    from tailtamer.resumable import Resumable

    state = Resumable.beside(tmp_path / "out", "abc")
    state.path.mkdir()
    logs = []
    state.remove(logs.append)
    assert logs == [f"{state.path}: the training's state, no longer needed, could not be removed (Is a directory)"]

"""Our decoder against transformers' Qwen2ForCausalLM / LlamaForCausalLM / Qwen3ForCausalLM on the
same weights (directories written here; tests/test_architectures.py loads transformers' own)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailtamer.model.config import Llama3RopeScaling
from tailtamer.model.io import load_model, save_model
from tailtamer.model.transformer import KVCache
from conftest import random_model, tiny_config

CONFIGS = [
    dict(architecture="Qwen2ForCausalLM"),
    dict(architecture="Qwen2ForCausalLM", tie_word_embeddings=True, num_key_value_heads=1, rope_theta=1e6),
    dict(architecture="LlamaForCausalLM", attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    dict(architecture="LlamaForCausalLM", tie_word_embeddings=True, hidden_size=48, num_attention_heads=6,
         num_key_value_heads=3, head_dim=16, num_hidden_layers=3),
    dict(architecture="Qwen3ForCausalLM", head_dim=24, attention_bias=True),
    dict(architecture="LlamaForCausalLM", rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64)),
]


@pytest.fixture(params=range(len(CONFIGS)), ids=lambda i: f"cfg{i}")
def pair(request, tmp_path):
    cfg = tiny_config(**CONFIGS[request.param])
    save_model(random_model(cfg, seed=request.param), tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    return load_model(tmp_path), hf, cfg


def test_logits_match_transformers(pair):
    ours, hf, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        logits, hidden = ours(ids)
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max() < 1e-4
    assert hidden.shape == (3, 40, cfg.hidden_size)


def test_final_hidden_states_match_transformers(pair):
    ours, hf, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids, output_hidden_states=True).hidden_states[-1]
        _, hidden = ours(ids)
    assert (hidden - expected).abs().max() < 1e-4


def test_prefill_then_decode_chunks_equal_full_forward(pair):
    ours, _, cfg = pair
    ids = torch.randint(0, cfg.vocab_size, (3, 30), generator=torch.Generator().manual_seed(2))
    cache = KVCache(cfg, slots=5, max_len=64)
    slots = torch.tensor([4, 0, 2])  # arbitrary, non-contiguous slots
    with torch.no_grad():
        full, _ = ours(ids)
        parts = [ours.prefill(ids[:, :11], cache, slots)[0]]
        for lo, hi in [(11, 12), (12, 20), (20, 30)]:
            parts.append(ours.decode(ids[:, lo:hi], cache, slots, torch.full((3,), lo))[0])
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-4
    last = torch.tensor([10, 3, 0])  # the engine asks for the logits at each prompt's end only
    with torch.no_grad():
        at_last, hidden = ours.prefill(ids[:, :11], KVCache(cfg, slots=5, max_len=64), slots, last)
    assert at_last.shape == (3, 1, cfg.vocab_size) and hidden.shape[1] == 11
    assert torch.allclose(at_last[:, 0], parts[0][torch.arange(3), last], atol=1e-5)  # a smaller matmul


def test_consecutive_slots_as_a_slice_equal_slot_ids():
    cfg = tiny_config()
    model = random_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    results = []
    for slots in (slice(1, 4), torch.tensor([1, 2, 3])):
        cache = KVCache(cfg, slots=5, max_len=32)
        with torch.no_grad():
            model.prefill(ids[:, :7], cache, slots)
            results.append(model.decode(ids[:, 7:], cache, slots, torch.full((3,), 7))[0])
            assert cache.kv[:, 0].abs().sum() == 0 and cache.kv[:, 4].abs().sum() == 0  # other slots untouched
    assert torch.equal(results[0], results[1])


def test_decode_at_different_lengths_per_sequence():
    cfg = tiny_config()
    model = random_model(cfg)
    a = torch.randint(0, cfg.vocab_size, (1, 9))
    b = torch.randint(0, cfg.vocab_size, (1, 4))
    cache = KVCache(cfg, slots=2, max_len=32)
    with torch.no_grad():
        model.prefill(a[:, :8], cache, torch.tensor([0]))
        model.prefill(b[:, :3], cache, torch.tensor([1]))
        step, _ = model.decode(torch.cat([a[:, 8:], b[:, 3:]]), cache, torch.tensor([0, 1]), torch.tensor([8, 3]))
        expected_a = model(a)[0][0, -1]
        expected_b = model(b)[0][0, -1]
    assert (step[0, 0] - expected_a).abs().max() < 1e-4
    assert (step[1, 0] - expected_b).abs().max() < 1e-4


def test_tree_mask_decode_equals_each_branch_run_as_a_chain():
    """A tree with shared positions: root r, children c1 c2 (depth 1), grandchild g under c2.
    Each node's logits must equal a plain causal run over its own root-to-node path."""
    cfg = tiny_config()
    model = random_model(cfg).double()
    prompt = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    r, c1, c2, g = 5, 17, 23, 42
    tree = torch.tensor([[r, c1, c2, g]])
    parent = [-1, 0, 0, 2]
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parent[j]
    positions = torch.tensor([[10, 11, 11, 12]])
    cache = KVCache(cfg, 1, 32, dtype=torch.float64)
    slot = torch.tensor([0])
    with torch.no_grad():
        model.prefill(prompt, cache, slot)
        logits, _ = model.decode(tree, cache, slot, torch.tensor([10]), positions, mask)
        for node, path in [(0, [r]), (1, [r, c1]), (2, [r, c2]), (3, [r, c2, g])]:
            chain, _ = model(torch.cat([prompt, torch.tensor([path])], 1))
            assert (logits[0, node] - chain[0, -1]).abs().max() < 1e-10, node


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.bfloat16, 0.05)])
def test_other_dtypes_run_and_agree_with_float32(dtype, tol):
    """Relative error of the logits: bfloat16 keeps ~3 significant digits per operation."""
    cfg = tiny_config()
    model = random_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        ref, _ = model(ids)
        low, hidden = model.to(dtype)(ids)
    assert low.dtype == dtype and hidden.dtype == dtype
    assert (low.float() - ref).norm() / ref.norm() < tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    cfg = tiny_config()
    model = random_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        ref, _ = model(ids)
        got, _ = model.cuda()(ids.cuda())
    assert (got.cpu() - ref).abs().max() < 1e-3

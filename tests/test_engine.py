"""The continuous-batching engine: parity with transformers, reproducibility, limits, errors."""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from tailtamer.errors import DataError
from tailtamer.model.io import load_model
from tailtamer.model.tokenizer import char_tokenizer
import tailtamer.rollout.engine as engine_module
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import NOISE_WINDOW, SamplingParams, target_probs
from conftest import random_model, tiny_config


def _prompts(n, seed=0, lo=1, hi=14, vocab=100):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(5, vocab, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("max_batch_size,group_tokens", [(1, None), (3, None), (16, None), (16, 0)])
def test_greedy_equals_transformers_generate_in_float64(model_dir, max_batch_size, group_tokens, monkeypatch):
    if group_tokens is not None:  # every prompt length prefilled in its own forward
        monkeypatch.setitem(engine_module.PREFILL_GROUP_TOKENS, "cpu", group_tokens)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    engine = Engine(load_model(model_dir, "float64"), config=EngineConfig(max_batch_size=max_batch_size))
    prompts = _prompts(8)
    completions, _ = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40))
    for c, p in zip(completions, prompts):
        expected = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=40, do_sample=False, eos_token_id=1, pad_token_id=0)
        assert c.token_ids == expected[0, len(p):].tolist()
    assert completions[0].prompt_index == 0 and len(completions) == 8


def test_a_sample_does_not_depend_on_the_batch(model_dir):
    model = load_model(model_dir, "float64")
    params = SamplingParams(temperature=1.0, top_p=0.95, n=4, max_new_tokens=30, seed=11)
    prompts = _prompts(6, seed=1)
    alone, _ = Engine(model, config=EngineConfig(max_batch_size=1)).generate(prompts, params)
    together, _ = Engine(model, config=EngineConfig(max_batch_size=24)).generate(prompts, params)
    crowded, _ = Engine(model, config=EngineConfig(max_batch_size=7)).generate(prompts + _prompts(5, seed=2), params)
    assert [c.token_ids for c in alone] == [c.token_ids for c in together] == [c.token_ids for c in crowded[:24]]
    assert len({tuple(c.token_ids) for c in together}) > 12  # samples really differ
    # Requests finished at different times, so slots were freed and refilled mid-batch.
    assert {c.finish_reason for c in together} == {"stop", "length"}


def test_seed_changes_samples(model_dir):
    engine = Engine(load_model(model_dir))
    a, _ = engine.generate(_prompts(4), SamplingParams(n=2, max_new_tokens=20, seed=1))
    b, _ = engine.generate(_prompts(4), SamplingParams(n=2, max_new_tokens=20, seed=2))
    assert [c.token_ids for c in a] != [c.token_ids for c in b]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(top_p=0.8)], ids=["t1", "topk", "topp"])
def test_first_token_distribution_matches_target(params):
    cfg = tiny_config(vocab_size=12, eos_token_id=None)
    model = random_model(cfg, std=0.15).double()
    engine = Engine(model, config=EngineConfig(max_batch_size=512), eos_ids=())
    prompt = [3, 7, 2]
    n = 3000
    completions, _ = engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": n, "max_new_tokens": 1}))
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in completions]), minlength=12)
    with torch.no_grad():
        probs = target_probs(model(torch.tensor([prompt]))[0][0, -1], params)
    support = probs > 0
    filtered = params.top_k > 0 or params.top_p < 1
    assert support.sum() >= 3 and (support.sum() < 12 or not filtered)  # filters really cut
    assert counts[~support].sum() == 0  # nothing outside top-k / top-p
    assert chisquare(counts[support].tolist(), (probs[support] * n).tolist()).pvalue > 1e-3


def test_continuous_batching_refills_freed_slots_and_records_the_tail(model_dir):
    engine = Engine(load_model(model_dir), config=EngineConfig(max_batch_size=4))
    completions, stats = engine.generate(_prompts(10), SamplingParams(n=2, max_new_tokens=25))
    running = [n for _, n, _ in stats.timeline]
    assert len(completions) == 20 and max(running) == 4
    assert running[-1] < 4  # the tail: the last steps run with free slots
    assert stats.tokens == sum(len(c.token_ids) for c in completions)
    assert stats.decode_steps == len(stats.timeline)
    times = [t for t, _, _ in stats.timeline]
    assert times == sorted(times)


def test_token_budget_limits_admission(model_dir):
    engine = Engine(load_model(model_dir), config=EngineConfig(max_batch_size=16, max_tokens=100))
    params = SamplingParams(max_new_tokens=30)
    prompts = _prompts(12, lo=5, hi=6)  # 5 + 30 = 35 tokens each, so at most 2 fit in 100
    completions, stats = engine.generate(prompts, params)
    assert len(completions) == 12
    assert max(n for _, n, _ in stats.timeline) <= 2


def test_eos_stop_strings_and_length():
    tok = char_tokenizer()
    cfg = tiny_config()
    model = random_model(cfg)
    engine = Engine(model, tok)
    prompts = [tok.encode("12+3=")]
    sampled, _ = engine.generate(prompts, SamplingParams(n=30, max_new_tokens=12, seed=3))
    for c in sampled:
        ends_with_eos = c.token_ids[-1] == tok.eos_token_id
        assert c.finish_reason == ("stop" if ends_with_eos else "length")
        assert tok.eos_token_id not in c.token_ids[:-1]
        assert ends_with_eos or len(c.token_ids) == 12
    # Pick a stop string from a sampled text, then check generation halts on it and hides it.
    text = next(c.text for c in sampled if len(c.text) >= 4)
    stop = text[2:4]
    stopped, _ = engine.generate(prompts, SamplingParams(n=30, max_new_tokens=12, seed=3, stop=(stop,)))
    hits = 0
    for before, after in zip(sampled, stopped):
        cut = before.text.find(stop)
        if cut >= 0:  # same random stream, so the same text up to the stop string
            hits += 1
            assert after.finish_reason == "stop" and after.text == before.text[:cut]
        else:
            assert after.token_ids == before.token_ids
    assert hits >= 1


def test_context_limit_ends_with_length(model_dir):
    engine = Engine(load_model(model_dir), config=EngineConfig(max_seq_len=20), eos_ids=())  # no early stop
    completions, _ = engine.generate([[5] * 15], SamplingParams(max_new_tokens=100))
    assert completions[0].finish_reason == "length"
    assert len(completions[0].token_ids) == 5


def test_a_response_limit_past_the_context_costs_only_the_context():
    """max_new_tokens far beyond the context: the sampling noise kept per request does not
    grow with it (a table max_new_tokens wide would be 480 GB here), and the draws are the same."""
    engine = Engine(random_model(), config=EngineConfig(max_seq_len=24), eos_ids=())
    params = SamplingParams(temperature=1.0, n=3, seed=4)
    huge, _ = engine.generate([[5] * 15, [6] * 4], replace(params, max_new_tokens=10**10))
    assert engine._draws.table.shape == (6, NOISE_WINDOW, engine.model.config.vocab_size)
    fits, _ = engine.generate([[5] * 15, [6] * 4], replace(params, max_new_tokens=20))
    assert [c.token_ids for c in huge] == [c.token_ids for c in fits]
    assert [len(c.token_ids) for c in huge] == [9] * 3 + [20] * 3


def test_bad_prompts_are_named():
    engine = Engine(random_model(), config=EngineConfig(max_seq_len=16))
    with pytest.raises(DataError, match="prompts.jsonl:3: prompt has 16 tokens; the context holds 16"):
        engine.generate([[5], [6], [7] * 16], SamplingParams(), labels=["prompts.jsonl:1", "x:2", "prompts.jsonl:3"])
    with pytest.raises(DataError, match="prompt 1: prompt is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(DataError, match="no prompts"):
        engine.generate([], SamplingParams())

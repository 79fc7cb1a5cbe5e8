"""TLTRollout inside TRL's GRPOTrainer (TRL is an optional extra: `pip install tailtamer[trl]`)."""

import dataclasses

import pytest
import torch

trl = pytest.importorskip("trl")

from tailtamer.errors import ConfigError  # noqa: E402
from tailtamer.integrations.trl import StalePolicy, TLTRollout  # noqa: E402
from tailtamer.rollout.vllm_backend import VLLMConfig  # noqa: E402

PROMPTS = ["12+3=?\n", "7-2=?\n", "4*5=?\n", "9+9=?\n"]


def _trainer(model_dir, tmp_path, rollout=None, steps=2, generations=4, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    settings = dict(output_dir=str(tmp_path / "trl"), max_steps=steps, learning_rate=1e-3,
                    per_device_train_batch_size=len(PROMPTS) * generations // 2, num_generations=generations,
                    max_completion_length=12, temperature=1.0, beta=0.0, logging_steps=1, save_strategy="no",
                    report_to="none", use_cpu=True, seed=3, bf16=False, fp16=False, shuffle_dataset=False,
                    dataloader_num_workers=0,
                    **{k: False for k in ("gradient_checkpointing", "activation_checkpointing") if k in names})
    settings.update(config)
    seen = []

    def reward(completions, **_):
        seen.append(list(completions))
        return [float(len(c) % 2) for c in completions]

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=trl.GRPOConfig(**settings),
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
                              processing_class=tokenizer, rollout_func=rollout)
    return trainer, seen


def _rollout_once(trainer, rollout):
    """One call as TRL's _generate makes it: the process's rows, each prompt num_generations times."""
    rows = [p for p in PROMPTS[:2] for _ in range(trainer.num_generations)]
    return rows, rollout(rows, trainer)


def test_grpo_trainer_runs_with_tlt_rollout_and_logs_its_figures(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="on", drafter="suffix", strategy="s4_2_5")
    trainer, seen = _trainer(model_dir, tmp_path, rollout)
    trainer.train()
    assert rollout.calls == 2 and len(seen) == 2 and all(len(s) == 8 for s in seen)
    logged = [row for row in trainer.state.log_history if "tlt/accept_len" in row]
    assert len(logged) == 2 and all(row["tlt/accept_len"] >= 1.0 and "tlt/sd_tokens_frac" in row for row in logged)


def test_greedy_completions_are_trls_own_and_logprobs_its_recomputation(model_dir, tmp_path, monkeypatch):
    """Greedy (do_sample False): the same tokens as TRL's transformers generation, SD on or off;
    the log-probabilities as TRL recomputes them (log-softmax of the logits / temperature)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    greedy = {"generation_kwargs": {"do_sample": False}}
    plain_trainer, _ = _trainer(model_dir, tmp_path, None, **greedy)
    rows = [p for p in PROMPTS[:2] for _ in range(plain_trainer.num_generations)]
    prompt_ids, _, _ = plain_trainer._tokenize_prompts(rows)
    theirs, _ = plain_trainer._generate_single_turn(prompt_ids, None, {}, plain_trainer.num_generations)
    for rollout in (TLTRollout(spec="off", drafter=None), TLTRollout(spec="on", drafter="suffix", strategy="s4_2_5")):
        trainer, _ = _trainer(model_dir, tmp_path, rollout, **greedy)
        out = rollout(rows, trainer)
        assert out["prompt_ids"] == [list(p) for p in prompt_ids]
        assert out["completion_ids"] == theirs
        model = trainer.model
        for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            with torch.no_grad():
                logits = model(torch.tensor([p + c])).logits[0, len(p) - 1: -1]
            expected = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(lp, dtype=torch.float64), expected, atol=1e-4)


def test_sd_on_and_off_give_the_same_seeded_samples(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    outs = []
    for rollout in (TLTRollout(spec="off", drafter=None), TLTRollout(spec="on", drafter="suffix", strategy="s4_2_5"),
                    TLTRollout(spec="adaptive", drafter="suffix")):
        trainer, _ = _trainer(model_dir, tmp_path, rollout)
        outs.append(_rollout_once(trainer, rollout)[1])
    assert outs[0]["completion_ids"] == outs[1]["completion_ids"] == outs[2]["completion_ids"]
    for a, b in zip(outs[0]["logprobs"], outs[1]["logprobs"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert len({tuple(c) for c in outs[0]["completion_ids"]}) > 1  # sampled, not all alike


def test_the_trainers_updates_reach_the_engine_and_a_stale_copy_is_caught(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, rollout)
    _rollout_once(trainer, rollout)
    with torch.no_grad():
        trainer.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # the trainer's update
    _rollout_once(trainer, rollout)  # published: the probe agrees
    with torch.no_grad():
        trainer.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    monkeypatch.setattr(TLTRollout, "publish", lambda self, policy: self.check(policy))  # a copy that never happens
    with pytest.raises(StalePolicy, match="the engine's policy is stale: its logits on the probe input differ"):
        _rollout_once(trainer, rollout)


@pytest.mark.parametrize("kwargs,config,message", [
    ({"backend": "nope"}, {}, "backend='nope': tailtamer \\(our engine\\) or vllm"),
    ({"drafter": "builtin"}, {}, "drafter='builtin' is the built-in base model's drafter"),
    ({"spec": "on", "drafter": None}, {}, "needs a drafter"),
    ({}, {"repetition_penalty": 1.2}, "repetition_penalty=1.2 would change the policy's distribution"),
    ({}, {"min_p": 0.1}, "min_p=0.1 is not supported"),
    ({}, {"generation_kwargs": {"no_repeat_ngram_size": 3}}, "generation_kwargs \\['no_repeat_ngram_size'\\]"),
    ({"spec": "on", "drafter": "/no/such/drafter"}, {}, "drafter directory not found"),
    # TRL merges these into its generation_kwargs, where its own generation reads them
    ({}, {"generation_kwargs": {"min_p": 0.1}}, "min_p=0.1 is not supported"),
    ({}, {"generation_kwargs": {"repetition_penalty": 1.3}}, "repetition_penalty=1.3 would change"),
    ({}, {"generation_kwargs": {"temperature": "0.7"}}, "generation temperature='0.7': give a number"),
    ({}, {"top_p": 0.0}, "generation top_p=0: give top_p in \\(0, 1\\], or generation_kwargs="),
])
def test_bad_settings_are_one_line(model_dir, tmp_path, monkeypatch, kwargs, config, message):
    from tailtamer.errors import TailtamerError

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    with pytest.raises(TailtamerError) as e:
        rollout = TLTRollout(**kwargs)
        trainer, _ = _trainer(model_dir, tmp_path, rollout, **config)
        _rollout_once(trainer, rollout)
    assert e.match(message) and "\n" not in str(e.value)
    assert isinstance(e.value, (ConfigError, TailtamerError))


@pytest.mark.parametrize("kwargs,message", [
    ({"bs_threshold": "64"}, "bs_threshold='64': give a whole number >= 0 or None"),
    ({"bs_threshold": 2.5}, "bs_threshold=2.5: give a whole number"),
    ({"bs_threshold": True}, "bs_threshold=True: give a whole number"),
    ({"max_batch_size": "512"}, "max_batch_size='512': give a whole number >= 1"),
    ({"max_batch_size": 0}, "max_batch_size=0: give a whole number >= 1"),
    ({"drafter": 5}, "drafter=5: give a drafter directory, 'suffix' or None"),
    ({"drafter": "ngram"}, "ngram is vLLM's prompt lookup"),
    ({"spot": {"train": False}}, "spot={'train': False}: give a tailtamer.drafter.spot.SpotConfig"),
    ({"spot": None}, "spot=None: give a tailtamer.drafter.spot.SpotConfig"),
    ({"spec": "fast"}, "spec='fast': off, on"),
    ({"spec": "adaptive", "strategy": "s8_2_9"}, "spec.strategy=s8_2_9 is not read: spec.mode=adaptive"),
    ({"spec": "on", "strategies": ["s4_1_5"]}, "spec.strategies=\\[s4_1_5\\] is not read: spec.mode=on"),
    ({"spec": "off", "strategy": "4_1_5"}, "spec.strategy=4_1_5 is not read: spec.mode=off"),
    ({"spec": "off", "bs_threshold": 3}, "bs_threshold=3 is the long-tail switch of spec='adaptive'; spec='off'"),
    ({"spec": "off", "drafter": "/a/drafter"}, "drafter='/a/drafter' is not used with spec='off'"),
    ({"strategies": "s4_1_5"}, "strategies='s4_1_5': give a list of strategy names"),
    ({"strategy": 5}, "strategy=5: give one strategy's name"),
    ({"strategies": 5}, "strategies=5: give a list of strategy names"),
    ({"strategies": (s for s in ["s4_1_5"])}, "give a list of strategy names"),  # a generator, used up once read
    ({"vllm": {"kv_cache_gb": 4}}, "vllm=\\{'kv_cache_gb': 4\\}: give a tailtamer.rollout.vllm_backend.VLLMConfig"),
    ({"vllm": VLLMConfig(kv_cache_gb=4)}, "vllm=... sets up vLLM's engine; backend='tailtamer' would not read it"),
])
def test_bad_arguments_are_refused_at_construction_naming_them(kwargs, message):
    """Not at the first rollout inside trainer.train(), as a TypeError or a field the user never set."""
    with pytest.raises(ConfigError, match=message) as e:
        TLTRollout(**kwargs)
    assert "\n" not in str(e.value)


def test_whole_numbers_of_other_integer_types_are_taken():
    import numpy as np

    rollout = TLTRollout(spec="adaptive", bs_threshold=np.int32(8), max_batch_size=np.int64(256))
    assert (rollout.spec.bs_threshold, rollout.max_batch_size) == (8, 256)
    assert type(rollout.spec.bs_threshold) is int and type(rollout.max_batch_size) is int


def test_a_call_that_is_not_trls_is_one_line():
    rollout = TLTRollout(spec="off", drafter=None)
    for prompts, trainer in (([], None), ("a prompt", None), (["a prompt"], None)):
        with pytest.raises(ConfigError, match="is called by TRL's GRPOTrainer with a non-empty list of prompts"):
            rollout(prompts, trainer)


@pytest.mark.parametrize("prompts,row,shown,first", [
    (["a", None], 1, "None", ", as row 0 is text"),
    (["a", [{"role": "user", "content": "b"}]], 1, "\\[\\{'role'", ", as row 0 is text"),
    ([[{"role": "user", "content": "a"}], "b"], 1, "'b'", ", as row 0 is a chat"),
    ([[{"role": "user", "content": "a"}], []], 1, "\\[\\]", ", as row 0 is a chat"),
    ([[{"content": "a"}]], 0, "\\[\\{'content'", ""),
    ([{"role": "user", "content": "a"}], 0, "\\{'role'", ""),
    ([7, 8], 0, "7", ""),
])
def test_malformed_prompt_rows_are_named_before_anything_runs(prompts, row, shown, first):
    """They raised the tokenizer's or the chat template's own errors, after the engine was built."""
    from types import SimpleNamespace

    from tailtamer.errors import DataError

    rollout = TLTRollout(spec="off", drafter=None)
    trainer = SimpleNamespace(accelerator=None)  # reached only past the check
    with pytest.raises(DataError, match=rf"^TLTRollout call 1, prompt row {row}: {shown}.*; a batch's prompts are "
                                        rf"all text or all chats \(lists of .* messages\){first}$"):
        rollout(prompts, trainer)
    assert rollout.engine is None


def test_suffix_drafts_on_vllm_are_refused_for_what_they_are(monkeypatch):
    """Not for vLLM's default arms (EAGLE chains), which the user never wrote, as before."""
    import tailtamer.integrations.trl as trl

    monkeypatch.setattr(trl, "require_vllm", lambda *_: None)  # as where vLLM is installed
    with pytest.raises(ConfigError, match="^spec.drafter=suffix runs on rollout.backend=tailtamer"):
        TLTRollout(backend="vllm", spec="on", drafter="suffix")


def test_a_prompt_longer_than_the_context_is_one_line(model_dir, tmp_path, monkeypatch):
    from tailtamer.errors import DataError

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, rollout)
    with pytest.raises(DataError, match="context holds"):
        rollout(["x" * 5000] * trainer.num_generations, trainer)


@pytest.mark.slow
def test_two_processes_train_the_drafter_on_the_idle_one_and_end_identical(model_dir, tmp_path):
    """torchrun, 2 processes on gloo: process 1's rollouts end later, so process 0 trains the
    EAGLE drafter meanwhile; after every call both hold the same averaged drafter."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tailtamer.model.drafter import init_drafter, load_drafter, save_drafter, weights_checksum
    from tailtamer.model.io import load_model

    target = load_model(model_dir)
    save_drafter(init_drafter(target, std=0.2), tmp_path / "drafter")
    initial = weights_checksum(load_drafter(tmp_path / "drafter", target))
    out = tmp_path / "report.json"
    script = Path(__file__).parent / "trl_two_processes.py"
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    from tailtamer.dist import _free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_free_port()), str(script), str(model_dir), str(tmp_path / "drafter"), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    assert reports[0]["checksum"] == reports[1]["checksum"] != initial  # trained, then the same on both
    assert reports[0]["calls"] == reports[1]["calls"] == 2
    steps = [sum(r["tlt/drafter_steps"] for r in rep["rows"]) for rep in reports]
    assert steps[0] > 0  # the idle process trained
    assert all(r["tlt/idle_s"] >= 0 for rep in reports for r in rep["rows"])


@pytest.mark.parametrize("case", ["qwen3", "qwen3-bias-tied", "llama3-rope"])
def test_qwen3_and_llama3_models_roll_out_as_trl_generates(case, tmp_path, monkeypatch):
    """transformers' own Qwen3 and Llama 3 models (q/k norms, biases, tied embeddings, Llama 3
    rope scaling): the probe passes and greedy completions equal TRL's generation."""
    from test_architectures import CASES, _hf_model

    from tailtamer.model.tokenizer import char_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    out = tmp_path / case
    _hf_model(CASES[case]()).float().save_pretrained(out)
    char_tokenizer().save(out)
    greedy = {"generation_kwargs": {"do_sample": False}}
    plain, _ = _trainer(out, tmp_path, None, **greedy)
    rows = [p for p in PROMPTS[:2] for _ in range(plain.num_generations)]
    prompt_ids, _, _ = plain._tokenize_prompts(rows)
    theirs, _ = plain._generate_single_turn(prompt_ids, None, {}, plain.num_generations)
    rollout = TLTRollout(spec="on", drafter="suffix", strategy="s4_2_5")
    trainer, _ = _trainer(out, tmp_path, rollout, **greedy)
    assert rollout(rows, trainer)["completion_ids"] == theirs


def test_a_drafter_for_another_model_is_one_line(model_dir, tmp_path, monkeypatch):
    from conftest import random_model, tiny_config

    from tailtamer.errors import CheckpointError
    from tailtamer.model.drafter import init_drafter, save_drafter

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    save_drafter(init_drafter(random_model(tiny_config(hidden_size=32))), tmp_path / "other")
    rollout = TLTRollout(spec="on", drafter=str(tmp_path / "other"), strategy="3_1_4")
    trainer, _ = _trainer(model_dir, tmp_path, rollout)
    with pytest.raises(CheckpointError, match=f"drafter {tmp_path / 'other'}.*hidden_size") as e:
        _rollout_once(trainer, rollout)
    assert "\n" not in str(e.value)


def test_one_process_trains_the_drafter_only_in_a_window_when_asked(model_dir, tmp_path, monkeypatch):
    from tailtamer.drafter.spot import SpotConfig
    from tailtamer.model.drafter import init_drafter, save_drafter, weights_checksum
    from tailtamer.model.io import load_model

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    save_drafter(init_drafter(load_model(model_dir), std=0.2), tmp_path / "drafter")
    frozen = TLTRollout(spec="on", drafter=str(tmp_path / "drafter"), strategy="3_1_4")
    trainer, _ = _trainer(model_dir, tmp_path, frozen)
    _rollout_once(trainer, frozen)
    assert frozen.adaptive is None  # one process: nothing trains, nothing is added to the step
    window = TLTRollout(spec="on", drafter=str(tmp_path / "drafter"), strategy="3_1_4",
                        spot=SpotConfig(single_worker="window", window_s=0.5, max_steps=5))
    trainer, _ = _trainer(model_dir, tmp_path, window)
    _rollout_once(trainer, window)
    before = weights_checksum(window.adaptive.drafter)
    _rollout_once(trainer, window)
    assert weights_checksum(window.adaptive.drafter) != before
    assert trainer._metrics["train" if trainer.model.training else "eval"]["tlt/drafter_steps"][-1] > 0


@pytest.mark.vllm
def test_the_vllm_backend_inside_trl(tmp_path, monkeypatch):
    """`make test-vllm` (TRL in vLLM's environment): GRPOTrainer runs two steps with
    TLTRollout(backend="vllm") and its EAGLE drafter (chains, the long-tail switch through vLLM's
    draft-length table); greedy completions equal TRL's own generation, log-probabilities its
    recomputation; the trainer's update reaches vLLM (its publish is checked layer by layer);
    TLTRollout's vllm section reaches vLLM's engine."""
    pytest.importorskip("vllm")
    from conftest import random_model, tiny_config

    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model, save_model
    from tailtamer.model.tokenizer import char_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model_dir = tmp_path / "model"  # heads of 32: vLLM's CPU attention runs no smaller
    save_model(random_model(tiny_config(num_attention_heads=2, num_key_value_heads=1)), model_dir)
    char_tokenizer().save(model_dir)
    save_drafter(init_drafter(load_model(model_dir), std=0.2, fc_bias=False), tmp_path / "drafter")
    greedy = {"generation_kwargs": {"do_sample": False}}
    plain, _ = _trainer(model_dir, tmp_path, None, **greedy)
    rows = [p for p in PROMPTS[:2] for _ in range(plain.num_generations)]
    prompt_ids, _, _ = plain._tokenize_prompts(rows)
    theirs, _ = plain._generate_single_turn(prompt_ids, None, {}, plain.num_generations)
    rollout = TLTRollout(backend="vllm", spec="on", drafter=str(tmp_path / "drafter"), strategy="4_1_5",
                         vllm=VLLMConfig(kv_cache_gb=0.25))
    try:
        trainer, _ = _trainer(model_dir, tmp_path, rollout, **greedy)
        out = rollout(rows, trainer)
        assert out["completion_ids"] == theirs
        assert rollout.engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 1 << 28  # the user's
        stamped = [line for line in (tmp_path / "trl" / "vllm.log").read_text().splitlines() if line[:2] == "20"]
        assert stamped and all(line.split()[2:4] == ["process", "0"] for line in stamped)  # whose, among processes
        for p, c, lp in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            with torch.no_grad():
                logits = trainer.model(torch.tensor([p + c])).logits[0, len(p) - 1: -1]
            expected = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(lp, dtype=torch.float64), expected, atol=1e-4)
    finally:
        rollout.close()
    sampled = TLTRollout(backend="vllm", spec="adaptive", drafter=str(tmp_path / "drafter"))
    try:
        trainer, seen = _trainer(model_dir, tmp_path, sampled)
        trainer.train()
        assert sampled.calls == 2 and all(len(s) == 8 for s in seen)
        assert [r for r in trainer.state.log_history if "tlt/accept_len" in r]
    finally:
        sampled.close()


def test_a_trl_without_rollout_func_is_one_line(monkeypatch):
    class OldTrainer:
        def __init__(self, model, reward_funcs, args=None):
            pass

    monkeypatch.setattr(trl, "GRPOTrainer", OldTrainer)
    with pytest.raises(ConfigError, match=r"needs GRPOTrainer's rollout_func \(TRL >= 1.0\); this TRL is "):
        TLTRollout()


def test_chat_prompts_are_rendered_as_trl_renders_them(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, rollout)
    trainer.processing_class.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    rows = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": p}]
            for p in PROMPTS[:2] for _ in range(trainer.num_generations)]
    theirs, _, _ = trainer._tokenize_prompts(rows)
    out = rollout(rows, trainer)
    assert out["prompt_ids"] == [list(p) for p in theirs]
    assert len(set(map(tuple, out["prompt_ids"]))) == 2 and all(out["completion_ids"])


def test_a_mixed_precision_trainer_rolls_out_with_the_probe_satisfied(model_dir, tmp_path, monkeypatch):
    """GRPOConfig's default bf16 wraps the model's forward in autocast: the probe compared its
    bfloat16 logits with the engine's float32 ones and called the policy stale on the first step."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="on", drafter="suffix", strategy="s4_2_5")
    trainer, seen = _trainer(model_dir, tmp_path, rollout, bf16=True)
    trainer.train()
    assert rollout.calls == 2 and len(seen) == 2


def test_trls_end_of_sequence_ids_are_the_ones_its_generation_kwargs_give(model_dir, tmp_path, monkeypatch):
    """generation_kwargs={'eos_token_id': ...} stops TRL's own generation there; the engine
    went on past it."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    plain, _ = _trainer(model_dir, tmp_path, TLTRollout(spec="off", drafter=None))
    stop = _rollout_once(plain, plain.rollout_func)[1]["completion_ids"][0][1]  # a token the first sample draws
    trainer, _ = _trainer(model_dir, tmp_path, rollout, generation_kwargs={"eos_token_id": [stop]})
    completions = _rollout_once(trainer, rollout)[1]["completion_ids"]
    assert completions[0][-1] == stop and len(completions[0]) == 2
    assert all(stop not in c[:-1] for c in completions)


def test_a_rollout_serves_one_model_and_says_so_for_another(model_dir, tmp_path, monkeypatch):
    from conftest import random_model, tiny_config
    from tailtamer.model.io import save_model
    from tailtamer.model.tokenizer import char_tokenizer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    narrow = tmp_path / "narrow"
    save_model(random_model(tiny_config(hidden_size=32)), narrow)
    char_tokenizer().save(narrow)
    deeper = tmp_path / "deeper"  # the same shapes, one layer more: its extra tensors were never copied
    save_model(random_model(tiny_config(num_hidden_layers=3)), deeper)
    char_tokenizer().save(deeper)
    rollout = TLTRollout(spec="off", drafter=None)
    _rollout_once(_trainer(model_dir, tmp_path, rollout)[0], rollout)
    with pytest.raises(ConfigError, match="the trainer's model is not the one its engine was built for"):
        _rollout_once(_trainer(narrow, tmp_path, rollout)[0], rollout)
    with pytest.raises(ConfigError, match="built for \\(layers.2.[a-z_.]+ differs; "):
        _rollout_once(_trainer(deeper, tmp_path, rollout)[0], rollout)


def test_bfloat16_weights_roll_out_and_sharded_weights_are_refused(model_dir, tmp_path, monkeypatch):
    """A model loaded in bfloat16 computes its probe logits in bfloat16, ours in float32: the
    probe holds it to the architecture's tolerance; FSDP's shards cannot fill the engine."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, rollout, generation_kwargs={"temperature": None})  # None: unset
    trainer.model.to(torch.bfloat16)
    rows, out = _rollout_once(trainer, rollout)
    assert len(out["completion_ids"]) == len(rows)
    sharded = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, sharded)
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True)
    with pytest.raises(ConfigError, match="FSDP and DeepSpeed ZeRO-3 shard the model's weights"):
        _rollout_once(trainer, sharded)


def test_prompt_errors_name_trls_rows_and_a_context_cut_is_said_once(model_dir, tmp_path, monkeypatch, capsys):
    from tailtamer.errors import DataError

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    rollout = TLTRollout(spec="off", drafter=None)
    trainer, _ = _trainer(model_dir, tmp_path, rollout, max_completion_length=300)  # the model's context: 256
    for _ in range(2):
        _rollout_once(trainer, rollout)
    err = capsys.readouterr().err
    assert err.count("TLTRollout: max_completion_length 300, but the model's context is 256 tokens") == 1, err
    rows = ["a"] * 4 + ["x" * 300] * 4
    with pytest.raises(DataError, match="TLTRollout call 3, prompt rows 4-7: "):
        rollout(rows, trainer)


def test_end_of_sequence_ids_as_trl_gives_them():
    """A tokenizer and model with no end-of-sequence token give TRL [None]: the engine took None
    as a token id and failed preparing its first batch."""
    from tailtamer.integrations.trl import end_of_sequence

    assert end_of_sequence([None]) == end_of_sequence(None) == ()
    assert end_of_sequence(7) == (7,) and end_of_sequence([3, None, 9]) == (3, 9)
    for wrong in (True, ["2"], [1.5]):
        with pytest.raises(ConfigError, match="give a token id or a list of them"):
            end_of_sequence(wrong)

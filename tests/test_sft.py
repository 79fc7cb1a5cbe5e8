"""SFT of the base model: loss masking, schedule, caching, and that training learns."""

import random

import pytest
import torch
import torch.nn.functional as F

from tailtamer.errors import ConfigError
from tailtamer.model.io import load_model
from tailtamer.model.tokenizer import char_tokenizer, load_tokenizer
from tailtamer.sft import (SFTConfig, encode_example, ensure_base_model, lr_at, make_batch, teacher_response,
                           train_sft)
from tailtamer.tasks.arithmetic import ArithmeticTask


def test_only_the_response_and_eos_are_learned():
    tok = char_tokenizer()
    ids, mask = encode_example(tok, {"prompt": "1+2=?\n", "trace": "1+2=3\nanswer: 3"})
    assert len(ids) == len(mask) == 6 + 15 + 1
    assert mask == [0] * 6 + [1] * 16
    assert ids[-1] == tok.eos_token_id


def test_batches_pad_and_mask():
    ids, mask = make_batch([([5, 6, 7], [0, 1, 1]), ([8], [1])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[False, True, True], [True, False, False]]


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    cfg = SFTConfig(steps=100, warmup=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))
    assert lr_at(100, cfg) == lr_at(100 + cfg.habit_steps - 1, cfg) == pytest.approx(0.1)


def test_the_teacher_answers_directly_at_the_given_rate():
    rng, problems = random.Random(0), ArithmeticTask().dataset(2000, seed=3)
    taught = [teacher_response(p, rng, 0.6) for p in problems]
    direct = [t for t in taught if t["trace"] == f"answer: {t['answer']}"]
    assert 0.55 < len(direct) / len(taught) < 0.65  # 0.6 ± 4.5 binomial standard deviations
    assert all(t["trace"] == p["trace"] for t, p in zip(taught, problems) if t not in direct)
    assert all(t["prompt"] == p["prompt"] and t["answer"] == p["answer"] for t, p in zip(taught, problems))
    assert [teacher_response(p, rng, 0.0) for p in problems] == problems


def _heldout_loss(model, tok, seed=99):
    rng = random.Random(seed)
    ids, mask = make_batch([encode_example(tok, ArithmeticTask().sample(rng)) for _ in range(32)], tok.pad_token_id)
    with torch.no_grad():
        logits, _ = model(ids[:, :-1])
    return F.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]]).item()


def test_a_short_run_lowers_held_out_loss(tmp_path):
    from tailtamer.model.config import preset_config
    from tailtamer.model.io import init_model

    cfg = SFTConfig(steps=40, batch_size=16, warmup=5, habit_steps=0)
    tok = char_tokenizer()
    before = init_model(preset_config(cfg.preset, tok.vocab_size, tie_word_embeddings=True), seed=cfg.seed)
    train_sft(cfg, tmp_path, log=lambda _: None)
    after = load_model(tmp_path)
    assert load_tokenizer(tmp_path).encode("1+2") == tok.encode("1+2")
    assert _heldout_loss(after, tok) < 0.75 * _heldout_loss(before, tok)


def test_base_model_is_cached_by_config(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILTAMER_CACHE", str(tmp_path))
    cfg = SFTConfig(steps=2, batch_size=2, warmup=1, habit_steps=2)
    logs = []
    first = ensure_base_model(cfg, log=logs.append)
    assert logs and (first / "model.safetensors").is_file()
    logs.clear()
    assert ensure_base_model(cfg, log=logs.append) == first and not logs
    other = ensure_base_model(SFTConfig(steps=2, batch_size=2, warmup=1, habit_steps=2, seed=1), log=logs.append)
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp dirs left
    # a model cached before the tokenizer became byte-level gets it, with the same ids
    from tokenizers import Tokenizer as HFTokenizer, decoders, models
    from transformers import AutoTokenizer

    from tailtamer.model.tokenizer import CHAR_ALPHABET, CHAR_SPECIALS

    old = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(CHAR_SPECIALS + CHAR_ALPHABET)}, merges=[],
                                 unk_token="<unk>"))
    old.decoder = decoders.Fuse()
    old.save(str(first / "tokenizer.json"))
    text = "12+3=15\nanswer: 15"
    assert AutoTokenizer.from_pretrained(first).encode(text) != load_tokenizer(first).encode(text)
    ensure_base_model(cfg, log=logs.append)
    assert AutoTokenizer.from_pretrained(first).encode(text) == load_tokenizer(first).encode(text) == \
        char_tokenizer().encode(text)


def test_a_stopped_base_model_training_goes_on_where_it_was(tmp_path, monkeypatch):
    """A Ctrl-C in the base model's training (8 minutes on 2 cores) lost all of it. Now it stops
    after the step with its state saved beside the model's directory, named by the config, and
    the same call goes on from there to the very weights of an uninterrupted run."""
    import os
    import signal

    from safetensors.torch import load_file

    import tailtamer.sft as sft
    from tailtamer.stopping import Interrupted

    cfg = SFTConfig(steps=5, batch_size=4, warmup=1, habit_steps=3)
    monkeypatch.setenv("TAILTAMER_CACHE", str(tmp_path / "straight"))
    straight = load_file(ensure_base_model(cfg, log=lambda _: None) / "model.safetensors")

    def same(model_dir):
        weights = load_file(model_dir / "model.safetensors")
        return weights.keys() == straight.keys() and all(torch.equal(weights[k], v) for k, v in straight.items())

    monkeypatch.setenv("TAILTAMER_CACHE", str(tmp_path / "stopped"))
    lr_at = sft.lr_at

    def ctrl_c_in_step(at):
        sent = []

        def lr(step, c):  # called once per parameter group: one Ctrl-C
            if step == at and not sent:
                sent.append(os.kill(os.getpid(), signal.SIGINT))  # as a terminal sends it, in the middle of the step
            return lr_at(step, c)
        return lr

    for at, message in ((2, "after step 3 of 8"), (6, "after step 7 of 8")):  # in each phase
        monkeypatch.setattr(sft, "lr_at", ctrl_c_in_step(at))
        logs = []
        with pytest.raises(Interrupted, match=rf"^stopped by Ctrl-C {message} of the base model's training; saved "
                                              rf"in .*\.partial-{cfg.key()}\.pt: the same command goes on from there$"):
            ensure_base_model(cfg, log=logs.append)
        assert "Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)" in logs
    monkeypatch.setattr(sft, "lr_at", lr_at)
    logs = []
    resumed = ensure_base_model(cfg, log=logs.append)
    assert any(line.startswith("going on from step 7, saved in ") for line in logs), logs
    assert same(resumed)
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir()) == [resumed.name]  # the state is gone
    # another config's state beside the same output is neither read nor replaced
    other = SFTConfig(steps=5, batch_size=4, warmup=1, habit_steps=3, seed=1)
    monkeypatch.setattr(sft, "lr_at", ctrl_c_in_step(2))
    with pytest.raises(Interrupted):
        sft.write_base_model(other, tmp_path / "m", log=lambda _: None)
    monkeypatch.setattr(sft, "lr_at", lr_at)
    theirs = sft.training_state(tmp_path / "m", other).path
    before = theirs.read_bytes()
    logs = []
    sft.write_base_model(cfg, tmp_path / "m", log=logs.append)
    assert same(tmp_path / "m") and not any("going on" in line for line in logs) and theirs.read_bytes() == before
    # a damaged state is said, and training starts over
    mine = sft.training_state(tmp_path / "d", cfg).path
    mine.write_bytes(b"damaged")
    logs = []
    sft.write_base_model(cfg, tmp_path / "d", log=logs.append)
    assert any(line.startswith(f"{mine}: cannot go on from it (") for line in logs), logs
    assert same(tmp_path / "d") and not mine.exists()


def test_a_trained_base_model_that_cannot_be_moved_into_place_is_kept(tmp_path, monkeypatch):
    """The last rename failing (another process filled --out meanwhile; a full disk) was a
    traceback, and the trained model was gone. It is now one line, and the finished training's
    state stays, from which the same call writes the model."""
    import errno

    import tailtamer.atomic as atomic
    import tailtamer.sft as sft
    from tailtamer.errors import WriteError

    cfg = SFTConfig(steps=3, batch_size=4, warmup=1, habit_steps=1)
    rename = atomic.os.rename

    def filled(src, dst):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", dst)

    monkeypatch.setattr(atomic.os, "rename", filled)
    state = sft.training_state(tmp_path / "m", cfg).path
    with pytest.raises(WriteError, match=rf"^cannot write the base model into {tmp_path / 'm'} \(Directory not "
                                         rf"empty\); the training's state is kept in {state}: the same command"):
        sft.write_base_model(cfg, tmp_path / "m", log=lambda _: None)
    monkeypatch.setattr(atomic.os, "rename", rename)
    logs = []
    sft.write_base_model(cfg, tmp_path / "m", log=logs.append)
    assert any(line.startswith("going on from step 4, saved in ") for line in logs), logs
    assert (tmp_path / "m" / "model.safetensors").is_file() and not state.exists()


@pytest.mark.parametrize("kwargs,field", [({"steps": 0}, "steps"), ({"batch_size": 0}, "batch_size"),
                                          ({"lr": 0.0}, "lr"), ({"habit_steps": -1}, "habit_steps"),
                                          ({"direct_answer_prob": 1.5}, "direct_answer_prob")])
def test_bad_sft_config(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SFTConfig(**kwargs)


@pytest.mark.slow
def test_default_base_model_has_a_habit_and_long_tailed_samples():
    """The built-in base model (trained here if not cached, ~8 min): RL needs it to be right
    sometimes and wrong sometimes, for a reason it can learn (answering without the working
    loses to working it out), and its own samples must show the long tail."""
    from tailtamer.demo import evaluate
    from tailtamer.tasks.arithmetic import length_stats

    _, completions, rewards, _ = evaluate(ensure_base_model(SFTConfig()), n_prompts=48, n=8, seed=0)
    assert 0.05 <= sum(rewards) / len(rewards) <= 0.8
    direct = [c.text.startswith("answer:") for c in completions]
    assert 0.3 <= sum(direct) / len(direct) <= 0.9
    worked = [r for r, d in zip(rewards, direct) if not d]
    guessed = [r for r, d in zip(rewards, direct) if d]
    assert sum(worked) / len(worked) > sum(guessed) / len(guessed) + 0.2
    lengths = length_stats([len(c.token_ids) for c in completions])
    assert lengths["max"] / lengths["p50"] >= 6
    # Sibling samples of one prompt differ in length, not only prompts from each other.
    by_prompt = {}
    for c in completions:
        by_prompt.setdefault(c.prompt_index, set()).add(len(c.token_ids))
    assert sum(len(v) > 1 for v in by_prompt.values()) >= len(by_prompt) // 2

"""The RL step's options in short toy runs: KL against a reference, PPO epochs, the entropy
bonus, dynamic sampling, overlong masking and held-out evaluation, each checked by what it must
change or equal."""

from pathlib import Path

import pytest

from conftest import write_jsonl
from tailtamer.config import load_train_config
from tailtamer.rl.run_state import prepare, setup
from tailtamer.rl.trainer import train
from test_trainer import _rows

NO_SIGNAL = '''
def zero(response, answer):
    return 0.0
'''


@pytest.fixture
def no_signal(toy, tmp_path):
    """The toy run with a reward that is 0 for every sample: no group carries a signal."""
    reward = tmp_path / "zero_reward.py"
    reward.write_text(NO_SIGNAL)
    return toy + [f"rl.reward={reward}:zero"]


def _run(overrides, name):
    cfg = load_train_config(None, overrides + [f"run.name={name}", "run.save_every=0"])
    train(cfg, log=lambda _: None, console=lambda _: None)
    return _rows(Path(cfg.run.out_dir) / name)


def test_kl_reference_is_the_start_policy_and_only_loaded_when_used(toy):
    rows = _run(toy + ["rl.kl_coef=0.1", "rl.kl_estimator=k3", "rl.minibatches=1", "rl.lr=3e-3", "run.steps=3"], "kl")
    assert abs(rows[0]["kl"]) < 1e-6  # the first update starts from the reference itself
    assert rows[2]["kl"] > 1e-5  # then the policy moves away from it
    assert setup(prepare(load_train_config(None, toy))).ref_model is None
    assert _run(toy + ["run.steps=1"], "nokl")[0]["kl"] is None


def test_later_ppo_epochs_are_off_policy_and_clipped(toy):
    common = toy + ["rl.minibatches=1", "rl.lr=3e-2", "run.steps=3"]
    assert all(r["clip_frac"] == 0 for r in _run(common + ["rl.ppo_epochs=1"], "one"))  # ratio 1: on-policy
    assert max(r["clip_frac"] for r in _run(common + ["rl.ppo_epochs=4"], "four")) > 0


def test_entropy_bonus_alone_raises_entropy(no_signal):
    rows = _run(no_signal + ["rl.entropy_coef=1.0", "rl.lr=1e-2", "rl.minibatches=1", "run.steps=4"], "entropy")
    assert rows[-1]["entropy"] > rows[0]["entropy"] + 0.05, [r["entropy"] for r in rows]


def test_dynamic_sampling_skips_groups_whose_rewards_agree(no_signal, toy):
    rows = _run(no_signal + ["rl.dynamic_sampling=true", "run.steps=2", "rl.warmup=3", "rl.lr=0.3"], "dyn")
    assert all(r["kept_groups_frac"] == 0 and r["loss"] is None for r in rows)  # nothing to learn from
    # the schedule moves on all the same: it was sized in optimizer steps, taken or not
    assert [r["lr"] for r in rows] == pytest.approx([0.3 * 2 / 3, 0.3])
    rows = _run(no_signal + ["run.steps=1"], "nodyn")
    assert rows[0]["kept_groups_frac"] == 1 and rows[0]["loss"] == 0  # kept, with zero advantages
    assert rows[0]["zero_adv_frac"] == 1
    rows = _run(toy + ["rl.dynamic_sampling=true", "run.steps=2"], "dyn-toy")
    assert all(0 < r["kept_groups_frac"] <= 1 for r in rows)
    assert all(r["zero_adv_frac"] == pytest.approx(1 - r["kept_groups_frac"]) for r in rows)


def test_overlong_mask_drops_truncated_responses_from_the_loss(toy):
    rows = _run(toy + ["rl.overlong=mask", "run.steps=2"], "mask")
    for r in rows:
        assert r["truncated_frac"] > 0
        assert r["kept_groups_frac"] == pytest.approx(1 - r["truncated_frac"])



def test_held_out_evaluation_is_greedy_accuracy_of_the_checkpointed_policy(toy, tmp_path):
    from tailtamer.model.io import load_model
    from tailtamer.model.tokenizer import load_tokenizer
    from tailtamer.rl.checkpoint import latest_checkpoint
    from tailtamer.rl.rewards import resolve_reward
    from tailtamer.rollout.engine import Engine
    from tailtamer.rollout.sampling import SamplingParams

    prompts = ["ab", "cd", "ef", "gh", "ij", "kl", "mn"]
    held_out = tmp_path / "held_out.jsonl"
    write_jsonl(held_out, [{"prompt": p, "answer": "0"} for p in prompts])
    overrides = toy + [f"data.eval={held_out}", "run.eval_every=2", "run.steps=2", "rl.lr=3e-3"]
    cfg = load_train_config(None, overrides)
    rows = _run(overrides, "eval")
    assert "eval_accuracy" not in rows[0]
    checkpoint = latest_checkpoint(Path(cfg.run.out_dir) / "eval")  # the policy after step 2
    tok = load_tokenizer(checkpoint)
    completions, _ = Engine(load_model(checkpoint), tok).generate(
        [tok.encode(p) for p in prompts], SamplingParams(temperature=0, max_new_tokens=cfg.rollout.max_new_tokens))
    reward = resolve_reward(cfg.rl.reward[0])
    expected = sum(reward(c.text, "0") for c in completions) / len(prompts)
    print(f"held-out greedy accuracy {expected:.3f}")
    assert rows[1]["eval_accuracy"] == pytest.approx(expected)


def test_gspo_equals_ppo_on_policy_and_clips_whole_sequences_off_policy(toy):
    """On the first pass the ratio is 1 for both losses, so GSPO's first step equals PPO-clip's;
    in later PPO epochs GSPO clips whole responses (a clipped fraction of whole sequences at
    its tight default-like bounds), where PPO-clip's fraction is per token."""
    common = toy + ["rl.minibatches=1", "rl.lr=3e-2", "run.steps=1"]
    ppo = _run(common, "ppo")
    gspo = _run(common + ["rl.policy_loss=gspo"], "gspo")
    assert gspo[0]["loss"] == pytest.approx(ppo[0]["loss"], rel=1e-5) and gspo[0]["clip_frac"] == 0
    rows = _run(common + ["rl.policy_loss=gspo", "rl.ppo_epochs=3", "rl.clip_low=3e-4", "rl.clip_high=4e-4"], "gspo3")
    assert rows[0]["clip_frac"] > 0


def test_unknown_policy_loss_is_a_start_up_error(toy):
    from tailtamer.errors import ConfigError

    with pytest.raises(ConfigError, match="rl.policy_loss 'ppo' is unknown"):
        load_train_config(None, toy + ["rl.policy_loss=ppo"])

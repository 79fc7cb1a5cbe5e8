"""Rewards: built-in, user functions, and failures that score 0 without stopping the run."""

import importlib.util
import time

import pytest

from tailtamer.errors import ConfigError
from tailtamer.rl.rewards import RewardScorer, resolve_reward

USER = '''
import time
def exact(response, answer):
    return float(response.strip() == answer)
def boom(response, answer):
    raise RuntimeError("bad reward")
def slow(response, answer):
    time.sleep(30)
    return 1.0
def nan(response, answer):
    return float("nan")
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER)
    return path


def test_builtin_reward():
    fn = resolve_reward("builtin")
    assert fn("1+2=3\nanswer: 3", "3") == 1.0 and fn("answer: 4", "3") == 0.0


def test_user_reward_from_a_file(user_file):
    fn = resolve_reward(f"{user_file}:exact")
    assert fn(" 12 ", "12") == 1.0 and fn("13", "12") == 0.0


def test_user_reward_from_a_module():
    fn = resolve_reward("tailtamer.tasks.arithmetic:reward")
    assert fn("answer: 5", "5") == 1.0


@pytest.mark.parametrize("name,counter", [("boom", "reward_errors"), ("nan", "reward_errors"), ("slow", "reward_timeouts")])
def test_failing_rewards_score_zero_and_are_counted(user_file, name, counter):
    scorer = RewardScorer(resolve_reward(f"{user_file}:{name}"), timeout_s=0.2)
    t0 = time.perf_counter()
    assert scorer.score("x", "y") == 0.0
    assert scorer.score("x", "y") == 0.0
    assert time.perf_counter() - t0 < 5
    assert scorer.counts()[counter] == 2
    assert scorer.last_error


@pytest.mark.parametrize("spec,message", [
    ("nonexistent_module_xyz:f", "cannot import nonexistent_module_xyz"),
    ("tailtamer.tasks.arithmetic:nope", "has no function 'nope'"),
    ("no_colon", "expected builtin, math, module:function"),
    ("/does/not/exist.py:f", "not found"),
])
def test_unloadable_rewards_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(spec)


def test_reward_module_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_real_package_abc\n")
    with pytest.raises(ConfigError, match="ModuleNotFoundError"):
        resolve_reward(f"{path}:f")


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify not installed")
def test_math_reward():
    fn = resolve_reward("math")
    assert fn("so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert fn("\\boxed{3}", "4") == 0.0

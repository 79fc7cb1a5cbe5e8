"""The built-in task: correct traces, the reward, and long-tailed lengths."""

import random
import re

import pytest

from tailtamer.errors import ConfigError
from tailtamer.tasks.arithmetic import ArithmeticTask, extract_answer, length_stats, reward


def _solve(prompt: str) -> int:
    """Independent evaluation of a prompt such as '47+8-3=?'."""
    expr = prompt.strip().removesuffix("=?")
    value, *ops = re.findall(r"[+-]?\d+", expr)
    return int(value) + sum(int(op) for op in ops)


def test_traces_are_correct_and_consistent():
    for p in ArithmeticTask().dataset(500, seed=0):
        assert int(p["answer"]) == _solve(p["prompt"])
        assert reward(p["trace"], p["answer"]) == 1.0
        for line in p["trace"].splitlines()[:-1]:
            a, sign, d, new = re.fullmatch(r"(?:check )?(\d+)([+-])(\d)=(\d+)(?: ok)?", line).groups()
            assert int(new) == int(a) + (int(d) if sign == "+" else -int(d))
            assert 0 <= int(new) <= 99


def test_reward_reads_the_last_answer_line():
    assert reward("12+3=15\nanswer: 15", "15") == 1.0
    assert reward("answer: 14\nanswer: 15", "15") == 1.0
    assert reward("answer: 15\nanswer: 14", "15") == 0.0
    assert reward("12+3=15", "15") == 0.0
    assert reward("answer:15", " 15 ") == 1.0
    assert extract_answer("nothing here") is None


def test_lengths_are_long_tailed_across_and_within_prompts():
    task = ArithmeticTask()
    problems = task.dataset(2000, seed=1)
    stats = length_stats([len(p["trace"]) + 1 for p in problems])
    assert stats["max"] / stats["p50"] >= 6
    assert stats["p90"] >= 3 * stats["p50"]
    # One prompt has correct responses of many lengths (random self-checks).
    ops = ["+3", "-5", "+9", "-1", "+2", "+4"]
    traces = [task.write_trace(40, ops, random.Random(seed)) for seed in range(50)]
    assert len({len(t) for t in traces}) >= 3
    assert all(reward(t, str(40 + 3 - 5 + 9 - 1 + 2 + 4)) == 1.0 for t in traces)


def test_dataset_is_reproducible_from_the_seed():
    task = ArithmeticTask()
    assert task.dataset(20, seed=5) == task.dataset(20, seed=5)
    assert task.dataset(20, seed=5) != task.dataset(20, seed=6)


def test_length_stats():
    s = length_stats([10, 10, 20, 80])
    assert s["p50"] == 15 and s["max"] == 80 and s["max_over_p50"] == pytest.approx(80 / 15)


@pytest.mark.parametrize("kwargs,field", [({"min_ops": 0}, "min_ops"), ({"max_ops": 0}, "min_ops"),
                                          ({"check_prob": 1.0}, "check_prob"), ({"max_value": 5}, "max_value")])
def test_bad_task_config(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ArithmeticTask(**kwargs)


def test_num_ops_counts_the_operations_of_a_prompt():
    task = ArithmeticTask()
    for p in task.dataset(200, seed=4):
        steps = [line for line in p["trace"].splitlines() if not line.startswith(("check", "answer"))]
        assert ArithmeticTask.num_ops(p["prompt"]) == len(steps)


def test_accuracy_breakdown_by_length_and_by_working():
    from types import SimpleNamespace

    from tailtamer.demo import accuracy_breakdown

    problems = [{"prompt": "10+1=?\n"}, {"prompt": "10+1-2=?\n"}, {"prompt": "10" + "+1" * 9 + "=?\n"}]
    done = [(0, "answer: 11", 1.0), (0, "10+1=11\nanswer: 11", 1.0), (1, "answer: 3", 0.0),
            (1, "10+1=11\n11-2=9\nanswer: 9", 1.0), (2, "answer: 5", 0.0)]
    completions = [SimpleNamespace(prompt_index=i, text=t) for i, t, _ in done]
    got = accuracy_breakdown(problems, completions, [r for _, _, r in done])
    assert got == {"direct answer": [1 / 3, 3], "worked": [1.0, 2], "ops 1": [1.0, 2], "ops 2-3": [0.5, 2],
                   "ops 8+": [0.0, 1]}

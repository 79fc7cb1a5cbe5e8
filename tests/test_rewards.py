"""Rewards: built-in, user functions, and failures that score 0 without stopping the run."""

import functools
import importlib.util
import json
import sys
import time

import pytest

from tailtamer.config import load_train_config
from tailtamer.errors import ConfigError
from tailtamer.rl.rewards import RewardScorer, resolve_reward

USER = '''
import os, signal, sys, time
def exact(response, answer):
    return float(response.strip() == answer)
def boom(response, answer):
    raise RuntimeError("bad reward")
def slow(response, answer):
    time.sleep(30)
    return 1.0
def nan(response, answer):
    return float("nan")
def text(response, answer):
    return "0.5"
def exits(response, answer):
    os._exit(3)
def kills(response, answer):
    os.kill(os.getpid(), signal.SIGKILL)
def quits(response, answer):
    sys.exit(1)
def chatty(response, answer):
    print("a reward that prints")
    return 1
def sometimes(response, answer):
    if response == "die":
        os._exit(1)
    if response == "hang":
        time.sleep(30)
    return float(response == answer)
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


@pytest.mark.parametrize("name,kind", [("boom", "RuntimeError"), ("nan", "not a number"), ("text", "not a number"),
                                       ("slow", "timeout"), ("exits", "process died"), ("kills", "process died"),
                                       ("quits", "SystemExit")])
def test_failing_rewards_score_zero_and_are_counted(user_file, name, kind):
    """Whatever a reward does (raise, return garbage, hang, kill its own process), the sample
    scores 0, the failure is counted by kind with its first message, and scoring goes on."""
    scorer = RewardScorer(f"{user_file}:{name}", timeout_s=0.5)
    t0 = time.perf_counter()
    assert scorer.score_batch([("x", "y"), ("x", "y")]) == [(0.0, False), (0.0, False)]
    assert time.perf_counter() - t0 < 10
    assert scorer.failures[kind]["count"] == 2 and scorer.failures[kind]["first"]
    counter = "reward_timeouts" if kind == "timeout" else "reward_errors"
    assert scorer.counts()[counter] == 2
    scorer.close()


def test_a_reward_that_never_answers_fails_its_batch_without_waiting_out_every_call(user_file):
    """Each call waited out the timeout in a fresh process: 128 samples at 5 s took over 10
    minutes before the step's "every reward failed" stop."""
    scorer = RewardScorer(f"{user_file}:slow", timeout_s=0.3)
    t0 = time.perf_counter()
    assert scorer.score_batch([("x", "y")] * 40) == [(0.0, False)] * 40
    assert time.perf_counter() - t0 < 10  # 3 timeouts, not 40
    assert scorer.counts()["reward_timeouts"] == 40
    assert scorer.failures["timeout"]["first"] == "a call took longer than rl.reward_timeout_s=0.3"
    scorer.close()
    # one that has answered once is waited for call by call, as before
    scorer = RewardScorer(f"{user_file}:sometimes", timeout_s=0.3)
    got = scorer.score_batch([("a", "a"), ("hang", "a"), ("hang", "a"), ("hang", "a"), ("hang", "a"), ("b", "b")])
    assert got == [(1.0, True)] + [(0.0, False)] * 4 + [(1.0, True)]
    scorer.close()


def test_a_crash_or_hang_is_charged_to_its_own_sample(user_file):
    scorer = RewardScorer(f"{user_file}:sometimes", timeout_s=0.5)
    got = scorer.score_batch([("a", "a"), ("die", "a"), ("b", "b"), ("hang", "a"), ("c", "d"), ("e", "e")])
    assert got == [(1.0, True), (0.0, False), (1.0, True), (0.0, False), (0.0, True), (1.0, True)]
    assert scorer.counts() == {"reward_errors": 1, "reward_timeouts": 1}


def test_a_reward_that_prints_does_not_break_scoring(user_file, capfd):
    scorer = RewardScorer(f"{user_file}:chatty")
    assert scorer.score_batch([("x", "y")] * 3) == [(1.0, True)] * 3
    assert "a reward that prints" in capfd.readouterr().err


def test_what_a_reward_prints_goes_to_its_output_file(user_file, tmp_path, capfd):
    """Appended, across the restart after a reward killed its process."""
    output = tmp_path / "reward.log"
    output.write_text("an earlier run\n")
    scorer = RewardScorer((f"{user_file}:chatty", f"{user_file}:sometimes"), timeout_s=0.5, output=output)
    got = scorer.score_batch([("x", "x"), ("die", "x"), ("y", "y")])
    scorer.close()
    assert got == [(2.0, True), (1.0, False), (2.0, True)]
    assert output.read_text() == "an earlier run\n" + "a reward that prints\n" * 3
    assert "a reward that prints" not in capfd.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify not installed")
def test_the_math_reward_works_inside_the_scorer():
    """math-verify times itself out with signal.alarm, which only works in a main thread: run
    in a thread, every math reward silently scored 0."""
    scorer = RewardScorer("math")
    assert scorer.score_batch([(r"so \boxed{72}", "72"), (r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{7}", "72")]) \
        == [(1.0, True), (1.0, True), (0.0, True)]
    assert scorer.failures == {}


@pytest.mark.parametrize("spec,message", [
    ("nonexistent_module_xyz:f", "cannot import nonexistent_module_xyz"),
    ("tailtamer.tasks.arithmetic:nope", "has no function 'nope'"),
    ("no_colon", "expected auto, builtin, math, module:function"),
    ("/does/not/exist.py:f", "not found"),
])
def test_unloadable_rewards_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(spec)
    with pytest.raises(ConfigError, match=message):  # found at start-up, in the reward's own process
        RewardScorer(spec)


def test_a_reward_file_imports_its_neighbours(tmp_path, monkeypatch):
    """Reward code split over files: `rmain.py` imports `rhelper.py` from its own directory,
    in this process and in the scorer's."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "rewards_dir"
    folder.mkdir()
    (folder / "rhelper.py").write_text("def score(response, answer):\n    return float(response == answer)\n")
    (folder / "rmain.py").write_text("from rhelper import score\ndef f(response, answer):\n"
                                     "    return score(response, answer)\n")
    assert resolve_reward(f"{folder / 'rmain.py'}:f")("7", "7") == 1.0
    scorer = RewardScorer(f"{folder / 'rmain.py'}:f")
    assert scorer.score_batch([("7", "7"), ("7", "8")]) == [(1.0, True), (0.0, True)]
    scorer.close()


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


VERL_REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return {"score": float(solution_str.startswith("a")), "acc": 1.0}
'''


def test_verl_compute_score_gets_the_rows_fields_intact(model_dir, tmp_path, monkeypatch):
    """A verl-style parquet (prompt as chat messages, reward_model.ground_truth, data_source,
    extra_info) and verl's compute_score file train unchanged."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from tailtamer.rl.trainer import train

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"split": "train", "index": i}}
            for i in range(4)]
    data = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("SEEN_FILE", str(seen))
    cfg = load_train_config(None, [f"run.model={model_dir}", f"data.train={data}", f"run.out_dir={tmp_path}",
                                   f"rl.reward={tmp_path / 'verl_reward.py'}:compute_score", "run.steps=2",
                                   "run.eval_every=0", "spec.mode=off", "rollout.prompts_per_step=4",
                                   "rollout.group_size=2", "rollout.max_new_tokens=3"])
    summary = train(cfg, log=lambda _: None, console=lambda _: None)
    assert summary["reward_errors"] == 0
    calls = [json.loads(x) for x in seen.read_text().splitlines()]
    assert len(calls) == 2 * 4 * 2  # steps x prompts x samples
    for call in calls:
        i = int(call["ground_truth"])
        assert call["data_source"] == "openai/gsm8k" and call["extra_info"] == {"split": "train", "index": i}


def test_a_reward_with_another_signature_is_a_start_up_error(tmp_path):
    (tmp_path / "bad.py").write_text("def score(a, b, c):\n    return 1.0\n"
                                     "def compute_score(data_source, solution_str, ground_truth, extra_info, url):\n"
                                     "    return 1.0\n")
    with pytest.raises(ConfigError, match=r"takes neither form; accepted: fn\(response, answer\), or verl's"):
        RewardScorer(f"{tmp_path / 'bad.py'}:score")
    with pytest.raises(ConfigError, match=r"needs arguments tailtamer does not have; accepted: fn\(response"):
        RewardScorer(f"{tmp_path / 'bad.py'}:compute_score")


def test_a_reward_naming_response_and_answer_gets_each_by_name():
    """`fn(answer, response)` must not get the response as its answer; other names go in order."""
    from tailtamer.rl.rewards import reward_caller

    def swapped(answer, response):
        return float(response == "r" and answer == "a")

    def plain(x, y):
        return float(x == "r" and y == "a")

    def positional_only(answer, response, /):  # names that cannot be passed by name: in order
        return float(answer == "r" and response == "a")

    def decorated(response, answer):
        return float(response == "r" and answer == "a")

    @functools.wraps(decorated)  # the signature shown is `decorated`'s; the wrapper takes no keywords
    def wrapper(*args):
        return decorated(*args)

    def keyword_only(*, answer, response):  # as the docs promise: by name, whatever the order
        return float(response == "r" and answer == "a")

    for fn in (swapped, plain, positional_only, wrapper, keyword_only):
        assert reward_caller(fn, fn.__name__)("r", "a", {}) == 1.0, fn.__name__


def test_a_reward_that_is_no_function_is_named_for_what_it_is(tmp_path):
    (tmp_path / "r.py").write_text("score = 5\n")
    with pytest.raises(ConfigError, match=r"r.py's 'score' is a int, not a function$"):
        RewardScorer(f"{tmp_path / 'r.py'}:score")
    with pytest.raises(ConfigError, match=r"r.py:': no function name after ':'"):
        RewardScorer(f"{tmp_path / 'r.py'}:")
    (tmp_path / "c.py").write_text("class Scorer:\n    def __call__(self, response, answer):\n        return 1.0\n"
                                   "scorer = Scorer()\n")
    with pytest.raises(ConfigError, match=r"c.py's 'Scorer' is a class, not a function; name a function, or an "
                                          r"instance with a __call__ method$"):
        RewardScorer(f"{tmp_path / 'c.py'}:Scorer")
    instance = RewardScorer(f"{tmp_path / 'c.py'}:scorer")  # an instance is called as a function
    try:
        assert instance.score("r", "a") == 1.0 and not instance.failures
    finally:
        instance.close()
    with pytest.raises(ConfigError, match=r"^rl.reward: .*r.py: has nothing after ':'"):  # YAML reads `x.py:` as a map
        load_train_config(None, [f"rl.reward={tmp_path / 'r.py'}:"])


@pytest.mark.parametrize("weight", ["1e300", "-1e13"])
def test_a_reward_weight_that_would_overflow_is_refused(weight):
    """1e300 ran, every reward inf and every update skipped, and the run said it finished."""
    with pytest.raises(ConfigError, match=r"rl.reward_weights: .* is beyond \+-1e\+12"):
        load_train_config(None, ["rl.reward=[math,math]", f"rl.reward_weights=[1,{weight}]"])
    load_train_config(None, ["rl.reward=[math,math]", "rl.reward_weights=[1,-1e12]"])


def test_a_dict_reward_needs_a_score():
    from tailtamer.rl.rewards import NotANumber, check_reward_value

    assert check_reward_value({"score": 0.5, "acc": 1}) == 0.5
    with pytest.raises(NotANumber, match="without 'score'"):
        check_reward_value({"acc": 1.0})


def test_a_reward_too_large_for_the_advantages_is_refused():
    """1e308 is finite in Python but inf once the step's rewards are float32; at the bound every
    advantage estimator stays finite."""
    import torch

    from tailtamer.rl.grpo import ADVANTAGES
    from tailtamer.rl.rewards import MAX_REWARD, NotANumber, check_reward_value

    for big in (1e308, -1e20):
        with pytest.raises(NotANumber, match=r"beyond ±1e\+18"):
            check_reward_value(big)
    assert check_reward_value(MAX_REWARD) == MAX_REWARD
    group = torch.tensor([[MAX_REWARD, -MAX_REWARD, 0.0, 1.0] * 4])
    assert all(torch.isfinite(f(group)).all() for f in ADVANTAGES.values())


def test_several_weighted_rewards_sum_and_fail_on_their_own(user_file):
    scorer = RewardScorer((f"{user_file}:exact", f"{user_file}:boom", "builtin"), timeout_s=2, weights=(2.0, 1.0, 0.5))
    items = [("7", "7"), ("answer: 3", "3"), ("x", "y")]
    calls = scorer.score_calls(items)
    exact, builtin = resolve_reward(f"{user_file}:exact"), resolve_reward("builtin")
    for (response, answer), parts in zip(items, calls):
        assert parts == [(exact(response, answer), True), (0.0, False), (builtin(response, answer), True)]
    assert scorer.failures["RuntimeError"]["count"] == 3  # one per item, charged to boom alone
    assert scorer.score_batch(items) == [(2.0 * exact(r, a) + 0.5 * builtin(r, a), False) for r, a in items]
    assert scorer.names == ["exact", "boom", "builtin"]
    assert scorer.failures["RuntimeError"]["first"] == "boom: RuntimeError: bad reward"
    with pytest.raises(ConfigError, match=r"rl.reward_weights: 1 weights for 2 reward functions"):
        RewardScorer(("builtin", "builtin"), weights=(1.0,))


def test_auto_routes_each_row_by_its_data_source(tmp_path):
    from tailtamer.rl.rewards import auto_reward, check_routes, math_reward, route

    assert [route(s) for s in (None, "openai/gsm8k", "lighteval/MATH", "math_dapo", "AIME2024", "tailtamer/arithmetic",
                               "my/chess", "aftermath_news", "camcorder_reviews", 3)] == \
        ["builtin", "math", "math", "math", "math", "builtin", None, None, None, None]
    assert auto_reward("openai/gsm8k", r"so \boxed{0.5}", "1/2") == math_reward(r"so \boxed{0.5}", "1/2") == 1.0
    assert auto_reward(None, "answer: 1/2", "1/2") == resolve_reward("builtin")("answer: 1/2", "1/2")
    rows = [{"context": {"data_source": "openai/gsm8k"}, "_row": 1}, {"_row": 2},
            {"context": {"data_source": "my/chess"}, "_row": 3}]
    assert check_routes(rows[:2], "d.jsonl") == {"math", "builtin"}
    with pytest.raises(ConfigError, match=r"d.jsonl:3: data_source 'my/chess' has no built-in scorer .*rl.reward=math"):
        check_routes(rows, "d.jsonl")


def test_the_default_reward_routes_a_gsm8k_file_to_math_and_logs_each_function(model_dir, tmp_path):
    """No rl.reward given: rows of data_source openai/gsm8k are scored by math-verify; with two
    reward functions, each one's mean is logged and the reward is their weighted sum."""
    from tailtamer.rl.rewards import math_reward
    from tailtamer.rl.trainer import train

    rows = [{"data_source": "openai/gsm8k", "prompt": f"{i}", "answer": "1"} for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "r.py").write_text("def long(response, answer):\n    return float(len(response) > 1)\n")
    base = [f"run.model={model_dir}", f"data.train={data}", f"run.out_dir={tmp_path}", "run.steps=1",
            "run.eval_every=0", "spec.mode=off", "rollout.prompts_per_step=4", "rollout.group_size=2",
            "rollout.max_new_tokens=3", "run.log_samples_every=1"]
    train(load_train_config(None, base + ["run.name=auto"]), log=lambda _: None, console=lambda _: None)
    for x in (json.loads(line) for line in (tmp_path / "auto" / "samples.jsonl").read_text().splitlines()):
        assert x["reward"] == math_reward(x["response"], "1")
    train(load_train_config(None, base + ["run.name=two", f"rl.reward=[auto, {tmp_path / 'r.py'}:long]",
                                          "rl.reward_weights=[1, 0.5]"]), log=lambda _: None, console=lambda _: None)
    row = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
    assert row["reward_mean"] == pytest.approx(row["reward_fn/auto"] + 0.5 * row["reward_fn/long"])
    assert row["accuracy"] == row["reward_fn/auto"]  # the first function, unweighted
    for x in (json.loads(line) for line in (tmp_path / "two" / "samples.jsonl").read_text().splitlines()):
        assert x["reward"] == pytest.approx(math_reward(x["response"], "1") + 0.5 * (len(x["response"]) > 1))
    chess = tmp_path / "chess.jsonl"
    chess.write_text(json.dumps({"data_source": "my/chess", "prompt": "e4", "answer": "e5"}) + "\n")
    with pytest.raises(ConfigError, match=r"chess.jsonl:1: data_source 'my/chess' has no built-in scorer"):
        train(load_train_config(None, base + ["run.name=chess", f"data.train={chess}", "rollout.prompts_per_step=1"]),
              log=lambda _: None)
    assert not (tmp_path / "chess").exists()

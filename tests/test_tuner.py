"""BEG-MAB strategy selection: grouping, bucketing, the sliding window, the confidence bonus,
exploration, the no-SD arm; and the adaptive engine that uses it."""

import math
import random
import statistics

import pytest
import torch

from tailtamer.errors import ConfigError
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.speculator import GPU_BS_THRESHOLD, SpecConfig, Speculator, make_speculator
from tailtamer.rollout.tuner import (MIN_SPREAD, NO_SD, PRIOR_SPREAD, BEGTuner, FixedTuner, bucket_of, choose,
                                     group_by_verify, log_spread, optimistic_score)

S = Strategy.parse


def test_groups_are_by_tokens_to_verify_largest_first():
    groups = group_by_verify([S("2_1_3"), S("4_2_8"), S("1_2_3"), S("3_3_8")])
    assert [[s.name for s in g] for g in groups] == [["4_2_8", "3_3_8"], ["2_1_3", "1_2_3"]]


@pytest.mark.parametrize("bs,bucket", [(1, 0), (2, 0), (3, 1), (8, 1), (9, 2), (500, 2)])
def test_buckets(bs, bucket):
    assert bucket_of(bs, [1, 3, 9]) == bucket


def test_choose_exploits_and_explores():
    rng = random.Random(0)
    scores = {"a": 1.0, "b": 5.0, "c": 2.0}
    assert all(choose(list(scores), scores, 0.0, rng) == "b" for _ in range(50))
    picks = [choose(list(scores), scores, 1.0, rng) for _ in range(3000)]
    assert all(800 < picks.count(a) < 1200 for a in scores)
    assert choose(["only"], {"only": 0.0}, 1.0, rng) == "only"


def test_log_spread_is_the_scaled_median_absolute_deviation_of_log_rewards():
    def spread(arms):
        return log_spread([[math.log(r) for r in a] for a in arms], [statistics.median(a) for a in arms])

    # residuals ln(r / median of its arm): ±0.1 and 0 for one arm, ±0.3 and 0 for the other
    arms = [[10 * math.exp(0.1), 10.0, 10 * math.exp(-0.1)], [3 * math.exp(-0.3), 3.0, 3 * math.exp(0.3)]]
    assert spread(arms) == pytest.approx(1.4826 * 0.1)  # median of |0.1, 0, 0.1, 0.3, 0, 0.3|
    even = [[10 * math.exp(0.2), 10.0, 10 * math.exp(-0.2)], [5 * math.exp(0.2), 5.0, 5 * math.exp(-0.2)]]
    assert spread(even + [[7.0], [8.0]]) == pytest.approx(1.4826 * 0.2)  # one reward shows no spread
    assert spread([[5.0, 5.0], [1.0]]) == PRIOR_SPREAD  # fewer than 4 residuals
    assert spread([[5.0, 5.0 * math.exp(0.3), 5.0 * math.exp(-0.3)]]) == PRIOR_SPREAD
    assert spread([[5.0] * 4, [2.0] * 3]) == MIN_SPREAD  # a perfectly quiet class


def test_optimistic_score_shrinks_to_the_median_with_more_pulls():
    assert optimistic_score(math.nan, 0, 0.2, 1.0) == float("inf")
    assert optimistic_score(4.0, 3, 0.2, 0.0) == 4.0
    assert optimistic_score(4.0, 1, 0.2, 1.0) == pytest.approx(4.0 * math.exp(0.2))
    assert optimistic_score(4.0, 16, 0.2, 2.0) == pytest.approx(4.0 * math.exp(2 * 0.2 / 4))


def test_an_arm_unlucky_in_few_pulls_is_tried_again():
    """The lock-on a kept ε-greedy bandit showed: an arm's one slow pull (a cold start, a busy
    moment) against another arm's many. Its bonus puts it back in front; greedy on the median
    it would wait for ε."""
    def tuner(bonus):
        t = BEGTuner([S("2_1_3"), S("1_2_3")], [1], window=30, bonus=bonus)
        t.record(S("2_1_3"), 1, 1.0, 95.0)
        for reward in (100.0, 120.0, 80.0, 110.0, 90.0):  # σ of the class: 1.4826 · |ln 0.9| ≈ 0.16
            t.record(S("1_2_3"), 1, 1.0, reward)
        t.record(None, 1, 1.0, 50.0)
        return t

    assert tuner(1.0).select(1).name == "2_1_3"  # 95 · e^0.16 > 100 · e^(0.16 / √5)
    assert tuner(0.0).select(1).name == "1_2_3"


def test_the_bonus_scales_with_the_measured_spread():
    """One pull at 90 against five around 100: in a quiet class (σ at its floor, 0.05) it is
    not tried again (90 · e^0.05 < 100 · e^(0.05 / √5)); in a class whose rewards spread
    (σ = 1.4826 · 0.15 ≈ 0.22) it is (90 · e^0.22 > 100 · e^(0.22 / √5))."""
    def choice(spread):
        tuner = BEGTuner([S("2_1_3"), S("1_2_3")], [1], window=30)
        for e in (0, spread, -spread, spread, -spread):
            tuner.record(S("1_2_3"), 1, 1.0, 100.0 * math.exp(e))
        tuner.record(S("2_1_3"), 1, 1.0, 90.0)
        tuner.record(None, 1, 1.0, 50.0)
        return tuner.select(1).name

    assert choice(0.0) == "1_2_3"
    assert choice(0.15) == "2_1_3"


def _tuner(window=30):
    return BEGTuner([S("4_2_8"), S("3_3_8"), S("2_1_3"), S("1_2_3")], [1, 5], epsilon=0.0, window=window)


def test_each_arm_is_tried_once_then_the_best_median_wins():
    tuner = _tuner()
    speed = {"4_2_8": 300.0, "3_3_8": 500.0, NO_SD: 200.0}
    seen = []
    for _ in range(10):
        arm = tuner.select(2)
        name = arm.name if arm else NO_SD
        seen.append(name)
        tuner.record(arm, 2, 1.0, speed[name])
    assert seen[:3] == ["4_2_8", "3_3_8", NO_SD]  # unexplored arms score +inf, tried in list order
    assert seen[3:] == ["3_3_8"] * 7
    # Batch size 7 is in the other bucket, whose arms are the verify-3 group and plain decoding.
    assert {getattr(_tuner().select(7), "name", NO_SD) for _ in range(1)} <= {"2_1_3", "1_2_3", NO_SD}


def test_a_bucket_where_speculation_loses_falls_back_to_plain():
    tuner = _tuner()
    for _ in range(6):
        arm = tuner.select(8)
        tuner.record(arm, 8, 1.0, 100.0 if arm is None else 60.0)
    assert tuner.select(8) is None
    assert [c["best"] for c in tuner.summary()["buckets"][1]["classes"]] == [NO_SD]


def test_rewards_are_compared_within_a_batch_size_class():
    """tokens/s grows with the batch size whatever the arm: plain decoding's one pull at 64
    running must not outscore the SD arm's pulls at 5 running (each 1.5x plain at its own
    batch size), or the bucket [5, 64] decodes plain at every batch size."""
    tuner = _tuner()
    speed = lambda arm, bs: bs * 100.0 * (1.0 if arm is None else 1.5)  # noqa: E731 (tokens/s)
    picks = []
    for bs in [64, 64, 64] + [5] * 12:
        arm = tuner.select(bs)
        tuner.record(arm, bs, 1.0, speed(arm, bs))
        picks.append((bs, arm.name if arm else NO_SD))
    assert [a for bs, a in picks if bs == 5].count(NO_SD) == 1  # its one exploratory pull
    classes = tuner.summary()["buckets"][1]["classes"]
    assert [c["batch_sizes"] for c in classes] == [[5, 7], [64, 127]]
    assert all(c["best"] != NO_SD for c in classes)
    assert tuner.summary()["buckets"][1]["pulls"][NO_SD] == 2


def test_the_window_forgets_old_rewards():
    """An arm is judged by its rewards from the last `window` steps of its class: a drafter
    gone stale shows within the window, and an arm whose rewards all expired is tried again."""
    def start(window):
        tuner = _tuner(window)
        for arm, reward in [("4_2_8", 900.0), ("3_3_8", 500.0), (NO_SD, 100.0)]:
            tuner.record(S(arm) if arm != NO_SD else None, 1, 1.0, reward)
        return tuner

    tuner = start(window=6)
    assert tuner.select(1).name == "4_2_8"
    for _ in range(3):  # the drafter went stale: 4_2_8 is now slow, and its median shows it
        tuner.record(S("4_2_8"), 1, 1.0, 50.0)
    assert tuner.select(1).name == "3_3_8"

    tuner = start(window=4)
    for _ in range(3):
        tuner.record(S("4_2_8"), 1, 1.0, 850.0)
    assert tuner.scores(1)[NO_SD] < math.inf  # step 6: plain decoding's reward (step 3) still counts
    assert tuner.select(1).name == "3_3_8"  # but 3_3_8's only reward (step 2) expired: tried again
    tuner.record(S("3_3_8"), 1, 1.0, 500.0)
    assert tuner.select(1) is None  # step 7: plain decoding's (step 3) too
    tuner.record(None, 1, 1.0, 100.0)
    assert tuner.select(1).name == "4_2_8"  # then the best again
    assert tuner.summary()["buckets"][0]["classes"][0]["pulls"] == {"4_2_8": 4, "3_3_8": 2, NO_SD: 2}

    tuner = _tuner(window=5)
    for reward in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        tuner.record(S("4_2_8"), 1, 1.0, reward)
    assert tuner.summary()["buckets"][0]["classes"][0]["median_tokens_per_s"] == {"4_2_8": 4.0}  # of 2..6


def test_exploration_is_reproducible_from_the_seed():
    a = BEGTuner([S("4_2_8"), S("3_3_8")], [1], epsilon=0.5, seed=3)
    b = BEGTuner([S("4_2_8"), S("3_3_8")], [1], epsilon=0.5, seed=3)
    for t in (a, b):
        for arm in (S("4_2_8"), S("3_3_8"), None):
            t.record(arm, 1, 1.0, 10.0)
    assert [a.select(1) for _ in range(30)] == [b.select(1) for _ in range(30)]


@pytest.mark.parametrize("kwargs,message", [
    ({"bucket_thresholds": (1, 3)},
     "2 entries but the default arms form 3 groups by tokens to verify: give 3, or leave it unset"),
    ({"bucket_thresholds": (1, 3), "strategies": ("s4_1_5", "s2_1_3", "s1_1_2")},
     "2 entries but the strategies form 3 groups"),
    ({"bucket_thresholds": (2, 3, 9)}, "must start at 1"),
    ({"bucket_thresholds": (1, 9, 3)}, "increase strictly"),
    ({"strategies": ("4_2_8", "bad")}, "not DEPTH_TOPK_VERIFY"),
    ({"epsilon": 2.0}, "epsilon"),
    ({"bonus": -1.0}, "spec.bonus must be a number >= 0, got -1.0"),
    ({"bonus": float("nan")}, "spec.bonus must be a number >= 0"),
    ({"window": 3}, "spec.window must be more than the 3 arms of a bucket, got 3"),
    ({"tuner": "ucb"}, "tuner must be beg or fixed"),
    ({"strategies": ("6_1_7", "5_1_6", "4_1_5", "3_1_4", "2_1_3")},
     "form 5 groups by tokens to verify, more than the 4 default buckets: give spec.bucket_thresholds"),
    ({"bs_threshold": -1}, "spec.bs_threshold must be >= 0"),
])
def test_bad_adaptive_configs(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(mode="adaptive", drafter="suffix", **kwargs)


@pytest.mark.parametrize("arms,thresholds", [
    (None, [1, 3, 65, 256]),  # the default arms: widths 11, 8, 6, 5
    (("s8_1_9", "s4_1_5"), [1, 3]),
    (("4_1_5",), [1]),
    (("4_1_5", "2_1_3", "4_2_5"), [1, 3]),  # two widths: 5 (two arms) and 3
])
def test_unset_thresholds_take_as_many_defaults_as_the_arms_form_groups(arms, thresholds):
    drafter = "suffix" if arms and arms[0].startswith("s") else "some-drafter"
    tuner = SpecConfig(mode="adaptive", drafter=drafter, strategies=arms).make_tuner()
    assert tuner.thresholds == thresholds
    assert len(tuner.groups) == len(thresholds)
    own = tuple(range(1, len(thresholds) + 1))
    given = SpecConfig(mode="adaptive", drafter=drafter, strategies=arms, bucket_thresholds=own)
    assert given.make_tuner().thresholds == list(own)  # given ones are kept as given


def test_fixed_tuner_and_mode_on_use_the_strategy():
    assert SpecConfig(mode="on", drafter="suffix", strategy="s3_1_4").make_tuner().select(100) == S("s3_1_4")
    assert isinstance(SpecConfig(mode="adaptive", drafter="suffix", tuner="fixed").make_tuner(), FixedTuner)


@pytest.mark.parametrize("kwargs,said", [
    ({"mode": "adaptive"}, []),
    ({"mode": "adaptive", "strategies": ("4_1_5", "2_1_3")}, []),
    ({"mode": "on", "strategy": "7_1_8"}, []),
    ({"mode": "adaptive", "strategy": "7_1_8"},
     ["spec.strategy=7_1_8 is not read: spec.mode=adaptive with spec.tuner=beg drafts with spec.strategies, "
      "the bandit's arms"]),
    ({"mode": "adaptive", "tuner": "fixed", "strategy": "7_1_8", "strategies": ("4_1_5",)},
     ["spec.strategies=[4_1_5] is not read: spec.mode=adaptive with spec.tuner=fixed drafts with spec.strategy"]),
    ({"mode": "on", "strategies": ("4_1_5", "7_1_8")},
     ["spec.strategies=[4_1_5,7_1_8] is not read: spec.mode=on drafts with spec.strategy"]),
    ({"mode": "off", "strategy": "4_2_8", "strategies": ("4_1_5",)},
     ["spec.strategy=4_2_8 is not read: spec.mode=off decodes without speculation",
      "spec.strategies=[4_1_5] is not read: spec.mode=off decodes without speculation"]),
    ({"mode": "adaptive", "bs_threshold": 4}, []),
    ({"mode": "on", "bs_threshold": 4},  # it was dropped without a word, as spec.compile with mode=off
     ["spec.bs_threshold=4 is not read: it is spec.mode=adaptive's long-tail switch; spec.mode=on drafts with "
      "spec.strategy"]),
    ({"mode": "off", "compile": True}, ["spec.compile=true is not read: spec.mode=off decodes without speculation"]),
])
def test_a_strategy_setting_the_mode_does_not_read_is_said(kwargs, said):
    """Said, not refused: a run directory written when spec.strategy defaulted to 4_2_8 resumes."""
    assert SpecConfig(drafter="x", **kwargs).unread() == said


def test_what_the_config_filled_in_itself_is_not_said(toy):
    """On vLLM the config fills in both spec.strategy and spec.strategies (its chains) whatever
    the mode: neither is the user's, so neither is said; one the user set is."""
    from tailtamer.config import load_train_config
    from tailtamer.rl.run_state import say_unread

    for extra, said in (([], []), (["spec.strategy=2_1_3"], ["spec.strategy=2_1_3 is not read"])):
        cfg = load_train_config(None, toy + ["rollout.backend=vllm", "spec.mode=adaptive", "spec.drafter=x", *extra])
        assert cfg.spec.strategy is not None and cfg.spec.strategies is not None
        logs = []
        say_unread(cfg, logs.append)
        assert [line.split(":")[0] for line in logs] == said, logs


# --- the adaptive engine ---------------------------------------------------------------------

def test_adaptive_engine_speculates_only_in_the_tail_and_is_lossless():
    from conftest import random_model, tiny_config
    from tailtamer.model.drafter import init_drafter
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams
    from tailtamer.rollout.eagle import EagleProposer

    model = random_model(tiny_config()).double()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (int(k),), generator=gen).tolist() for k in torch.randint(1, 10, (6,), generator=gen)]
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=40, seed=8)
    plain, _ = Engine(model, config=EngineConfig(max_batch_size=12)).generate(prompts, params)
    tuner = BEGTuner([S("3_2_6"), S("2_3_6"), S("2_1_3"), S("1_2_3")], [1, 3], epsilon=0.2, window=10)
    engine = Engine(model, config=EngineConfig(max_batch_size=12), speculator=Speculator(
        EagleProposer(init_drafter(model, std=0.2)), tuner, bs_threshold=10))
    adaptive, stats = engine.generate(prompts, params)
    assert [c.token_ids for c in adaptive] == [c.token_ids for c in plain]
    arms = [(running, arm) for _, running, arm in stats.timeline]
    assert all(arm == "plain" for running, arm in arms if running > 10)
    assert any(arm != "plain" for running, arm in arms if running <= 10)
    summary = stats.summary()
    assert summary["plain_seconds"] > 0 and summary["sd_seconds"] > 0
    assert set(summary["by_strategy"]) <= {"3_2_6", "2_3_6", "2_1_3", "1_2_3"}
    pulls = sum(sum(b["pulls"].values()) for b in tuner.summary()["buckets"])
    assert pulls == sum(1 for running, _ in arms if running <= 10)


def test_the_long_tail_switch_is_unset_on_a_cpu_and_64_on_a_gpu_by_default():
    """Unset, spec.bs_threshold means every batch size on a CPU (where SD pays at every batch
    size: `bench rollout`) and GPU_BS_THRESHOLD elsewhere; a value given is kept everywhere."""
    from conftest import random_model, tiny_config
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams

    unset, given = SpecConfig(mode="adaptive", drafter="suffix"), SpecConfig(mode="adaptive", drafter="suffix", bs_threshold=7)
    assert (unset.threshold("cpu"), unset.threshold("cuda"), unset.threshold("mps")) == (None, GPU_BS_THRESHOLD, GPU_BS_THRESHOLD)
    assert given.threshold("cpu") == given.threshold("cuda") == 7
    assert SpecConfig(mode="adaptive", drafter="suffix", bs_threshold=0).threshold("cpu") == 0  # never: kept
    # a fixed strategy has no "no SD" arm to fall back on: it keeps the switch
    assert SpecConfig(mode="adaptive", drafter="suffix", tuner="fixed").threshold("cpu") == GPU_BS_THRESHOLD
    model = random_model(tiny_config()).double()
    assert make_speculator(unset, model).bs_threshold is None
    assert make_speculator(given, model).bs_threshold == 7
    assert make_speculator(SpecConfig(mode="on", drafter="suffix"), model).bs_threshold is None
    # unset on a CPU, the bandit is asked from the first step, above GPU_BS_THRESHOLD running, and
    # SD stays lossless
    prompts = [[5 + i % 50, 9, 7 + i % 40, 3] for i in range(GPU_BS_THRESHOLD // 2 + 1)]
    params, config = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=4), EngineConfig(max_batch_size=512)
    plain, _ = Engine(model, config=config, eos_ids=()).generate(prompts, params)
    engine = Engine(model, config=config, eos_ids=(), speculator=make_speculator(unset, model))
    adaptive, stats = engine.generate(prompts, params)
    assert [c.token_ids for c in adaptive] == [c.token_ids for c in plain]
    running, arm = stats.timeline[0][1:]
    assert running == 2 * len(prompts) > GPU_BS_THRESHOLD and arm != "plain"  # an arm never pulled comes first


def test_timeline_plot(tmp_path):
    from tailtamer.plots import plot_rollout_timeline, timeline_segments

    timeline = [(0.1, 8, "plain"), (0.2, 6, "plain"), (0.25, 3, "4_2_8"), (0.3, 2, "4_2_8"), (0.32, 1, "2_1_3")]
    assert timeline_segments(timeline) == [(0.0, 0.2, "plain"), (0.2, 0.3, "4_2_8"), (0.3, 0.32, "2_1_3")]
    path = plot_rollout_timeline(timeline, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_switch_to_sd_is_charged_to_no_arm(monkeypatch):
    """At the switch the drafter catches up on every token the plain phase decoded. On a clock
    where only forwards take time (the target 1 per call, the drafter 0.05 per token per row),
    that catch-up would make the first SD pull of each rollout look slower than plain decoding
    and the bandit would settle on plain; charged to no arm, SD (accept length ~2.4 here) wins."""
    from types import SimpleNamespace

    import tailtamer.rollout.engine as engine_module
    from tailtamer.drafter.train import DrafterTrainConfig, train_drafter
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams
    from tailtamer.rollout.eagle import EagleProposer
    from test_spot import _bigram_target

    model = _bigram_target()
    prompts = torch.randint(3, 90, (8, 5), generator=torch.Generator().manual_seed(0)).tolist()
    own, _ = Engine(model, None, EngineConfig(max_batch_size=64), eos_ids=(1,)).generate(
        prompts, SamplingParams(temperature=1.0, n=8, max_new_tokens=40, seed=9))
    drafter, _ = train_drafter(model, [prompts[c.prompt_index] + c.token_ids for c in own],
                               DrafterTrainConfig(steps=150, batch_size=16, lr=3e-3), log=lambda _: None)
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def costs(forward, per_token):
        def timed(ids, *args, **kwargs):
            clock[0] += per_token * ids.shape[1] if per_token else 1.0
            return forward(ids, *args, **kwargs)
        return timed

    monkeypatch.setattr(model, "decode", costs(model.decode, 0))
    monkeypatch.setattr(drafter, "decode", costs(drafter.decode, 0.05))
    tuner = BEGTuner([S("4_1_5")], [1], epsilon=0.0, window=30)
    engine = Engine(model, None, EngineConfig(max_batch_size=2), eos_ids=(1,),
                    speculator=Speculator(EagleProposer(drafter), tuner, bs_threshold=1))
    catch_up = 0.0
    for i, prompt in enumerate(prompts):  # each rollout: two samples, SD once one of them is done
        _, stats = engine.generate([prompt], SamplingParams(temperature=1.0, n=2, max_new_tokens=60, seed=i))
        catch_up += stats.catch_up_s
    bucket = tuner.summary()["buckets"][0]
    assert [c["best"] for c in bucket["classes"]] == ["4_1_5"], bucket
    assert bucket["pulls"]["4_1_5"] > 3 * bucket["pulls"][NO_SD], bucket
    assert catch_up > 0


def test_a_run_says_what_the_unset_switch_means_on_its_device(toy):
    from tailtamer.config import load_train_config
    from tailtamer.rl.run_state import prepare, setup

    for extra, said in ((["run.name=a"], True), (["run.name=b", "spec.bs_threshold=8"], False)):
        logs = []
        setup(prepare(load_train_config(None, toy + ["spec.mode=adaptive", "spec.drafter=suffix", *extra])),
              log=logs.append)
        assert any(line == "spec.bs_threshold unset: on cpu with rollout.backend=tailtamer, SD at any batch size "
                           "(the bandit decides)"
                   for line in logs) == said, logs

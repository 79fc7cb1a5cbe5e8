"""Training config: YAML + dotted overrides, validation with the field's dotted name."""

import os

import pytest
import yaml

from tailtamer.config import TrainConfig, config_help, load_train_config, parse_yaml, to_dict
from tailtamer.errors import ConfigError


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rl:\n  lr: 1e-5\n  advantage: rloo\nspec:\n  mode: adaptive\n  drafter: suffix\n")
    cfg = load_train_config(path, ["rl.lr=2e-6", "rollout.group_size=4", "spec.strategies=[s4_2_8, s3_3_8]",
                                   "spec.bucket_thresholds=[1]"])
    assert cfg.rl.lr == 2e-6 and cfg.rl.advantage == "rloo" and cfg.rollout.group_size == 4
    assert cfg.spec.mode == "adaptive" and cfg.spec.strategies == ("s4_2_8", "s3_3_8")
    assert cfg.run == TrainConfig().run


def test_resolved_config_round_trips(tmp_path):
    cfg = load_train_config(None, ["spec.mode=on", "spec.drafter=suffix", "rl.dynamic_sampling=true"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_train_config(path) == cfg


def test_yaml_1_2_scalars():
    assert parse_yaml("a: 4_2_8\nb: 1e-6\nc: on\nd: 3\ne: true") == {"a": "4_2_8", "b": 1e-6, "c": "on", "d": 3, "e": True}


@pytest.mark.parametrize("overrides,message", [
    (["rl.lrr=1"], "unknown config field(s) rl.lrr (did you mean rl.lr?); known here"),
    (["rl.zzzz=1"], "unknown config field(s) rl.zzzz; known here"),
    (["rl.lr=fast"], "rl.lr: expected float, got 'fast'"),
    (["rl=3"], "rl: expected a section"),
    (["rl.advantage=ppo"], "rl.advantage 'ppo' is unknown"),
    (["rl.kl_coef=0.1", "rl.kl_estimator=k1"], "rl.kl_estimator 'k1': log π − log π_ref as a loss has a gradient of 0 in expectation"),
    (["rl.kl_coef=0.1", "rl.kl_estimator=kl"], "reference; choose k2 (the gradient of KL(π‖π_ref)) or k3 (of KL(π_ref‖π)"),
    (["rl.kl_estimator=k4"], "rl.kl_estimator 'k4' is unknown"),
    (["=1"], "override '=1' has no field name before '='"),
    (["spec.strategies=[]"], "spec.strategies is empty"),
    (["spec.strategies=[4_2_8, 4_2_8]"], "spec.strategies names 4_2_8 more than once"),
    (["spec.bucket_thresholds=[-1]"], "spec.bucket_thresholds must start at 1 and increase strictly, got [-1]"),
    (["rl.kl_estimator=k1", "rl.kl_coef=-0.1"], "rl.kl_coef must be >= 0"),
    (["rl.loss_agg=sum"], "rl.loss_agg 'sum' is unknown"),
    (["rl.minibatches=3"], "must divide rollout.prompts_per_step x rollout.group_size"),
    (["rollout.group_size=0"], "rollout.group_size must be >= 2, got 0: every advantage"),
    (["rollout.group_size=1", "rl.advantage=rloo"], "rollout.group_size must be >= 2, got 1: every advantage"),
    (["rl.dynamic_sampling=1"], "expected true or false"),
    (["run.steps=0"], "run.steps must be >= 1"),
    (["rollout.temperature=0"], "temperature must be > 0"),
    (["spec.mode=on", "spec.drafter="], "needs a drafter"),
    (["spec.mode=on", 'spec.drafter=""'], "needs a drafter"),  # not the working directory made absolute
    (["rl.grad_clip=-1"], "rl.grad_clip must be > 0"),
    (["rl.reward_timeout_s=-1"], "rl.reward_timeout_s must be > 0"),
    (["rl.kl_coef=.nan"], "rl.kl_coef: expected a finite number"),
    (["rl.lr=.inf"], "rl.lr: expected a finite number"),
    (["rollout.temperature=.inf"], "rollout.temperature: expected a finite number"),
    (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
    (["spot.lr=0"], "spot.lr must be > 0"),
    (["spec.strategy=4_2"], "spec.strategy"),
    (["spec.acceptance=typical"], "refused"),
    (["spec.mode=on", "spec.epsilon=2"], "spec.epsilon must be in [0, 1], got 2"),  # checked where unused too
    (["spec.bonus=-1"], "spec.bonus must be a number >= 0, got -1.0"),
    (["spec.bonus=.inf"], "spec.bonus"),
    (["spec.window=0"], "spec.window must be more than the 3 arms of a bucket, got 0"),
    (["spec.mode=off", "spec.strategies=[4_2_8, 9]"], "spec.strategies"),
    (["rl.lr"], "not KEY=VALUE"),
    (["rl.reward=[math, builtin]", "rl.reward_weights=[1]"], "rl.reward_weights: 1 weights for 2 reward functions"),
    (["rl.reward=[]"], "rl.reward: give at least one reward function"),
    (["drafter.train=false"], "renamed config field(s): drafter is now spot"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_train_config(None, overrides)
    assert message in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found$"):
        load_train_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match=r"run.steps: config file not found \(an override is KEY=VALUE: run.steps=...\)"):
        load_train_config("run.steps")  # `tailtamer train run.steps`: a mistyped override, taken for a file
    with pytest.raises(ConfigError, match=r"rl.yaml: config file not found$"):
        load_train_config("rl.yaml")
    with pytest.raises(ConfigError, match=r"is a directory, not a config file \(a run directory resumes with --resume\)"):
        load_train_config(tmp_path)
    assert load_train_config(None, ["rl.kl_estimator=k1"]).rl.kl_coef == 0  # unused: an older run's config resumes
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: malformed YAML"):
        load_train_config(bad)
    bad.write_text("rl:\n  clip_low: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: rl.clip_low must be in \[0, 1\)"):
        load_train_config(bad)


def test_a_bad_override_is_not_blamed_on_the_file(tmp_path):
    """A resumed run's config.yaml (or any config file) with a bad value given on the command
    line: the message names the field the user typed, not the file, which is fine."""
    good = tmp_path / "config.yaml"
    good.write_text("rl:\n  clip_low: 0.2\nspec:\n  history: 4\n")
    for override, message in [("spec.history=-1", "spec.history must be >= 0, got -1"),
                              ("rollout.group_size=1", "rollout.group_size must be >= 2, got 1"),
                              ("rl.overlong=penalty", "rl.overlong_buffer (64) must be below rollout.max_new_tokens"),
                              ("spec.strategies=[4_1_5+s]", "spec.strategies: strategy '4_1_5+s' is not")]:
        with pytest.raises(ConfigError) as e:
            load_train_config(good, [override, "rollout.max_new_tokens=64"])
        assert str(e.value).startswith(message), str(e.value)
    for override in ["rll.lr=1", "spec={history: -1}"]:  # a key that is no field, a whole section
        with pytest.raises(ConfigError) as e:
            load_train_config(good, [override])
        assert not str(e.value).startswith(str(good)), str(e.value)
    # the file's own mistakes, whatever else is given, even where the message names the override
    good.write_text("rl:\n  clip_low: 2\n")
    with pytest.raises(ConfigError, match=r"config.yaml: rl.clip_low must be in \[0, 1\)"):
        load_train_config(good, ["spec.history=4"])
    good.write_text("spec:\n  histroy: 4\n")
    with pytest.raises(ConfigError, match=r"config.yaml: unknown config field\(s\) spec.histroy \(did you mean "
                                          r"spec.history\?\)"):
        load_train_config(good, ["spec.history=4"])
    good.write_text("run: 5\n")  # an override into the file's broken section: the file is what to fix
    with pytest.raises(ConfigError, match=r"config.yaml: run: expected a section \(mapping\), got 5$"):
        load_train_config(good, ["run.steps=4"])
    good.write_text("run:\n  steps: 3\n")  # the override's own mistake, in a good file
    with pytest.raises(ConfigError, match=r"^override 'run.steps.x=4': steps is not a section$"):
        load_train_config(good, ["run.steps.x=4"])


def _leaves(cfg, where=""):
    from dataclasses import fields, is_dataclass

    for fl in fields(cfg):
        value = getattr(cfg, fl.name)
        yield from _leaves(value, f"{where}{fl.name}.") if is_dataclass(value) else [(f"{where}{fl.name}", value)]


@pytest.mark.parametrize("key,value", list(_leaves(TrainConfig())))
def test_setting_one_field_keeps_the_rest_of_its_section(key, value):
    """Overriding any field with the default job's own value gives the default job: a section
    given in part starts from the job's section (spec.mode stays adaptive), not its class's."""
    cfg = load_train_config(None, [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip()}"])
    assert cfg == TrainConfig()


def test_every_field_has_help():
    lines = config_help()
    assert any(line.startswith("rl.lr = 0.0001") for line in lines)
    assert "spec.mode = 'adaptive'" in "\n".join(lines)  # the default job's, not SpecConfig()'s
    assert all(line.split("    ", 1)[1].strip() for line in lines if not line.startswith("spec."))
    assert any(line.startswith("spec.bs_threshold = null ") for line in lines)  # what a config would write


def test_an_optional_number_is_unset_with_null_and_none_is_named_as_the_mistake():
    assert load_train_config(None, ["spec.bs_threshold=null"]).spec.bs_threshold is None
    assert load_train_config(None, ["spec.bs_threshold="]).spec.bs_threshold is None
    assert load_train_config(None, ["spec.bs_threshold=12"]).spec.bs_threshold == 12
    with pytest.raises(ConfigError, match=r"spec.bs_threshold: 'None' is a string; write null"):
        load_train_config(None, ["spec.bs_threshold=None"])


def test_a_single_reward_reads_as_a_list_of_one():
    assert load_train_config(None, ["rl.reward=math"]).rl.reward == ("math",)
    cfg = load_train_config(None, ["rl.reward=[math, a.py:f]", "rl.reward_weights=[1, 0.5]"])
    assert cfg.rl.reward == ("math", f"{os.path.abspath('a.py')}:f") and cfg.rl.reward_weights == (1.0, 0.5)


def test_a_section_with_every_key_commented_out_is_empty(tmp_path):
    """`run:` with nothing under it (YAML null) keeps the section's defaults, overrides included."""
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  # workers: 2\nrollout:\n  group_size: 4\n")
    cfg = load_train_config(path, ["run.workers=1"])
    assert cfg.run.workers == 1 and cfg.run.steps == TrainConfig().run.steps and cfg.rollout.group_size == 4


def test_the_built_in_models_cache_is_named_absolute(tmp_path, monkeypatch):
    """A relative TAILTAMER_CACHE still gives config.yaml absolute paths to the built-in model."""
    from tailtamer.sft import cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAILTAMER_CACHE", "cache")
    assert cache_root() == tmp_path / "cache"


def test_the_configuration_reference_is_current():
    from pathlib import Path

    from tailtamer.config import REFERENCE_COMMAND, config_reference

    reference = config_reference()
    assert "| `rollout.backend` | `'tailtamer'` |" in reference and "## vllm" in reference
    path = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    assert path.read_text() == reference, f"docs/config.md is out of date: run `{REFERENCE_COMMAND}`"


def test_out_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """`run.out_dir=~/runs` (quoted in YAML, or after `=` where the shell leaves it) made a
    directory named `~` in the working directory."""
    from tailtamer.rl.run_dir import claim_run_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cfg, lock = claim_run_dir(load_train_config(None, ["run.out_dir=~/runs", "run.name=r"]), None)
    lock.release()
    assert (tmp_path / "home" / "runs" / "r").is_dir() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("overrides,why", [
    (["spec.drafter=suffix"], "spec.drafter=suffix is model-free"),
    (["spec.mode=off"], "spec.mode=off"),
    (["spot.train=false"], "spot.train=false"),
    (["spec.drafter=/a/drafter"], None),
])
def test_a_training_window_no_drafter_reads_is_said(overrides, why):
    from tailtamer.rl.run_state import unread_spot

    cfg = load_train_config(None, ["spot.single_worker=window", *overrides])
    said = [f"spot.single_worker=window is not read: {why}, so no EAGLE drafter trains online"] if why else []
    assert unread_spot(cfg) == said
    assert unread_spot(load_train_config(None, overrides)) == []


def test_one_bucket_threshold_is_one_entry():
    from tailtamer.rollout.speculative import Strategy
    from tailtamer.rollout.speculator import SpecConfig
    from tailtamer.rollout.tuner import group_by_verify, validate_buckets

    arms = [Strategy.parse(a) for a in ("4_2_8", "2_1_3")]
    with pytest.raises(ConfigError, match=r"has 1 entry but the strategies form 2 groups"):
        validate_buckets(group_by_verify(arms), [1])
    with pytest.raises(ConfigError, match=r"has 1 entry but the default arms form"):
        SpecConfig(mode="adaptive", drafter="x", bucket_thresholds=(1,)).make_tuner()


@pytest.mark.parametrize("override,message", [
    ("run.out_dir=~nosuchuser-x/runs", "run.out_dir ~nosuchuser-x/runs: no such user's home directory"),
    ("run.out_dir=~", "run.out_dir: expected str, got None (YAML reads ~ and an empty value as null: quote a value"),
    ("run.device=cpu:", "run.device: expected str, got {'cpu': None} (YAML reads 'cpu:' as a mapping: quote"),
])
def test_what_yaml_or_the_home_directory_made_of_a_value_is_said(override, message):
    """`~nosuchuser/runs` became a literal directory; `~` and `cpu:` were reported as YAML's
    null and mapping without saying why."""
    with pytest.raises(ConfigError) as e:
        load_train_config(None, [override])
    assert str(e.value).startswith(message), e.value


@pytest.mark.parametrize("backend,free", [("tailtamer", "suffix"), ("vllm", "ngram")])
def test_the_builtin_drafter_with_a_model_of_ones_own_names_the_drafters_that_run_there(tmp_path, backend, free):
    """vLLM runs no suffix drafter: the refusal offered it on rollout.backend=vllm."""
    from conftest import random_model, tiny_config

    from tailtamer.model.io import save_model
    from tailtamer.model.tokenizer import char_tokenizer

    save_model(random_model(tiny_config()), tmp_path / "model")
    char_tokenizer().save(tmp_path / "model")
    with pytest.raises(ConfigError) as e:
        load_train_config(None, [f"run.model={tmp_path / 'model'}", "spec.mode=on", "spec.drafter=builtin",
                                 f"rollout.backend={backend}"])
    assert str(e.value) == (f"spec.drafter=builtin is the built-in base model's drafter (with run.model unset), not "
                            f"one for run.model={tmp_path / 'model'}; give spec.drafter=DIR (tailtamer drafter "
                            f"train), spec.drafter={free}, or spec.mode=off")

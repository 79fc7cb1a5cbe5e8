"""`tailtamer generate`: sample completions for a prompts file, with our engine (speculative
decoding as the flags ask) or vLLM; its flags' mistakes named by the flags."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tailtamer.arguments import at_least_one, check_responses_fit
from tailtamer.errors import ConfigError
from tailtamer.outputs import output_file
from tailtamer.rollout.speculator import SpecConfig

# `generate`'s flags for the SpecConfig fields they set
SPEC_FLAGS = {"mode": "--spec", "drafter": "--drafter", "strategy": "--strategy", "strategies": "--strategies",
              "bs_threshold": "--bs-threshold", "tuner": "--tuner", "compile": "--compile"}
# ... and the --spec modes that read each (--compile also sets vLLM's own compile, in any mode)
SPEC_FLAG_MODES = {"--drafter": ("on", "adaptive"), "--strategy": ("on", "adaptive"), "--compile": ("on", "adaptive"),
                   "--bs-threshold": ("adaptive",), "--tuner": ("adaptive",), "--strategies": ("adaptive",)}
# SamplingParams' errors start with the field's name
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "max_new_tokens": "--max-new-tokens", "n": "--n", "stop": "--stop"}


def sampling_flagged(e: ConfigError) -> ConfigError:
    """A sampling error (its first word the SamplingParams field), named by `generate`'s flag."""
    return ConfigError(re.sub(r"^\w+", lambda m: SAMPLING_FLAGS.get(m[0], m[0]), str(e)))


def flagged(e: ConfigError) -> ConfigError:
    """`generate`'s spec and vLLM errors, named by the flags that set the fields there."""
    named = re.sub(r"\bspec\.(\w+)", lambda m: SPEC_FLAGS.get(m[1], m[0]), str(e))
    return ConfigError(named.replace("rollout.backend", "--backend").replace("vllm.kv_cache_gb", "--kv-cache-gb"))


def check_spec_flags(args) -> None:
    """A speculative-decoding flag that the chosen --spec mode (or tuner) would not read is
    refused rather than dropped, so what runs is what was asked for."""
    given = {"--drafter": args.drafter is not None, "--strategy": args.strategy is not None,
             "--compile": args.compile and args.backend != "vllm", "--bs-threshold": args.bs_threshold is not None,
             "--tuner": args.tuner is not None, "--strategies": args.strategies is not None}
    for flag, modes in SPEC_FLAG_MODES.items():
        if given[flag] and args.spec not in modes:
            raise ConfigError(f"{flag} applies to --spec {' or '.join(modes)}; --spec {args.spec} does not read it")
    fixed = args.spec == "on" or args.tuner == "fixed"
    if args.strategy is not None and not fixed:
        raise ConfigError("--strategy is the one arm of --spec on or --tuner fixed; --spec adaptive's bandit "
                          "chooses among --strategies")
    if args.strategies is not None and fixed:
        raise ConfigError("--strategies are the bandit's arms; --tuner fixed drafts --strategy")


def cmd_generate(args) -> None:
    from tailtamer.atomic import atomic_write_json, atomic_write_text, writing
    from tailtamer.device import resolve_device
    from tailtamer.model.io import load_pretrained
    from tailtamer.rl.data import context_cut, load_prompts
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams
    from tailtamer.model.drafter import check_drafter_dir, load_drafter
    from tailtamer.rollout.backend import EmbeddedBackend
    from tailtamer.rollout.speculator import check_engine_drafter, make_speculator
    from tailtamer.rollout.vllm_backend import (VLLMBackend, VLLMConfig, bias_free, check_params, check_strategies,
                                                require_vllm, vllm_arms)

    at_least_one(args.max_batch_size, "--max-batch-size")
    try:
        check_spec_flags(args)
        vllm = args.backend == "vllm"
        unset = vllm_arms(args.drafter) if vllm else {}
        arms = args.strategies or unset.get("strategies")
        spec = SpecConfig(mode=args.spec, strategy=args.strategy or unset.get("strategy"), drafter=args.drafter,
                          bs_threshold=args.bs_threshold, tuner=args.tuner or "beg",
                          compile=args.compile and not vllm, strategies=tuple(arms) if arms else None)
        if vllm:  # what vLLM cannot run is said before whether it is installed (as `train` does)
            check_strategies(spec)
            if args.dtype == "float64":
                raise ConfigError("--dtype float64: vLLM runs float32 or bfloat16")
            vllm_cfg = VLLMConfig(dtype=args.dtype, compile=args.compile,
                                  **({} if args.kv_cache_gb is None else {"kv_cache_gb": args.kv_cache_gb}))
            require_vllm("--backend vllm")
        else:
            if args.kv_cache_gb is not None:
                raise ConfigError("--kv-cache-gb sizes vLLM's KV cache (--backend vllm); our engine sizes its own")
            check_engine_drafter(spec)
    except ConfigError as e:
        raise flagged(e) from None
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), n=args.n, seed=args.seed)
    except ConfigError as e:
        raise sampling_flagged(e) from None
    device = resolve_device(args.device)
    if vllm:  # before anything loads or starts
        try:
            check_params(params, spec.mode != "off", device.type)
        except ConfigError as e:
            raise sampling_flagged(e) from None
    if spec.drafter == "builtin":
        raise ConfigError("--drafter builtin is train's (the built-in base model's warm-up drafter); generate takes "
                          "a drafter directory: train caches that one beside the base model, as "
                          "<model directory>-drafter-<hash>")
    if spec.eagle:  # before the model loads: a missing drafter said by its flag
        check_drafter_dir(spec.drafter, f"--drafter {spec.drafter}")
    inputs = {"--prompts": args.prompts, "--model": args.model, **({"--drafter": spec.drafter} if spec.eagle else {})}
    output_file(args.out, "--out", inputs)
    vllm_log = Path(args.out).with_suffix(".vllm.log")
    if vllm:
        output_file(str(vllm_log), "--out's vLLM log", inputs)
    if args.stats:
        output_file(args.stats, "--stats", {**inputs, "--out": args.out, **({"--out's vLLM log": str(vllm_log)}
                                                                            if vllm else {})})
    model, tokenizer = load_pretrained(args.model, args.dtype, device)
    rows, prompts = load_prompts(args.prompts, tokenizer)
    check_responses_fit(len(prompts), args.n, args.max_new_tokens, "lower --n or --max-new-tokens, or split --prompts")
    if args.backend == "vllm":
        drafter = load_drafter(spec.drafter, model) if spec.eagle else None
        try:
            engine = VLLMBackend(args.model, model, tokenizer, spec, bias_free(drafter), vllm_cfg, args.max_batch_size,
                                 log_file=vllm_log)
        except ConfigError as e:
            raise flagged(e) from None
    else:
        try:
            speculator = make_speculator(spec, model)
        except ConfigError as e:
            raise flagged(e) from None
        engine = EmbeddedBackend(Engine(model, tokenizer, EngineConfig(max_batch_size=args.max_batch_size),
                                        speculator=speculator))
    labels = [f"{args.prompts}:{row['_row']}" for row in rows]
    try:
        completions, stats = engine.generate(prompts, params, labels=labels)
    finally:
        engine.close()
    cut = context_cut(f"--max-new-tokens {args.max_new_tokens}", args.max_new_tokens,
                      model.config.max_position_embeddings, max(map(len, prompts)), "with finish_reason length")
    if cut:  # as train says it (after the run: an error stays one line)
        print(cut, file=sys.stderr)
    if engine.notice:
        print(engine.notice, file=sys.stderr)
    lines = [json.dumps({"prompt_index": c.prompt_index, "sample_index": c.sample_index, "text": c.text,
                         "token_ids": c.token_ids, "finish_reason": c.finish_reason}) for c in completions]
    with writing("the completions", args.out, "; nothing was written there"):
        atomic_write_text(args.out, "\n".join(lines) + "\n")
    summary = stats.summary()
    if engine.tuner is not None:
        summary["tuner"] = engine.tuner.summary()
    summary["backend"] = engine.name
    if args.stats:
        with writing("the stats", args.stats, f"; the completions are in {args.out}"):
            atomic_write_json(args.stats, summary)
    print(f"wrote {len(completions)} completions to {args.out}: {summary['tokens']} tokens in "
          f"{summary['seconds']:.2f}s ({summary['tokens_per_s']:.1f} tokens/s, "
          f"accept length {summary['accept_len_mean']:.2f})")

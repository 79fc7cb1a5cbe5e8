"""TLT inside TRL: a `rollout_func` for `trl.GRPOTrainer` that rolls out with tailtamer's engine.

    from tailtamer.integrations.trl import TLTRollout
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          rollout_func=TLTRollout(spec="adaptive", drafter="DRAFTER_DIR"))

TRL calls it in `_generate` with the process's own prompt rows, each prompt repeated
`num_generations` times in a row, raw (chat messages kept), and takes one completion per row
with `prompt_ids`, `completion_ids` and `logprobs`; other keys go to the reward functions.
Everything else stays TRL's: the trainer, its loss, rewards, logging and checkpoints.

What it does per call: copies the trainer's current weights into the engine's model (built
once, with the engine, the drafter and the bandit) and proves the copy is current (both
models' logits on a probe input agree); renders the prompts as TRL does (its chat template and
kwargs); rolls the siblings out as one group each (one shared prefill, drafts from each other
with the suffix drafter), sampling as TRL's generation would (temperature, top-k, top-p,
`max_completion_length`, TRL's end-of-sequence ids; `generation_kwargs={"do_sample": False}`
for greedy), seeded by (args.seed, global step, process) so a run repeats; returns each sampled
token's log-probability under the distribution it was drawn from, recorded as the engine draws
it (SD changes neither tokens nor log-probabilities); and
appends TLT's figures to the trainer's metrics (`tlt/...`), which TRL logs wherever it logs.

The adaptive drafter, with an EAGLE drafter and several processes (accelerate or torchrun):
each process keeps the hidden states its own rollout computed; a process whose share is done
trains the drafter on them until the slowest one finishes (checked before every drafter step's
forward and backward: the spot trainer, `drafter/adaptive.py`), and the processes' drafters are
then averaged, weighted by the steps each took, and checked identical before the call returns.
With one process there is no idle time to train in: the drafter stays as loaded, unless
`SpotConfig(single_worker="window")` trains it for `window_s` after each rollout (which
lengthens every step, as in tailtamer's own trainer).
"""

from __future__ import annotations

import atexit
import inspect
import numbers
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from tailtamer.dist import Workers
from tailtamer.drafter.adaptive import AdaptiveDrafter
from tailtamer.drafter.spot import SpotConfig
from tailtamer.errors import ConfigError, DataError, TailtamerError
from tailtamer.model.config import ARCHITECTURES, ModelConfig
from tailtamer.model.drafter import load_drafter, weights_checksum
from tailtamer.model.io import IGNORED_SUFFIXES, from_hf_key, model_from_hf_state, save_model, token_ids
from tailtamer.model.transformer import join_fused
from tailtamer.rl.data import context_cut
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams, target_probs
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.speculator import SpecConfig, check_engine_drafter, make_speculator
from tailtamer.rollout.vllm_backend import (VLLMBackend, VLLMConfig, bias_free, check_strategies, require_vllm,
                                            vllm_arms)

PROBE = (1, 2, 3, 4)  # token ids of the probe input that proves the engine's weights current
PROBE_TOL = 1e-4  # the largest difference of the two models' probe logits, relative to their scale
# The same for 16-bit weights, which compute in 16 bits there and in float32 here: the gap grows
# with depth (2-4e-2 for bfloat16 on 2-24 layers, 2-5e-3 for float16), so these bounds prove
# the architecture and the shape-checked copy of every tensor proves the weights current.
PROBE_TOL_16BIT = {torch.bfloat16: 0.25, torch.float16: 1e-2}


class StalePolicy(TailtamerError):
    """The engine's model is not the trainer's current policy."""


def check_arguments(spec, drafter, strategy, strategies, bs_threshold, max_batch_size, backend, spot, vllm) -> None:
    """TLTRollout's arguments, each refused at construction in one line naming it: the values
    SpecConfig does not check itself, and a drafter or switch the chosen `spec` would not use
    (as `tailtamer generate` refuses its flags; the strategies it does not read, `SpecConfig.unread`)."""
    if backend not in ("tailtamer", "vllm"):
        raise ConfigError(f"TLTRollout backend={backend!r}: tailtamer (our engine) or vllm")
    if spec not in ("off", "on", "adaptive"):
        raise ConfigError(f"TLTRollout spec={spec!r}: off, on (SD at every step) or adaptive (SD in the long tail)")
    if drafter == "builtin":
        raise ConfigError("TLTRollout drafter='builtin' is the built-in base model's drafter, not one for a TRL "
                          "model: give a drafter directory (tailtamer drafter train --model DIR), 'suffix' or None")
    if drafter is not None and not isinstance(drafter, (str, Path)):
        raise ConfigError(f"TLTRollout drafter={drafter!r}: give a drafter directory, 'suffix' or None")
    if spec == "off" and drafter not in (None, "suffix"):  # "suffix" is the default
        raise ConfigError(f"TLTRollout drafter={str(drafter)!r} is not used with spec='off', which decodes without "
                          f"speculation")
    if strategy is not None and not isinstance(strategy, str):
        raise ConfigError(f"TLTRollout strategy={strategy!r}: give one strategy's name, e.g. '4_1_5'")
    if strategies is not None and (not isinstance(strategies, (list, tuple)) or
                                   not all(isinstance(x, str) for x in strategies)):
        raise ConfigError(f"TLTRollout strategies={strategies!r}: give a list of strategy names, e.g. ['7_1_8', "
                          f"'4_1_5']")
    if not _whole_at_least(max_batch_size, 1):
        raise ConfigError(f"TLTRollout max_batch_size={max_batch_size!r}: give a whole number >= 1")
    if bs_threshold is not None and not _whole_at_least(bs_threshold, 0):
        raise ConfigError(f"TLTRollout bs_threshold={bs_threshold!r}: give a whole number >= 0 or None (the device's "
                          f"default)")
    if bs_threshold is not None and spec != "adaptive":
        raise ConfigError(f"TLTRollout bs_threshold={bs_threshold!r} is the long-tail switch of spec='adaptive'; "
                          f"spec={spec!r} would not read it")
    if not isinstance(spot, SpotConfig):
        raise ConfigError(f"TLTRollout spot={spot!r}: give a tailtamer.drafter.spot.SpotConfig, e.g. "
                          f"SpotConfig(train=False)")
    if not isinstance(vllm, VLLMConfig):
        raise ConfigError(f"TLTRollout vllm={vllm!r}: give a tailtamer.rollout.vllm_backend.VLLMConfig, e.g. "
                          f"VLLMConfig(kv_cache_gb=4)")
    if vllm != VLLMConfig() and backend != "vllm":
        raise ConfigError(f"TLTRollout vllm=... sets up vLLM's engine; backend={backend!r} would not read it")


def _whole_at_least(value, least: int) -> bool:
    """An integer of any kind (numpy's too), not a bool, at least `least`."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


class TLTRollout:
    """A `rollout_func` for TRL's GRPOTrainer. `spec`: off, on or adaptive (tailtamer's
    spec.mode); `drafter`: an EAGLE drafter directory for the trainer's model, `suffix` (the
    model-free drafter over each prompt's siblings) or None (with spec off); `strategy`,
    `strategies`, `bs_threshold`: as spec.strategy, spec.strategies, spec.bs_threshold;
    `max_batch_size`: requests decoded together; `spot`: the drafter's training on idle
    processes (tailtamer's spot section: `SpotConfig(train=False)` keeps it frozen); `vllm`:
    vLLM's engine with backend="vllm" (tailtamer's vllm section, e.g. `VLLMConfig(kv_cache_gb=4)`)."""

    def __init__(self, spec: str = "adaptive", drafter: str | None = "suffix", strategy: str | None = None,
                 strategies: tuple[str, ...] | None = None, bs_threshold: int | None = None,
                 max_batch_size: int = 512, backend: str = "tailtamer", spot: SpotConfig = SpotConfig(),
                 vllm: VLLMConfig = VLLMConfig()):
        check_trl()
        check_arguments(spec, drafter, strategy, strategies, bs_threshold, max_batch_size, backend, spot, vllm)
        drafter = str(drafter) if isinstance(drafter, Path) else drafter
        on_vllm, unset = backend == "vllm", {}
        if on_vllm:  # where it is installed; its arms are chains (unset: vLLM's defaults)
            require_vllm("TLTRollout backend='vllm'")
            unset = vllm_arms(drafter)
            strategy, strategies = strategy or unset.get("strategy"), strategies or unset.get("strategies")
        self.spec = SpecConfig(mode=spec, drafter=drafter if spec != "off" else None, strategy=strategy,
                               strategies=tuple(strategies) if strategies is not None else None,
                               bs_threshold=None if bs_threshold is None else int(bs_threshold))
        unread = self.spec.unread(unset)
        if unread:
            raise ConfigError(f"TLTRollout: {unread[0]}")
        if on_vllm:
            check_strategies(self.spec)
        else:
            check_engine_drafter(self.spec)
        self.backend, self.max_batch_size, self.spot, self.vllm = backend, int(max_batch_size), spot, vllm
        self.engine: Engine | VLLMBackend | None = None
        self.model = None  # our Transformer, holding the trainer's weights
        self.adaptive: AdaptiveDrafter | None = None
        self.workers: Workers | None = None
        self.calls = 0
        self._cut_said = False

    # --- the call TRL makes -------------------------------------------------------------------

    def __call__(self, prompts: list, trainer) -> dict:
        if not isinstance(prompts, list) or not prompts or not hasattr(trainer, "accelerator"):
            raise ConfigError(f"TLTRollout is called by TRL's GRPOTrainer with a non-empty list of prompts and the "
                              f"trainer, got {type(prompts).__name__} and {type(trainer).__name__}")
        check_prompt_rows(prompts, self.calls + 1)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if self.engine is None:
            self.engine = self._build(policy, trainer)
        self.publish(policy)
        if self.backend == "vllm":
            self.engine.publish_policy(self.model)
        prompt_ids = self._tokenize(prompts, trainer)
        params = self._params(trainer)
        groups = _group_rows(prompt_ids)
        size = len(prompt_ids) // len(groups)
        if not all(len(g) == size for g in groups):
            groups = [[i] for i in range(len(prompt_ids))]
        unique = [prompt_ids[g[0]] for g in groups]
        # a user maps an error to TRL's batch, not to our list of unique prompts
        labels = [f"TLTRollout call {self.calls + 1}, prompt "
                  + (f"rows {g[0]}-{g[-1]}" if len(g) > 1 else f"row {g[0]}") for g in groups]
        params = replace(params, n=len(prompt_ids) // len(unique))
        self._say_context_cut(params.max_new_tokens, max(map(len, unique)))
        t0 = time.perf_counter()
        keep = self.adaptive.collector(self.calls) if self.adaptive is not None else None
        completions, stats = self.engine.generate(unique, replace(params, logprobs=True), keep_hidden=keep,
                                                  labels=labels)
        rollout_s = time.perf_counter() - t0
        spot = self._train_drafter() if self.adaptive is not None else {}
        completion_ids = [c.token_ids for c in completions]
        logprobs = [c.logprobs for c in completions] if self.backend == "tailtamer" else \
            self.recomputed_logprobs(prompt_ids, completion_ids, params)
        self._log(trainer, stats, rollout_s, spot)
        self.calls += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    # --- set-up, once ------------------------------------------------------------------------------

    def _build(self, policy, trainer) -> Engine:
        args = trainer.args
        if getattr(args, "use_vllm", False):
            raise ConfigError("TLTRollout with GRPOConfig(use_vllm=True): TLTRollout rolls out with tailtamer's engine; "
                              "set use_vllm=False, or drop TLTRollout to use TRL's vLLM generation")
        plugin = getattr(getattr(trainer.accelerator, "state", None), "deepspeed_plugin", None)
        if getattr(trainer, "is_fsdp_enabled", False) or getattr(plugin, "zero_stage", 0) == 3:
            # each process holds a shard of the weights, and the engine needs them whole
            raise ConfigError("TLTRollout: FSDP and DeepSpeed ZeRO-3 shard the model's weights, which tailtamer's "
                              "engine needs whole on every process; use DDP or ZeRO-1/2, or drop TLTRollout")
        if hasattr(policy, "peft_config"):
            raise ConfigError("TLTRollout: a PEFT model is not supported yet (merge its adapters into the model "
                              "first, or drop TLTRollout)")
        # first: TRL adds generation settings of its own for a model it cannot run (a VLM's suppress_tokens)
        raw = policy.config.to_dict()
        arch = (raw.get("architectures") or [type(policy).__name__])[0]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"TLTRollout: {arch} is not supported; tailtamer's engine runs "
                              f"{', '.join(sorted(ARCHITECTURES))}")
        kwargs = generation_settings(trainer)
        if kwargs.get("repetition_penalty") not in (None, 1.0):
            raise ConfigError(f"TLTRollout: repetition_penalty={kwargs['repetition_penalty']} would change the policy's "
                              f"distribution, which speculative decoding keeps exactly; use 1.0")
        if kwargs.get("min_p"):
            raise ConfigError(f"TLTRollout: min_p={kwargs['min_p']} is not supported by tailtamer's sampler; use top_p "
                              f"or top_k")
        extra = {k: v for k, v in kwargs.items() if k not in TRL_GENERATION_KEYS}
        if extra:
            raise ConfigError(f"TLTRollout: generation_kwargs {sorted(extra)} are not supported; tailtamer samples "
                              f"with temperature, top_k, top_p and do_sample only")
        cfg = ModelConfig.from_hf({**raw, "architectures": [arch]}, source=f"the trainer's model ({arch})")
        eos = end_of_sequence(kwargs.get("eos_token_id", trainer.eos_token_ids))
        cfg = cfg.replace(eos_token_id=list(eos) or None)
        weight = next(policy.parameters())
        model = model_from_hf_state(cfg, policy.state_dict(), torch.float32 if weight.dtype != torch.float64 else
                                    torch.float64, weight.device, "the trainer's model", "its config")
        self.model = model
        drafter = None
        if self.spec.mode != "off" and self.spec.drafter != "suffix":
            drafter = load_drafter(self.spec.drafter, model)
        if self.backend == "vllm":  # started from the model as it is now, saved where vLLM loads it
            self._dir = tempfile.mkdtemp(prefix="tailtamer-trl-vllm-")
            atexit.register(shutil.rmtree, self._dir, True)
            save_model(model, self._dir)
            try:
                return VLLMBackend(self._dir, model, None, self.spec, bias_free(drafter), self.vllm,
                                   self.max_batch_size, seed=int(args.seed), eos_ids=eos,
                                   log_file=Path(args.output_dir) / "vllm.log",
                                   log_prefix=f"process {trainer.accelerator.process_index} ")
            except ConfigError as e:  # vllm.kv_cache_gb: TLTRollout's vllm=VLLMConfig(...)
                raise ConfigError(f"TLTRollout: {e}") from None
        speculator = make_speculator(self.spec, model, drafter)
        several = trainer.accelerator.num_processes > 1
        if self.spot.trains(drafter is not None, trainer.accelerator.num_processes):
            self.workers = _workers(trainer.accelerator.device) if several else Workers(device=trainer.accelerator.device)
            score = SamplingParams(temperature=args.temperature or 1.0, top_p=args.top_p)
            self.adaptive = AdaptiveDrafter(drafter, replace(self.spot, compare_frozen=False), self.workers,
                                            int(args.seed) * 1009 + self.workers.rank, Strategy.parse(self.spec.fixed).depth,
                                            score)
        return Engine(model, config=EngineConfig(max_batch_size=self.max_batch_size),
                      eos_ids=eos, speculator=speculator)

    # --- per call -----------------------------------------------------------------------------------

    def publish(self, policy) -> None:
        """The trainer's current weights into the engine's model, then the probe: both models'
        logits on the same input must agree (a stale or partial copy does not)."""
        model = self.model
        state = join_fused({from_hf_key(k): v for k, v in policy.state_dict().items()}, model.config)
        params = dict(model.named_parameters())  # a tied LM head is the embedding's parameter
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        names = {n for n in state if not n.endswith(IGNORED_SUFFIXES)} - tied
        other = sorted(set(params) ^ names) or [n for n, v in state.items()
                                                               if n in params and v.shape != params[n].shape]
        if other:
            raise ConfigError(f"TLTRollout: the trainer's model is not the one its engine was built for ({other[0]} "
                              f"differs; a TLTRollout serves the model of the first trainer that called it); give each "
                              f"trainer its own")
        with torch.no_grad():
            for name, value in state.items():
                if name in params:
                    params[name].copy_(value)
        self.check(policy)

    def check(self, policy) -> None:
        """Both models' logits on the probe input, the trainer's in its weights' precision: not
        under the autocast a mixed-precision trainer wraps its forward in (accelerate keeps the
        forward it wrapped as `_original_forward`)."""
        model = self.model
        ids = torch.tensor([PROBE], device=next(model.parameters()).device)
        weight = next(policy.parameters())
        forward = policy.__dict__.get("_original_forward", policy)
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            theirs = forward(input_ids=ids.to(weight.device)).logits.float().cpu()
            ours = model(ids)[0].float().cpu()
        scale = theirs.abs().max().clamp(min=1e-6)
        diff = float((theirs - ours).abs().max() / scale)
        tol = PROBE_TOL_16BIT.get(weight.dtype, PROBE_TOL)
        if not diff <= tol:
            raise StalePolicy(f"TLTRollout: the engine's policy is stale: its logits on the probe input differ from the "
                              f"trainer's model ({weight.dtype}) by {diff:.2e} (relative; at most {tol:g}), call "
                              f"{self.calls + 1}")

    def _train_drafter(self) -> dict:
        """The spot trainer in this call's idle time, then the drafters averaged and checked
        identical on every process."""
        w, call = self.workers, self.calls
        if w.world == 1:  # spot.single_worker=window: train for window_s after the rollout
            report = self.adaptive.train_in_window()
            return {"tlt/drafter_steps": report["steps"], "tlt/drafter_loss": report["loss"]}
        done = time.time()
        w.finish_rollout(call)
        report = self.adaptive.train_while_idle(lambda: w.rollout_over(call))
        last = w.wait_rollout(call)
        self.adaptive.publish(report["steps"])()
        sums = w.gather(weights_checksum(self.adaptive.drafter))
        if len(set(sums)) != 1:
            raise StalePolicy(f"TLTRollout: the processes' drafters differ after the average (checksums "
                              f"{', '.join(sums)}), call {call + 1}")
        return {"tlt/drafter_steps": report["steps"], "tlt/drafter_loss": report["loss"],
                "tlt/idle_s": max(0.0, last - done)}

    def _tokenize(self, prompts: list, trainer) -> list[list[int]]:
        """As TRL's `_tokenize_prompts` renders text prompts and chat messages."""
        if prompts and isinstance(prompts[0], list):  # conversational: lists of {"role", "content"}
            out = trainer.processing_class.apply_chat_template(
                conversation=prompts, tools=getattr(trainer, "tools", None) or None,
                chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=True,
                return_dict=True, **(getattr(trainer, "chat_template_kwargs", None) or {}))
            return [list(map(int, ids)) for ids in out["input_ids"]]
        return [list(map(int, ids)) for ids in trainer.processing_class(text=prompts)["input_ids"]]

    def _params(self, trainer) -> SamplingParams:
        args = trainer.args
        kwargs = generation_settings(trainer)
        for key in ("temperature", "top_p", "top_k", "max_new_tokens"):
            value = kwargs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ConfigError(f"TLTRollout: generation {key}={value!r}: give a number")
        if kwargs.get("top_p") == 0:  # transformers keeps one token there; tailtamer's sampler takes (0, 1]
            raise ConfigError("TLTRollout: generation top_p=0: give top_p in (0, 1], or generation_kwargs="
                              "{'do_sample': False} for greedy decoding")
        greedy = kwargs.get("do_sample") is False or kwargs.get("temperature", args.temperature) == 0
        step = trainer.state.global_step
        seed = (int(args.seed) * 1_000_003 + step * 1009 + trainer.accelerator.process_index * 7919 + self.calls) % 2 ** 62
        return SamplingParams(temperature=0.0 if greedy else kwargs.get("temperature", args.temperature),
                              top_k=int(kwargs.get("top_k", args.top_k) or 0),
                              top_p=float(kwargs.get("top_p", args.top_p) or 1.0),
                              max_new_tokens=int(kwargs.get("max_new_tokens", trainer.max_completion_length)),
                              seed=seed)

    def _say_context_cut(self, max_new_tokens: int, longest: int) -> None:
        """Once, as `tailtamer train` and `generate` say it: the model's context will end
        responses before max_completion_length."""
        if self._cut_said:
            return
        cut = context_cut(f"max_completion_length {max_new_tokens}", max_new_tokens,
                          self.model.config.max_position_embeddings, longest,
                          "without an end-of-sequence token (a truncated completion)")
        if cut:
            self._cut_said = True
            print(f"TLTRollout: {cut}", file=sys.stderr)

    def recomputed_logprobs(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                            params: SamplingParams) -> list[list[float]]:
        """For vLLM, which does not record them here: each completion token's log-probability
        under the distribution it was sampled from, from forwards of our model over prompt +
        completion (rows right-padded: causal, so padding changes no row's logits)."""
        device = next(self.model.parameters()).device
        processed = replace(params, temperature=params.temperature or 1.0)
        out = []
        for lo in range(0, len(prompt_ids), 32):
            pairs = list(zip(prompt_ids[lo: lo + 32], completion_ids[lo: lo + 32]))
            width = max(len(p) + len(c) for p, c in pairs)
            ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in pairs], device=device)
            with torch.no_grad():
                logits = self.model(ids)[0]
            for row, (p, c) in enumerate(pairs):
                probs = target_probs(logits[row, len(p) - 1: len(p) + len(c) - 1], processed)
                out.append(probs.gather(1, torch.tensor(c, device=device)[:, None]).log().squeeze(1).tolist() if c else [])
        return out

    def close(self) -> None:
        """Shut a vLLM engine down (our engine needs nothing)."""
        if self.backend == "vllm" and self.engine is not None:
            self.engine.close()

    def _log(self, trainer, stats, rollout_s: float, spot: dict) -> None:
        mode = "train" if trainer.model.training else "eval"
        metrics = {"tlt/rollout_s": rollout_s, "tlt/tail_s": stats.tail_seconds(),
                   "tlt/accept_len": stats.accept_len_mean, "tlt/sd_tokens_frac": stats.sd_tokens / max(1, stats.tokens)}
        steps = sum(stats.accept_lens.values())
        for source, n in stats.accepted_by_source.items():
            metrics[f"tlt/accepted_from_{source}"] = n / max(1, steps)
        for key, value in {**metrics, **spot}.items():
            if value is not None:
                trainer._metrics[mode][key].append(value)


# generation_kwargs keys TRL sets itself or that tailtamer honours
TRL_GENERATION_KEYS = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature",
                       "top_p", "top_k", "min_p", "repetition_penalty", "cache_implementation"}


def generation_settings(trainer) -> dict:
    """How TRL's own generation would sample: its generation_kwargs (GRPOConfig's sampling
    values merged with args.generation_kwargs, which win; GRPOConfig's where a TRL keeps none),
    without the settings left unset."""
    args = trainer.args
    kwargs = getattr(trainer, "generation_kwargs", None)
    if kwargs is None:
        kwargs = {**{key: getattr(args, key) for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                     if hasattr(args, key)}, **(getattr(args, "generation_kwargs", None) or {})}
    return {key: value for key, value in kwargs.items() if value is not None}  # None: unset, as transformers reads it


def check_prompt_rows(prompts: list, call: int) -> None:
    """Every prompt text, or every one a chat (a list of message dicts with a role), as TRL's
    own generation renders them: another row is named by its index in TRL's batch, not left to
    a tokenizer's error."""
    chat = isinstance(prompts[0], list)
    for i, prompt in enumerate(prompts):
        ok = (isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)
              if chat else isinstance(prompt, str))
        if not ok:
            shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:57] + "..."
            first = f", as row 0 is {'a chat' if chat else 'text'}" if i else ""
            raise DataError(f"TLTRollout call {call}, prompt row {i}: {shown}; a batch's prompts are all text or all "
                            f"chats (lists of {{'role': ..., 'content': ...}} messages){first}")


def end_of_sequence(ids) -> tuple[int, ...]:
    """The end-of-sequence ids TRL's generation stops at (one id or several; None: none)."""
    listed = [] if ids is None else [ids] if isinstance(ids, numbers.Integral) else list(ids)
    checked = token_ids([int(i) if isinstance(i, numbers.Integral) and not isinstance(i, bool) else i
                         for i in listed if i is not None])
    if checked is None:
        raise ConfigError(f"TLTRollout: eos_token_id={ids!r}: give a token id or a list of them")
    return tuple(checked)


def check_trl() -> None:
    """One line where TRL is missing, or too old to take a rollout_func (TRL >= 1.0)."""
    try:
        import trl
    except ImportError:
        raise ConfigError("TLTRollout needs TRL: pip install -e '.[trl]' (trl 1.16.0)") from None
    if "rollout_func" not in inspect.signature(trl.GRPOTrainer.__init__).parameters:
        raise ConfigError(f"TLTRollout needs GRPOTrainer's rollout_func (TRL >= 1.0); this TRL is {trl.__version__}: "
                          f"pip install -e '.[trl]' (trl 1.16.0)")


def _workers(device: torch.device) -> Workers:
    """This process's place among the trainer's processes (accelerate's process group), with a
    store of its own under the group's for the spot trainer's coordination."""
    import torch.distributed as dist

    store = dist.PrefixStore("tailtamer", dist.distributed_c10d._get_default_store())
    return Workers(dist.get_rank(), dist.get_world_size(), store, device)


def _group_rows(prompt_ids: list[list[int]]) -> list[list[int]]:
    """Runs of equal consecutive rows (TRL repeats each prompt num_generations times in a row)."""
    groups: list[list[int]] = []
    for i, ids in enumerate(prompt_ids):
        if groups and prompt_ids[groups[-1][0]] == ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


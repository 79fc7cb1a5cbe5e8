"""The vLLM rollout backend: TLT's part on top of one in-process vLLM `LLM` per worker.

What tailtamer adds to vLLM (the engine does the decoding, its kernels, its paged KV cache):
  - the long-tail switch and the strategy bandit, at every engine step: this backend drives
    `LLMEngine.step()` itself and, before each step, writes the draft length K it chose for
    the number of running requests into the scheduler's per-batch-size table (vLLM's
    `num_speculative_tokens_per_batch_size`, K = 0: no drafts), which the scheduler reads
    anew at every step. The arms are chains (DEPTH_1_DEPTH+1): vLLM drafts no trees per step.
    vLLM drafts at the end of a step for the next one, so a step's tokens are the previous
    step's arm's and are credited to it;
  - the policy and the drafter published into the running engine after each update and each
    spot-training round (no restart), each checked layer by layer (rollout/vllm_worker.py),
    and the prefix cache reset, since its KV rows were computed by the old weights;
  - lossless settings only: standard rejection sampling, never vLLM's synthetic acceptance.

vLLM draws its own random numbers: a seed per request (the same request key as our engine)
makes a rollout repeatable, but SD on and SD off draw differently, so on vLLM "lossless" means
the same distribution (tests/test_vllm_backend.py tests it), and greedy output identical.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tailtamer.atomic import atomic_write, atomic_write_json
from tailtamer.config_fields import at_most, f, positive
from tailtamer.errors import ConfigError, DataError
from tailtamer.model.drafter import drafter_tensors
from tailtamer.model.io import to_hf_key
from tailtamer.model.transformer import split_fused
from tailtamer.rollout.backend import RolloutBackendError
from tailtamer.rollout.engine import Completion, check_prompt
from tailtamer.rollout.sampling import SamplingParams, request_key
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.stats import RolloutStats
from tailtamer.rollout.vllm_worker import (expected_probe, fix_cpu_expand, generators_rewind, load_weights, probe,
                                           probe_mismatch)

VLLM_SETUP = "make vllm-env"
VLLM_ENV = "~/.cache/tailtamer/vllm-env"  # where the Makefile links it
# vLLM's EAGLE-1 loader for every target it drafts for (llama_eagle.py): a Llama layer that
# takes qkv_bias (a Qwen2 layer) and head_dim from config.json, and an fc without bias.
VLLM_EAGLE_ARCHITECTURE = "EagleLlamaForCausalLM"
# The bandit's arms on vLLM when spec.strategies is left at our engine's (trees among them).
VLLM_STRATEGIES = ("7_1_8", "4_1_5", "2_1_3")
VLLM_STRATEGY = "4_1_5"


def vllm_arms(drafter: str | None) -> dict:
    """spec.strategy and spec.strategies where the user left them unset, on vLLM: our engine's
    defaults hold trees, which vLLM cannot draft, so its own are chains; the suffix drafter's
    are its own (and `check_strategies` says where it runs)."""
    return {} if drafter == "suffix" else {"strategy": VLLM_STRATEGY, "strategies": VLLM_STRATEGIES}


# spec.bs_threshold when unset: TLT switches SD on below 32 running requests.
VLLM_BS_THRESHOLD = 32
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses more, once the engine has started
# Relative differences a published layer may show in the engine's dtype (float32 kernels
# round in another order than ours; bfloat16 keeps 8 bits).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
KV_CACHE_MIN_GB = 1e-6
# How vLLM's start says that its KV cache cannot hold one request of the model's context (it
# names gpu_memory_utilization, which tailtamer's explicit cache size overrides), and that the
# machine has less free than the cache asks for (naming vLLM's flags).
KV_CACHE_TOO_SMALL = ("No available memory for the cache blocks", "To serve at least one request")
KV_CACHE_TOO_BIG = re.compile(r"Available memory on node \d+ \(([\d.]+)/([\d.]+) GiB\) on kv cache allocation")
KV_BLOCK_TOKENS = 128  # vLLM-CPU's block; a GPU's is 16, so the figure below is generous there


@dataclass(frozen=True)
class VLLMConfig:
    kv_cache_gb: float = f(1.0, "KV cache per worker's engine, GiB (vLLM's kv_cache_memory_bytes)")
    compile: bool = f(False, "let vLLM compile its model and capture CUDA graphs (its default; minutes at start "
                             "on a CPU); false = enforce_eager")
    dtype: str = f("auto", "the engine's weights and KV cache: auto (bfloat16 on a GPU, float32 on a CPU), float32, "
                           "bfloat16")
    gpu_memory_utilization: float = f(0.4, "on a GPU: the share of its memory vLLM may hold (it checks at start that "
                                           "this much is free; the trainer's policy and optimizer share the GPU)")

    def __post_init__(self):
        positive(self, "vllm", "kv_cache_gb", "gpu_memory_utilization")
        if self.kv_cache_gb < KV_CACHE_MIN_GB:  # fewer bytes than one: vLLM on a GPU would read 0 as unset
            raise ConfigError(f"vllm.kv_cache_gb must be >= {KV_CACHE_MIN_GB:g} (a KiB), got {self.kv_cache_gb:g}")
        at_most(self, "vllm", 1, "gpu_memory_utilization")
        at_most(self, "vllm", 4096, "kv_cache_gb")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"vllm.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(field: str = "rollout.backend=vllm") -> None:
    """One line, before anything is written, when vLLM is not importable here."""
    if not vllm_installed():
        raise ConfigError(f"{field}: vLLM is not installed in this Python ({sys.executable}); create its "
                          f"environment with `{VLLM_SETUP}` and run tailtamer from it ({VLLM_ENV}/bin/tailtamer)")


def check_strategies(spec) -> None:
    """The arms vLLM can run: chains, K = depth drafts, all K + 1 verified."""
    if spec.mode == "off":
        return
    if spec.drafter == "suffix":
        raise ConfigError("spec.drafter=suffix runs on rollout.backend=tailtamer: vLLM's suffix method needs the "
                          "arctic-inference package, which vLLM-CPU lacks; on vLLM use an EAGLE drafter or "
                          "spec.drafter=ngram (vLLM's prompt lookup, the request's own text)")
    names = spec.in_use
    field = spec.in_use_field
    suffix = [n for n in names if (s := Strategy.parse(n)).model_free or s.suffix]
    if suffix:
        raise ConfigError(f"{field} {', '.join(suffix)}: suffix drafts (sD_K_N, D_K_N+sM) run on "
                          f"rollout.backend=tailtamer; vLLM drafts EAGLE chains (e.g. {', '.join(VLLM_STRATEGIES)})")
    shaped = [n for n in names if Strategy.parse(n).confidence]
    if shaped:
        raise ConfigError(f"{field} {', '.join(shaped)}: vLLM drafts chains of a fixed length per step; a depth "
                          f"shaped by the drafter's confidence (@) runs on rollout.backend=tailtamer")
    trees = [n for n in names if (s := Strategy.parse(n)).topk != 1 or s.verify != s.depth + 1]
    if trees:
        raise ConfigError(f"{field} {', '.join(trees)}: vLLM drafts chains only, DEPTH_1_DEPTH+1 (e.g. "
                          f"{', '.join(VLLM_STRATEGIES)}), not trees")
    if spec.compile:
        raise ConfigError("spec.compile compiles our engine's draft chains; with rollout.backend=vllm use vllm.compile")


def check_model(model_cfg, device_type: str, where: str) -> None:
    """A model vLLM cannot run is one line at start-up, not an error deep in its start."""
    if device_type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if model_cfg.head_size not in sizes:
            raise ConfigError(f"{where}: head size {model_cfg.head_size} (hidden {model_cfg.hidden_size} / "
                              f"{model_cfg.num_attention_heads} heads); vLLM's CPU attention runs {sizes}")


def check_params(params: SamplingParams, speculates: bool, device_type: str) -> None:
    """Sampling settings the vLLM backend cannot run, refused before anything starts."""
    if params.temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(f"temperature {params.temperature}: vLLM samples at temperatures up to "
                          f"{VLLM_MAX_TEMPERATURE:g}")
    if params.stop:
        raise ConfigError("stop strings need a tokenizer inside the engine; the vLLM backend runs on token ids "
                          "(end responses with the model's EOS ids)")
    if params.top_k and speculates and device_type == "cpu":
        raise ConfigError("top-k with speculative decoding fails inside vLLM-CPU 0.32 (its rejection sampler "
                          "reduces an empty top-k tensor when a step has no drafts): use top-p, or speculation off")


def initial_table(depths: list[int], max_batch_size: int) -> list[list[int]]:
    """The per-batch-size draft lengths vLLM starts with: every arm's K at some batch size
    (where vLLM captures CUDA graphs for the lengths its table holds), then K = 0 for the rest;
    generate() rewrites the table at every step."""
    table = [[i + 1, i + 1, k] for i, k in enumerate(depths[:max_batch_size])]
    return table + [[len(table) + 1, max_batch_size, 0]] if len(table) < max_batch_size else table


def kv_cache_too_small(cfg: VLLMConfig, model_cfg, drafts: bool, dtype: torch.dtype) -> str:
    """The refusal of a vllm.kv_cache_gb below one request of the model's whole context, with a
    size that holds it: that request's keys and values (the target's layers and the drafter's)
    in whole blocks, with the one block vLLM keeps empty, and a quarter more."""
    layers = model_cfg.num_hidden_layers + int(drafts)
    blocks = -(-model_cfg.max_position_embeddings // KV_BLOCK_TOKENS) + 1
    need = 2 * layers * blocks * KV_BLOCK_TOKENS * model_cfg.num_key_value_heads * model_cfg.head_size \
        * dtype.itemsize
    enough = 1.25 * need / (1 << 30)
    digit = 10 ** (math.floor(math.log10(enough)) - 1)  # rounded up to two significant digits
    enough = math.ceil(enough / digit) * digit
    return (f"vllm.kv_cache_gb={cfg.kv_cache_gb:g} cannot hold one request of the model's context "
            f"({model_cfg.max_position_embeddings:,} tokens): give {enough:.2g} or more")


def token_budget(max_batch_size: int, max_model_len: int, whole_prefill: bool) -> dict:
    """vLLM's max_num_batched_tokens where its default for this machine (4,096 on a CPU) is
    below rollout.max_batch_size, which vLLM refuses (every running request schedules a token
    a step): raised to the batch size, and to the context where prompts are prefilled whole
    (`whole_prefill`: chunked prefill off). Elsewhere vLLM keeps its own."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    default = EngineArgs.get_batch_defaults(world_size=1)[0].get(UsageContext.LLM_CLASS, 0)
    if max_batch_size <= default:
        return {}
    return {"max_num_batched_tokens": max(max_batch_size, max_model_len if whole_prefill else 0)}


def bias_free(drafter):
    """`drafter` as vLLM's EAGLE loader runs it: without an fc bias. A zero bias (a drafter
    saved with one that was never trained) is dropped, so training keeps it absent; a trained
    one is refused at start-up (`vllm_drafter_tensors`)."""
    if drafter is None or drafter.fc.bias is None:
        return drafter
    vllm_drafter_tensors(drafter)  # refuses a trained bias
    from tailtamer.model.drafter import Drafter

    out = Drafter(drafter.target, fc_bias=False).to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    out.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "fc.bias"})
    return out.train(drafter.training)


def vllm_drafter_tensors(drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors as vLLM's EAGLE loader takes them: no fc.bias, which it lacks. A
    bias of zeros (a drafter trained without one and saved by an older tailtamer) is dropped;
    a trained one cannot be, and is an error rather than a silently different drafter."""
    tensors = drafter_tensors(drafter)
    bias = tensors.pop("fc.bias", None)
    if bias is not None and bias.abs().max() > 0:
        raise ConfigError("the drafter has a trained fc.bias, which vLLM's EAGLE loader has no place for (its fc "
                          "has none): train the drafter for vLLM without it (`tailtamer drafter train --no-fc-bias`; "
                          "spec.drafter=builtin does so for rollout.backend=vllm)")
    return tensors


def export_vllm_drafter(drafter, out_dir: str | Path) -> None:
    """A drafter directory that vLLM's EAGLE loader reads as it is (`EagleLlamaForCausalLM`)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = vllm_drafter_tensors(drafter)
    atomic_write(out_dir / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    hf = drafter.config.to_hf()
    hf.update(architectures=[VLLM_EAGLE_ARCHITECTURE], model_type="llama", qkv_bias=drafter.config.qkv_bias)
    atomic_write_json(out_dir / "config.json", hf)


def policy_tensors(model) -> dict[str, torch.Tensor]:
    """The policy's tensors under transformers' names, as its checkpoint holds them."""
    cfg = model.config
    return {to_hf_key(k): v.detach() for k, v in split_fused(model.state_dict(), cfg).items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


class VLLMLog:
    """Where vLLM's own log goes. To a file: its warnings, and the dump of its whole scheduler
    state (several hundred kilobytes) it writes when a step fails, which on the terminal would
    bury tailtamer's one-line error; the error names the file. Without a file, to the terminal
    at ERROR (VLLM_LOGGING_LEVEL sets another level). tailtamer sets the "vllm" logger up itself
    and starts vLLM with its own set-up off (a VLLM_LOGGING_CONFIG_PATH is not read), because
    vLLM's would replace these handlers whenever an engine starts. In a process with several
    engines the latest one's log is in force; closing it puts back the one before."""

    _open: list["VLLMLog"] = []
    _original: tuple = ()  # the logger's handlers, level and propagation before the first

    def __init__(self, path: str | Path | None = None, who: str = ""):
        self.path = Path(path) if path is not None else None
        if self.path is None:
            self.handler = logging.StreamHandler(sys.stderr)
            self.level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper())
        else:  # opened at vLLM's first line in this process (`note`)
            self.handler = logging.FileHandler(self.path, encoding="utf-8", delay=True)
            self.level = logging.WARNING
        self.handler.setFormatter(logging.Formatter(f"%(asctime)s {who}%(levelname)s %(name)s: %(message)s"))
        logger = logging.getLogger("vllm")
        if not VLLMLog._open:
            VLLMLog._original = (list(logger.handlers), logger.level, logger.propagate)
        VLLMLog._open.append(self)
        self._apply()

    @staticmethod
    def _apply() -> None:
        logger = logging.getLogger("vllm")
        if VLLMLog._open:
            top = VLLMLog._open[-1]
            logger.handlers, logger.propagate = [top.handler], False
            logger.setLevel(top.level)
        else:
            handlers, level, logger.propagate = VLLMLog._original
            logger.handlers = handlers
            logger.setLevel(level)

    def note(self) -> str:
        """" (vLLM's log: FILE)" when vLLM wrote to the file in this process, else ""."""
        written = self.path is not None and getattr(self.handler, "stream", None) is not None
        return f" (vLLM's log: {self.path})" if written else ""

    def close(self) -> None:
        if self in VLLMLog._open:
            VLLMLog._open.remove(self)
            self.handler.close()
            VLLMLog._apply()


class VLLMBackend:
    name = "vllm"
    hidden_states = False  # vLLM's EAGLE path returns no hidden states: the drafter learns from the update's forward

    def __init__(self, model_dir: str | Path, model, tokenizer, spec, drafter, cfg: VLLMConfig,
                 max_batch_size: int, seed: int = 0, eos_ids: tuple[int, ...] | None = None,
                 log_file: str | Path | None = None, log_prefix: str = ""):
        """`model` and `drafter`: the trainer's modules (what a publish pushes and checks);
        the engine starts from `model_dir` and the drafter as it is now. `log_file`: where
        vLLM's own log goes (each line marked with `log_prefix`); None: the terminal, at ERROR
        (without a tokenizer in the engine, token ids in and out, its start logs a warm-up
        traceback at WARNING; and stdout carries `train`'s summary and `generate`'s line)."""
        require_vllm()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: the scheduler and weights are reachable
        import vllm

        self._vllm = vllm
        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter
        self.notice = None
        self.eos_ids = tuple(eos_ids if eos_ids is not None else model.config.eos_ids or
                             ((tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()))
        self.max_seq_len = model.config.max_position_embeddings
        device_type = model.device.type
        check_model(model.config, device_type, f"model {model_dir}")
        self.tuner, self.bs_threshold, self.llm, self._dir = None, None, None, None
        self._log = VLLMLog(log_file, log_prefix)
        try:
            with warnings.catch_warnings(record=self._log.path is not None) as said:  # vLLM's, into its log
                self._start(vllm, model_dir, spec, drafter, cfg, max_batch_size, seed, device_type)
            for w in said or ():
                logging.getLogger("vllm").warning("%s: %s", w.category.__name__, w.message)
        except BaseException as e:
            note, drafts = self._log_note(), self._dir is not None
            self.close()
            if isinstance(e, (ConfigError, KeyboardInterrupt)):
                raise
            if str(e).startswith(KV_CACHE_TOO_SMALL):
                raise ConfigError(kv_cache_too_small(cfg, model.config, drafts, self.dtype)) from None
            free = KV_CACHE_TOO_BIG.match(str(e))
            if free:
                raise ConfigError(f"vllm.kv_cache_gb={cfg.kv_cache_gb:g} is more than this machine has free ({free[1]} "
                                  f"of {free[2]} GiB): lower it") from None
            if isinstance(e, torch.OutOfMemoryError):  # a GPU's: vLLM checks free memory only on a CPU
                raise ConfigError(f"vLLM ran out of memory on {device_type} starting with its whole KV cache, "
                                  f"vllm.kv_cache_gb={cfg.kv_cache_gb:g}, beside the model's weights: lower it") from None
            raise RolloutBackendError(f"vLLM could not start on {model_dir}: {_first_line(e)}{note}") from None

    def _start(self, vllm, model_dir, spec, drafter, cfg: VLLMConfig, max_batch_size: int, seed: int,
               device_type: str) -> None:
        from vllm.config import LoggingConfig

        speculative = None
        if spec.mode != "off":
            check_strategies(spec)
            self.tuner = spec.make_tuner()
            if spec.mode == "adaptive":
                self.bs_threshold = VLLM_BS_THRESHOLD if spec.bs_threshold is None else spec.bs_threshold
            depths = sorted({s.depth for s in self.tuner.strategies}, reverse=True)
            speculative = {"num_speculative_tokens": depths[0], "rejection_sample_method": "standard",
                           "num_speculative_tokens_per_batch_size": initial_table(depths, max_batch_size)}
            if spec.drafter == "ngram":
                speculative.update(method="ngram", prompt_lookup_max=4, prompt_lookup_min=1)
            else:
                self._dir = tempfile.mkdtemp(prefix="tailtamer-vllm-drafter-")
                export_vllm_drafter(drafter, self._dir)
                speculative.update(method="eagle", model=self._dir)
        dtype = cfg.dtype if cfg.dtype != "auto" else ("float32" if device_type == "cpu" else "bfloat16")
        self.dtype = getattr(torch, dtype)
        chunked = generators_rewind(self.model.device)
        self.llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                            enforce_eager=not cfg.compile, max_model_len=self.max_seq_len, max_num_seqs=max_batch_size,
                            kv_cache_memory_bytes=int(cfg.kv_cache_gb * (1 << 30)),
                            gpu_memory_utilization=cfg.gpu_memory_utilization,
                            # every request is seeded: where its generator cannot be rewound after a
                            # chunk's dropped sample (a CPU's), prompts are prefilled whole
                            enable_chunked_prefill=chunked,
                            disable_log_stats=False, speculative_config=speculative,
                            use_tqdm_on_load=self._log.path is None,  # with a log file, no bars on the terminal
                            **token_budget(max_batch_size, self.max_seq_len, whole_prefill=not chunked),
                            # VLLMLog's handler stays: vLLM's own set-up would replace it
                            logging_config=LoggingConfig(configure_logging=False, pylogging_config_file=None))
        if device_type == "cpu" and speculative is not None:
            fix_cpu_expand()
        self._engine = self.llm.llm_engine
        self._table = self._engine.engine_core.engine_core.scheduler.dynamic_sd_lookup if speculative else None
        self._k = -1
        self._set_k(0)  # generate() writes K for each step

    # --- rollout ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_index: int = 0,
                 keep_hidden=None, labels: list[str] | None = None) -> tuple[list[Completion], RolloutStats]:
        check_params(params, self._table is not None, self.model.device.type)
        if not prompts:
            raise DataError("no prompts to generate from")
        vllm, engine = self._vllm, self._engine
        requests, run = {}, uuid.uuid4().hex[:8]
        for i, ids in enumerate(prompts):  # every prompt before any work starts
            check_prompt(ids, labels[i] if labels else f"prompt {i}", self.max_seq_len)
        try:
            for i, ids in enumerate(prompts):
                for j in range(params.n):
                    sampling = vllm.SamplingParams(
                        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                        max_tokens=min(params.max_new_tokens, self.max_seq_len - len(ids)),
                        seed=None if params.greedy else request_key(params.seed, first_index + i, j),
                        stop_token_ids=list(self.eos_ids), detokenize=False,
                        output_kind=vllm.sampling_params.RequestOutputKind.DELTA)
                    rid = f"{run}-{i}-{j}"
                    requests[rid] = Completion(i, j, [], "", "length")
                    engine.add_request(rid, {"prompt_token_ids": list(ids)}, sampling)
            return self._run(requests)
        except BaseException as e:
            self._abort(list(requests))  # a later generate must not find this one's requests running
            if isinstance(e, (RolloutBackendError, KeyboardInterrupt)):
                raise
            raise RolloutBackendError(f"vLLM failed during the rollout: {_first_line(e)}{self._log_note()}") from None

    def _abort(self, request_ids: list[str]) -> None:
        try:
            self._engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 (the engine is dead: the error being raised says so)
            pass
        self._set_k(0)

    def _run(self, requests: dict[str, Completion]) -> tuple[list[Completion], RolloutStats]:
        engine, stats = self._engine, RolloutStats()
        before = self._counters()
        start = time.perf_counter()
        arm, chosen_at = None, 0  # the arm whose drafts the next step verifies, and the batch size it was chosen for
        while engine.has_unfinished_requests():
            running = engine.get_num_unfinished_requests()
            tail = self.tuner is not None and (self.bs_threshold is None or running <= self.bs_threshold)
            chosen = self.tuner.select(running) if tail else None
            self._set_k(chosen.depth if chosen is not None else 0)
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            emitted, prefill = 0, False
            for out in outputs:
                c, delta = requests[out.request_id], out.outputs[0]
                prefill |= not c.token_ids
                c.token_ids.extend(delta.token_ids)
                emitted += len(delta.token_ids)
                if out.finished:
                    if delta.finish_reason not in ("stop", "length"):
                        raise RolloutBackendError(f"vLLM ended request {out.request_id} with {delta.finish_reason!r}"
                                                  f"{self._log_note()}")
                    c.finish_reason = delta.finish_reason
            if prefill:
                stats.prefill_s += t1 - t0
            else:
                if chosen_at:  # 0: the arm was chosen outside the tail (plain)
                    self.tuner.record(arm, chosen_at, t1 - t0, emitted)
                stats.record_step(t1 - start, t1 - t0, running, arm.name if arm is not None else "plain", emitted)
            arm, chosen_at = chosen, running if tail else 0
        self._set_k(0)
        stats.seconds = time.perf_counter() - start
        done = sorted(requests.values(), key=lambda c: (c.prompt_index, c.sample_index))
        for c in done:
            c.text = self.tokenizer.decode(c.token_ids) if self.tokenizer is not None else ""
        stats.tokens = sum(len(c.token_ids) for c in done)
        self._spec_stats(stats, before, self._counters())
        return done, stats

    def _set_k(self, k: int) -> None:
        if self._table is not None and k != self._k:
            self._table[:] = [k] * len(self._table)
            self._k = k

    def _counters(self) -> dict[str, object]:
        if self._table is None:
            return {}
        return {m.name: getattr(m, "values", getattr(m, "value", None)) for m in self.llm.get_metrics()
                if m.name.startswith("vllm:spec_decode")}

    @staticmethod
    def _spec_stats(stats: RolloutStats, before: dict, after: dict) -> None:
        """The rollout's accept-length histogram from vLLM's counters: of D drafts, a_d accepted
        at least d tokens, so a_d − a_(d+1) emitted d + 1 tokens (a_0 = D)."""
        if not after:
            return
        delta = lambda name: after[name] - before.get(name, 0)  # noqa: E731
        drafts = delta("vllm:spec_decode_num_drafts")
        per_pos = [a - b for a, b in zip(after["vllm:spec_decode_num_accepted_tokens_per_pos"],
                                         before.get("vllm:spec_decode_num_accepted_tokens_per_pos") or
                                         [0] * len(after["vllm:spec_decode_num_accepted_tokens_per_pos"]))]
        at_least = [drafts] + per_pos + [0]
        for d in range(len(at_least) - 1):
            if at_least[d] - at_least[d + 1]:
                stats.accept_lens[d + 1] = at_least[d] - at_least[d + 1]
        stats.depth_accepts = {d + 1: n for d, n in enumerate(per_pos) if n}
        stats.drafted_tokens = delta("vllm:spec_decode_num_draft_tokens")
        stats.accepted_tokens = delta("vllm:spec_decode_num_accepted_tokens")

    # --- publishing ---------------------------------------------------------------------------

    def publish_policy(self, model) -> None:
        tensors = policy_tensors(model)
        self._push("policy", tensors, tensors)

    def publish_drafter(self, drafter) -> None:
        if self._dir is None:
            return
        tensors = vllm_drafter_tensors(drafter)  # under the names vLLM's EAGLE loader takes (it adds `model.`)
        expected = {f"model.{k}": v for k, v in tensors.items()}
        # the drafter's embedding and LM head are the policy's: vLLM must share them too
        policy = policy_tensors(self.model)
        expected["model.embed_tokens.weight"] = policy["model.embed_tokens.weight"]
        expected["lm_head.weight"] = policy.get("lm_head.weight", policy["model.embed_tokens.weight"])
        self._push("drafter", tensors, expected)

    def _push(self, part: str, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        try:
            self.llm.collective_rpc(load_weights, args=(part, [(k, v.cpu()) for k, v in tensors.items()]))
            self._engine.reset_prefix_cache()  # its KV rows were computed by the old weights
            engine = self.llm.collective_rpc(probe, args=(part,))[0]
        except Exception as e:  # noqa: BLE001
            raise RolloutBackendError(f"vLLM failed while taking the new {part}: {_first_line(e)}"
                                      f"{self._log_note()}") from None
        self.check(part, engine, expected)

    def check(self, part: str, engine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
        """The engine's probe against the pushed tensors; a RolloutBackendError if they differ."""
        name, worst = probe_mismatch(engine, expected_probe(engine, expected), PROBE_TOLERANCE[self.dtype])
        if name is not None:
            raise RolloutBackendError(f"vLLM does not run the {part} that was just published: its {name} differs from "
                                      f"the pushed weights (largest relative difference {worst:.3g}); the run stops "
                                      f"rather than roll out with a stale {part}")
        return worst

    def _log_note(self) -> str:
        return self._log.note() if self._log is not None else ""

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            self.llm = self._engine = None
            gc.collect()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._log is not None:
            self._log.close()
            self._log = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"

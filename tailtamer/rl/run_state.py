"""What a worker of `tailtamer train` holds for a run (`RunState`), and how it is loaded:
the built-ins resolved once (`prepare`), then the data, model, optimizer, engine, reward
scorer and adaptive drafter (`setup`), after a memory estimate that refuses a run that cannot
fit before anything is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tailtamer.config import TrainConfig
from tailtamer.device import device_memory, resolve_device, train_device, train_dtype
from tailtamer.dist import Workers
from tailtamer.drafter.adaptive import AdaptiveDrafter, NoDrafter
from tailtamer.errors import CheckpointError, ConfigError, DataError
from tailtamer.jsonl import check_file
from tailtamer.memory import available_memory, check_fits, estimate_for, format_estimate
from tailtamer.metrics import check_loggers
from tailtamer.model.dirs import check_run_model
from tailtamer.model.drafter import check_drafter_dir, check_drafter_fits, load_drafter
from tailtamer.model.io import check_tokenizer_fits, load_config, load_model
from tailtamer.model.tokenizer import load_tokenizer
from tailtamer.rl.checkpoint import checkpoint_step, earlier_checkpoint_hint, latest_checkpoint, load_checkpoint
from tailtamer.rl.data import (PromptOrder, check_builtin_fits, context_cut, datasets, evaluates, held_out_count,
                               read_rows, unread_data)
from tailtamer.rl.optim import make_optimizer
from tailtamer.rl.rewards import BUILTIN_REWARDS, RewardScorer, check_routes, user_reward_target
from tailtamer.rl.run_dir import DEFAULT_NAME, REWARD_LOG, VLLM_LOG, check_run_files
from tailtamer.rl.sharding import SHARDINGS, Replicated
from tailtamer.rollout.backend import EmbeddedBackend
from tailtamer.rollout.draft_history import FILE as HISTORY_FILE, DraftHistory
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.speculative import Strategy
from tailtamer.rollout.speculator import make_speculator
from tailtamer.rollout.vllm_backend import check_model, require_vllm, vllm_arms


@dataclass
class RunState:
    cfg: TrainConfig
    run_dir: Path
    model: torch.nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    rollout: EmbeddedBackend  # the rollout backend (rollout/backend.py): our engine, or vLLM's
    scorer: RewardScorer
    train_rows: list[dict]
    eval_rows: list[dict]
    order: PromptOrder  # which training rows each step takes
    sharding: Replicated  # how the update's copy of the policy lies over the workers (run.shard)
    workers: Workers = field(default_factory=Workers)
    ref_model: torch.nn.Module | None = None
    drafter: AdaptiveDrafter | NoDrafter = field(default_factory=NoDrafter)  # the adaptive drafter, or none trained
    dtype: torch.dtype = torch.float32  # of the training forwards (run.dtype; weights stay float32)
    step: int = 0
    saved_step: int | None = None  # the step of the newest checkpoint
    bad_steps: int = 0
    skipped_prompts: int = 0
    history: list[dict] = field(default_factory=list)
    eval_at_start: float | None = None
    draft_history: DraftHistory | None = None  # earlier responses the suffix index drafts from


def prompt_limit(cfg: TrainConfig, context: int) -> int:
    """Longer prompts are skipped: data.max_prompt_tokens, or the model's context less the
    one token a response needs at least."""
    return min(cfg.data.max_prompt_tokens, context - 1)


def training_prompts(cfg: TrainConfig) -> int:
    """How many prompts a step of `cfg` can share out, counted cheaply for the launcher:
    rollout.prompts_per_step, or the training rows less the held-out split when fewer. Prompts
    too long for the model are not subtracted (that takes the tokenizer); `setup` counts them."""
    if cfg.data.train == "builtin":
        rows = cfg.data.n_builtin
    else:
        rows = len(read_rows(cfg.data.train))
        rows -= held_out_count(cfg, rows)
    return min(cfg.rollout.prompts_per_step, rows)


def check_startable(cfg: TrainConfig, resume: Path | None, world: int) -> None:
    """Before anything is loaded, written or spawned (a first run's base model takes minutes):
    a resume must have steps to go and its run's files must be files, the files the run reads
    must be there (`check_inputs`), and the built-in problems must fit in each of `world`
    workers' share of memory."""
    checkpoint = None
    if resume is not None:
        check_run_files(resume)
        checkpoint = latest_checkpoint(resume)
        done = checkpoint_step(checkpoint)
        if done >= cfg.run.steps:
            raise ConfigError(f"--resume {resume}: the run is at step {done} and run.steps is {cfg.run.steps}, so "
                              f"there is nothing to train; give run.steps={done + 1} or more to go on")
    check_inputs(cfg, checkpoint, world)
    check_builtin_fits(cfg, machine_share(available_memory("cpu"), world))


def saved_drafter(checkpoint: Path | None) -> Path | None:
    """The drafter a run resumed from `checkpoint` goes on with (its `drafter/`), or None."""
    return checkpoint / "drafter" if checkpoint is not None and (checkpoint / "drafter").is_dir() else None


def reads_spec_drafter(cfg: TrainConfig, saved: Path | None, world: int) -> bool:
    """Whether a run loads spec.drafter: to draft with, unless it resumes with the drafter it
    saved (`saved`), and as the frozen drafter the trained one is compared with."""
    return cfg.spec.eagle and (saved is None or (cfg.spot.compare_frozen and cfg.spot.trains(True, world)))


def check_inputs(cfg: TrainConfig, checkpoint: Path | None = None, world: int = 1) -> None:
    """The model, drafter, data and reward files a run reads are there, each named by its
    field, before anything loads (a worker would find them only after the launcher's set-up).
    A run resumed from `checkpoint` reads spec.drafter as `reads_spec_drafter` says."""
    drafter = cfg.spec.drafter
    reads_drafter = drafter != "builtin" and reads_spec_drafter(cfg, saved_drafter(checkpoint), world)
    target = None
    if cfg.run.model is not None:
        check_run_model(cfg.run.model)
        try:
            target = load_config(cfg.run.model) if reads_drafter else None
        except CheckpointError as e:
            raise ConfigError(f"run.model {e}") from None
    if reads_drafter:
        if target is None:  # the built-in base model: its config is known once it is trained
            check_drafter_dir(drafter, f"spec.drafter {drafter}")
        else:
            check_drafter_fits(drafter, target, f"spec.drafter {drafter}")
    for name in ("train", "eval") if evaluates(cfg) else ("train",):
        path = getattr(cfg.data, name)
        if path not in (None, "builtin"):
            try:
                check_file(Path(path))
            except DataError as e:
                raise DataError(f"data.{name} {e}") from None
    for spec in cfg.rl.reward:
        if isinstance(spec, str) and spec not in ("auto", *BUILTIN_REWARDS):
            user_reward_target(spec)


def prepare(cfg: TrainConfig, log=print) -> TrainConfig:
    """Resolve the built-ins into paths, once, before workers load anything: the base model
    (trained by `tailtamer sft` on first use) and its warm-up drafter."""
    vllm = cfg.rollout.backend == "vllm"
    if vllm:
        require_vllm()
    model = cfg.run.model
    if model is None:
        from tailtamer.sft import SFTConfig, ensure_base_model

        # vLLM's CPU attention runs no head size below 32: its twin of the base model (model/config.py)
        model = str(ensure_base_model(SFTConfig(preset="base-vllm" if vllm else "base"), log=log))
    if vllm:
        check_model(load_config(model), resolve_device(cfg.run.device, "run.device").type, f"run.model {model}")
    spec = cfg.spec
    if spec.drafter == "builtin" and spec.mode != "off":
        from tailtamer.drafter.train import DrafterTrainConfig, ensure_builtin_drafter

        drafter_dir = ensure_builtin_drafter(Path(model), DrafterTrainConfig(fc_bias=not vllm), log=log)
        spec = replace(spec, drafter=str(drafter_dir))
    return replace(cfg, run=replace(cfg.run, model=model), spec=spec)


def unread_spot(cfg: TrainConfig) -> list[str]:
    """spot.single_worker=window where no EAGLE drafter trains online (SD off, a model-free
    drafter, or spot.train=false)."""
    if cfg.spot.single_worker != "window" or cfg.spot.trains(cfg.spec.eagle, 1):
        return []
    why = ("spot.train=false" if cfg.spec.eagle else "spec.mode=off" if cfg.spec.mode == "off"
           else f"spec.drafter={cfg.spec.drafter} is model-free")
    return [f"spot.single_worker=window is not read: {why}, so no EAGLE drafter trains online"]


def say_unread(cfg: TrainConfig, log=print) -> None:
    """The spec, spot and data settings this run does not read (`SpecConfig.unread`,
    `unread_spot`, `unread_data`), once per run."""
    filled = vllm_arms(cfg.spec.drafter) if cfg.rollout.backend == "vllm" else {}
    for line in cfg.spec.unread(filled) + unread_spot(cfg) + unread_data(cfg):
        log(line)


def setup(cfg: TrainConfig, resume: Path | None = None, log=print, workers: Workers | None = None) -> RunState:
    """Load everything a worker needs for `cfg` (already `prepare`d)."""
    workers = workers or Workers(device=train_device(cfg.run.device, 0))
    check_loggers(cfg.run.loggers)
    run_dir = run_dir_of(cfg, resume)
    model_dir = Path(cfg.run.model)
    tokenizer = load_tokenizer(model_dir)
    model_cfg = load_config(model_dir)
    check_tokenizer_fits(tokenizer, model_cfg, model_dir)
    context = model_cfg.max_position_embeddings
    train_rows, eval_rows, skipped = datasets(cfg, tokenizer, prompt_limit(cfg, context), log)
    cut = context_cut(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}", cfg.rollout.max_new_tokens, context,
                      max(len(r["prompt_ids"]) for r in train_rows + eval_rows), "as truncated")
    if cut:
        log(cut)
    prompts = min(cfg.rollout.prompts_per_step, len(train_rows))
    if prompts < cfg.rollout.prompts_per_step:
        samples = prompts * cfg.rollout.group_size
        if samples % cfg.rl.minibatches:
            raise ConfigError(f"rl.minibatches ({cfg.rl.minibatches}) must divide a step's {samples} samples: "
                              f"{cfg.data.train} has {prompts} training prompts, fewer than rollout.prompts_per_step="
                              f"{cfg.rollout.prompts_per_step}, times rollout.group_size={cfg.rollout.group_size}")
        log(f"{cfg.data.train} has {prompts} training prompt{'s' * (prompts != 1)}, fewer than "
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step}: every step rolls out "
            f"{'all ' * (prompts != 1)}{prompts}")
    if prompts < workers.world:
        more = " and ".join(fix for fix, short in (("raise rollout.prompts_per_step", cfg.rollout.prompts_per_step),
                                                   ("add prompts to data.train", len(train_rows))) if short < workers.world)
        # `tailtamer train` caps an automatic count itself; torchrun's count is its own.
        started = ("torchrun started", f"start at most {prompts} processes") if "TORCHELASTIC_RUN_ID" in os.environ \
            else ("run.workers:", f"set run.workers={prompts}")
        raise ConfigError(f"{started[0]} {workers.world} workers but only {prompts} prompts per step "
                          f"(rollout.prompts_per_step={cfg.rollout.prompts_per_step}, {len(train_rows)} training "
                          f"prompts in {cfg.data.train}); every worker needs a prompt to roll out: "
                          f"{started[1]} or {more}")
    device = workers.device  # resolved once, by whoever made the worker (run_worker, train)
    dtype = train_dtype(cfg.run.dtype, device)
    # Before loading anything: what each worker will hold, and a refusal if it cannot fit.
    need = estimate_for(cfg, model_cfg, workers.world, dtype.itemsize, device_type=device.type)
    available = available_memory(device.type, lambda: device_memory(device))
    if device.type == "cpu":
        available = machine_share(available, workers.world)
    log(format_estimate(need, available))
    check_fits(need, available, str(device))
    sharding = SHARDINGS[cfg.run.shard](workers)
    if "auto" in cfg.rl.reward:
        check_routes(train_rows, cfg.data.train)
        check_routes(eval_rows, cfg.data.eval or cfg.data.train)
    # A reward function's prints (verl's print samples now and then) would tear the console's
    # step lines and progress bar apart: they go to the run directory (where this worker sees it).
    own = [spec for spec in cfg.rl.reward if spec not in ("auto", *BUILTIN_REWARDS)]
    output = run_dir / REWARD_LOG if own and run_dir.is_dir() else None
    if output is not None:
        log(f"rl.reward: what {' and '.join(own)} print{'s' * (len(own) == 1)} goes to {output}")
    scorer = RewardScorer(cfg.rl.reward, cfg.rl.reward_timeout_s, cfg.rl.reward_weights, output=output)
    # The optimizer steps the copy the update trains: the engine's module itself, or its shards.
    make_opt = lambda model: make_optimizer(sharding.wrap(model), cfg.rl, cfg.run.steps)  # noqa: E731
    state = {"step": 0}
    if resume is not None:
        checkpoint = latest_checkpoint(run_dir)
        try:
            model, optimizer, scheduler, state = load_checkpoint(checkpoint, make_opt, device=device,
                                                                 load_optimizer_state=sharding.load_optimizer_state)
        except CheckpointError as e:
            raise CheckpointError(f"{e}{earlier_checkpoint_hint(checkpoint)}") from None
        log(f"resuming {run_dir} from {checkpoint.name}")
    else:
        model = load_model(model_dir, device=device)  # float32: the master weights the rollout also runs
        optimizer, scheduler = make_opt(model)
    sharding.policy.grad_checkpointing = cfg.rl.grad_checkpointing
    ref_model = load_model(model_dir, dtype, device).requires_grad_(False) if cfg.rl.kl_coef > 0 else None
    resumed_drafter = saved_drafter(checkpoint if resume is not None else None)
    vllm_log = (run_dir / VLLM_LOG, f"worker {workers.rank} ") if run_dir.is_dir() else (None, "")
    history = None
    if cfg.rollout.backend == "tailtamer":  # each worker keeps its own, in the machine's memory
        history = cfg.spec.make_history(model_cfg.vocab_size, machine_share(available_memory("cpu"), workers.world),
                                        local_workers(workers.world))
    if history is not None and resume is not None:
        if cfg.spec.history_on_resume == "fresh":
            log("spec.history_on_resume=fresh: the suffix drafts start without the checkpoint's history")
        elif os.path.lexists(checkpoint / HISTORY_FILE):  # load refuses a directory or broken link, as a corrupt file
            history.load(checkpoint / HISTORY_FILE, workers.rank, workers.world)
        else:
            log(f"{checkpoint.name} holds no draft history: the suffix drafts start without one")
    rollout = make_backend(cfg, model, tokenizer, model_dir, resumed_drafter, resume is not None, vllm_log, history)
    try:
        if cfg.spec.mode == "adaptive" and cfg.spec.bs_threshold is None:  # resolved by the device: say how
            threshold = rollout.bs_threshold
            log(f"spec.bs_threshold unset: on {device.type} with rollout.backend={cfg.rollout.backend}, SD "
                + ("at any batch size (the bandit decides)" if threshold is None else f"at most {threshold} running"))
        adaptive = NoDrafter()
        if cfg.spot.trains(rollout.drafter is not None, workers.world):
            frozen = load_drafter(cfg.spec.drafter, model) if cfg.spot.compare_frozen else None
            score = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
            adaptive = AdaptiveDrafter(rollout.drafter, cfg.spot, workers, cfg.run.seed * 1009 + workers.rank,
                                       Strategy.parse(cfg.spec.fixed).depth, score, frozen)
    except BaseException:
        rollout.close()  # a vLLM engine holds memory (and the drafter's export) until closed
        raise
    order = PromptOrder(len(train_rows), cfg.rollout.prompts_per_step, cfg.run.seed)
    return RunState(cfg, run_dir, model, tokenizer, optimizer, scheduler, rollout, scorer, train_rows, eval_rows,
                    order, sharding, workers, ref_model, adaptive, dtype, step=state["step"], skipped_prompts=skipped,
                    saved_step=state["step"] if resume is not None else None, draft_history=history)


def local_workers(world: int) -> int:
    """How many of the run's `world` workers share this machine's memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def machine_share(available: int | None, world: int) -> int | None:
    """This worker's share of the machine's memory (None: unknown): its workers share it."""
    return available and available // local_workers(world)


def make_backend(cfg: TrainConfig, model, tokenizer, model_dir: Path, resumed_drafter: Path | None, resumed: bool,
                 vllm_log: tuple[Path | None, str] = (None, ""), history: DraftHistory | None = None):
    """The rollout backend of `cfg` (rollout.backend), rolling out `model` (the trainer's own
    module) with spec.drafter, or the drafter a resumed run saved (`resumed_drafter`); vLLM's
    own log goes to `vllm_log` (a file and this worker's prefix for its lines); our engine's
    suffix drafts read `history`."""
    drafter = None
    if cfg.spec.eagle:
        drafter = load_drafter(resumed_drafter or cfg.spec.drafter, model)
    if cfg.rollout.backend == "vllm":
        from tailtamer.rollout.vllm_backend import VLLMBackend, bias_free

        backend = VLLMBackend(model_dir, model, tokenizer, cfg.spec, bias_free(drafter), cfg.vllm,
                              cfg.rollout.max_batch_size, seed=cfg.run.seed, log_file=vllm_log[0],
                              log_prefix=vllm_log[1])
        if resumed:  # the engine started from run.model: the checkpoint's policy goes in
            try:
                backend.publish_policy(model)
            except BaseException:
                backend.close()
                raise
        return backend
    speculator = make_speculator(cfg.spec, model, drafter, history)
    return EmbeddedBackend(Engine(model, tokenizer, EngineConfig(max_batch_size=cfg.rollout.max_batch_size),
                                  speculator=speculator))


def run_dir_of(cfg: TrainConfig, resume: Path | None) -> Path:
    return resume or Path(cfg.run.out_dir) / (cfg.run.name or DEFAULT_NAME)

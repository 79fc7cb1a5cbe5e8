"""The rollout engine: continuous batching over the slots of a static KV cache.

Each request (one sample of one prompt) takes a free cache slot, is prefilled, and then
decodes one token per step alongside every other running request. A finished request frees
its slot at once and the next queued request takes it. Sibling samples admitted together
share one prefill (the prompt's KV rows are copied), which is what GRPO's n samples per
prompt need. Per decode step the engine records the time and the number of running
requests: that timeline is where the long tail shows.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tailtamer.errors import ConfigError, DataError
from tailtamer.model.transformer import KVCache, Transformer
from tailtamer.rollout.sampling import SamplingParams, request_generator, sample, target_probs
from tailtamer.rollout.speculative import Strategy, children_of, walk_tree


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 64  # cache slots = requests decoded together
    max_seq_len: int | None = None  # prompt + response limit; default: the model's context
    max_tokens: int | None = None  # admit while sum(prompt + max_new_tokens) of running requests fits

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"engine.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ConfigError(f"engine.max_tokens must be >= 2, got {self.max_tokens}")


@dataclass
class Request:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    generator: torch.Generator
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_at: int | None = None  # character offset where a stop string begins
    # Speculative decoding with a learned drafter: pairs (h_j, x_{j+1}) it has not seen yet.
    draft_cached: int = 0
    extend_hidden: list = field(default_factory=list)
    extend_tokens: list[int] = field(default_factory=list)

    @property
    def budget(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"


def mean_accept_len(hist: dict[int, int]) -> float:
    """Tokens emitted per request per target forward while speculating (1.0 without SD), from
    a histogram {tokens emitted: request-steps}."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 1.0


@dataclass
class RolloutStats:
    tokens: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    decode_steps: int = 0  # target forwards after prefill (plain or verify)
    sd_steps: int = 0
    sd_seconds: float = 0.0
    plain_seconds: float = 0.0  # decode steps without speculation
    catch_up_s: float = 0.0  # the drafter catching up at each switch to SD (charged to no arm)
    by_strategy: dict[str, dict] = field(default_factory=dict)  # name -> steps, seconds, tokens, request_steps
    accept_lens: dict[int, int] = field(default_factory=dict)  # tokens emitted per request-step -> count
    depth_accepts: dict[int, int] = field(default_factory=dict)  # draft depth d -> request-steps accepting >= d
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    timeline: list[tuple[float, int, str]] = field(default_factory=list)  # (seconds, running, arm) per step

    def record_step(self, end: float, seconds: float, running: int, arm: str, tokens: int) -> None:
        self.decode_steps += 1
        if arm == "plain":
            self.plain_seconds += seconds
        else:
            self.sd_steps += 1
            self.sd_seconds += seconds
            entry = self.by_strategy.setdefault(arm, {"steps": 0, "seconds": 0.0, "tokens": 0, "request_steps": 0})
            entry["steps"] += 1
            entry["seconds"] += seconds
            entry["tokens"] += tokens
            entry["request_steps"] += running
        self.timeline.append((end, running, arm))

    def record_sd(self, emitted: int, drafted: int) -> None:
        self.accept_lens[emitted] = self.accept_lens.get(emitted, 0) + 1
        self.drafted_tokens += drafted
        self.accepted_tokens += emitted - 1
        for d in range(1, emitted):
            self.depth_accepts[d] = self.depth_accepts.get(d, 0) + 1

    @property
    def accept_len_mean(self) -> float:
        return mean_accept_len(self.accept_lens)

    def summary(self) -> dict:
        n = sum(self.accept_lens.values())
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "prefill_s": self.prefill_s,
            "decode_steps": self.decode_steps,
            "sd_steps": self.sd_steps,
            "sd_seconds": self.sd_seconds,
            "plain_seconds": self.plain_seconds,
            "catch_up_s": self.catch_up_s,
            "by_strategy": {k: {**v, "accept_len": v["tokens"] / v["request_steps"]} for k, v in self.by_strategy.items()},
            "accept_len_mean": self.accept_len_mean,
            "accept_len_hist": {str(k): v for k, v in sorted(self.accept_lens.items())},
            "accept_rate_by_position": {str(d): c / n for d, c in sorted(self.depth_accepts.items())} if n else {},
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "timeline": [[round(t, 5), n, arm] for t, n, arm in self.timeline],
        }


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig = EngineConfig(),
                 eos_ids: tuple[int, ...] | None = None, proposer=None, strategy: Strategy | None = None,
                 tuner=None, bs_threshold: int | None = None):
        """Speculative decoding: a `proposer` (EagleProposer / NgramProposer) with either a fixed
        `strategy` or a `tuner` (rollout/tuner.py) that picks one (or plain decoding) per step.
        With `bs_threshold`, steps with more running requests than that decode plainly: SD only
        in the long tail (TLT §2.3)."""
        if strategy is not None and tuner is None:
            from tailtamer.rollout.tuner import FixedTuner

            tuner = FixedTuner(strategy)
        if (proposer is None) != (tuner is None):
            raise ConfigError("speculative decoding needs both a proposer and a strategy (or tuner)")
        if bs_threshold is not None and bs_threshold < 1:
            raise ConfigError(f"spec.bs_threshold must be >= 1, got {bs_threshold}")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.proposer, self.tuner, self.bs_threshold = proposer, tuner, bs_threshold
        if eos_ids is None:
            eos_ids = model.config.eos_ids or (
                (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ())
        self.eos_ids = frozenset(eos_ids)
        self.max_seq_len = min(config.max_seq_len or model.config.max_position_embeddings,
                               model.config.max_position_embeddings)
        self._cache: KVCache | None = None

    def _cache_for(self, slots: int, length: int) -> KVCache:
        c = self._cache
        if c is None or c.slots < slots or c.max_len < length or c.k.dtype != self.model.dtype:
            c = self._cache = KVCache(self.model.config, slots, length, self.model.device, self.model.dtype)
        return c

    def make_requests(self, prompts: list[list[int]], params: SamplingParams,
                      labels: list[str] | None = None, first_index: int = 0) -> list[Request]:
        """Validate every prompt before any work starts; errors name `labels[i]` (e.g. file:row).
        Prompt i samples from the stream of (params.seed, first_index + i, sample): a worker
        given a shard of a batch samples exactly what one engine given the whole batch would."""
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; pass one to Engine")
        requests = []
        for i, ids in enumerate(prompts):
            where = labels[i] if labels else f"prompt {i}"
            if not ids:
                raise DataError(f"{where}: prompt is empty after tokenization")
            if len(ids) >= self.max_seq_len:
                raise DataError(f"{where}: prompt has {len(ids)} tokens; the context holds {self.max_seq_len} "
                                f"(prompt + at least one new token)")
            new = min(params.max_new_tokens, self.max_seq_len - len(ids))
            requests += [Request(i, j, list(ids), request_generator(params.seed, first_index + i, j, self.model.device), new)
                         for j in range(params.n)]
        return requests

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 labels: list[str] | None = None, first_index: int = 0) -> tuple[list[Completion], RolloutStats]:
        if not prompts:
            raise DataError("no prompts to generate from")
        requests = self.make_requests(prompts, params, labels, first_index)
        slots = min(self.config.max_batch_size, len(requests))
        longest = max(r.budget for r in requests)
        if self.proposer is not None:
            strategies = self.tuner.strategies
            verify = max(st.verify for st in strategies)
            draft_rows = max((st.depth - 1) * st.topk for st in strategies)
            # Draft extend right-pads every request to the longest catch-up in the batch (a
            # late-admitted request's whole prompt), so rows can reach twice the longest request.
            self.proposer.reserve(slots, 2 * longest + max(verify, draft_rows) + 1)
            if hasattr(self.proposer, "register"):
                self.proposer.register(requests)
            longest += verify
        cache = self._cache_for(slots, longest)
        queue, running, done = deque(requests), [], []
        stats, start = RolloutStats(), time.perf_counter()
        speculating = False  # was the last step an SD step (then the drafter is caught up)
        while queue or running:
            admitted = self._admit(queue, running, slots)
            if admitted:
                speculating = False
                t0 = time.perf_counter()
                self._prefill(admitted, cache, params)
                stats.prefill_s += time.perf_counter() - t0
                running += admitted
            else:
                tail = self.proposer is not None and (self.bs_threshold is None or len(running) <= self.bs_threshold)
                strategy = self.tuner.select(len(running)) if tail else None
                if strategy is not None and not speculating:
                    # The switch: the drafter catches up on what plain steps and prefills
                    # left, charged to no arm (the first arm pulled would otherwise pay it).
                    t0 = time.perf_counter()
                    if self.proposer.catch_up(running):
                        stats.catch_up_s += time.perf_counter() - t0
                speculating = strategy is not None
                t0, before = time.perf_counter(), sum(len(r.output_ids) for r in running)
                if strategy is not None:
                    self._speculate(running, cache, params, stats, strategy)
                else:
                    self._decode_one(running, cache, params)
                t1 = time.perf_counter()
                emitted = sum(len(r.output_ids) for r in running) - before
                if tail:
                    self.tuner.record(strategy, len(running), t1 - t0, emitted)
                stats.record_step(t1 - start, t1 - t0, len(running), strategy.name if strategy else "plain", emitted)
            done += [r for r in running if r.finish_reason]
            running = self._compact(running, cache)
        stats.seconds = time.perf_counter() - start
        stats.tokens = sum(len(r.output_ids) for r in done)
        done.sort(key=lambda r: (r.prompt_index, r.sample_index))
        return [self._complete(r) for r in done], stats

    def _decode_one(self, running: list[Request], cache: KVCache, params: SamplingParams) -> None:
        """A plain decode step; with a learned drafter it also keeps the pairs (h_j, x_(j+1))
        the target just computed, so switching to SD later needs no extra target forward."""
        device = self.model.device
        ids = torch.tensor([[r.output_ids[-1]] for r in running], device=device)
        starts = torch.tensor([r.cached for r in running], device=device)
        logits, hidden = self.model.decode(ids, cache, slice(0, len(running)), starts)
        self._emit(running, logits[:, -1], params)
        keep = self.proposer is not None and self.proposer.needs_hidden
        for i, r in enumerate(running):
            r.cached += 1
            if keep:
                r.extend_hidden.append(hidden[i, :1])
                r.extend_tokens.append(r.output_ids[-1])

    def _admit(self, queue: deque, running: list[Request], slots: int) -> list[Request]:
        budget = self.config.max_tokens
        used = sum(r.budget for r in running)
        admitted = []
        while queue and len(running) + len(admitted) < slots:
            r = queue[0]
            # Always admit into an empty engine, so a request larger than the budget still runs.
            if budget is not None and used + r.budget > budget and (running or admitted):
                break
            queue.popleft()
            r.slot = len(running) + len(admitted)
            used += r.budget
            admitted.append(r)
        return admitted

    def _compact(self, running: list[Request], cache: KVCache) -> list[Request]:
        """Drop finished requests and move the highest-slot survivors into their holes, so the
        batch always occupies slots 0..B-1 and attention reads the cache without a gather."""
        alive = [r for r in running if not r.finish_reason]
        holes = sorted(r.slot for r in running if r.finish_reason and r.slot < len(alive))
        movers = sorted((r for r in alive if r.slot >= len(alive)), key=lambda r: r.slot)
        for hole, r in zip(holes, movers):
            cache.copy_slot(r.slot, hole, r.cached)
            if self.proposer is not None:
                self.proposer.move_slot(r.slot, hole, r.draft_cached)
            r.slot = hole
        return sorted(alive, key=lambda r: r.slot)

    def _prefill(self, admitted: list[Request], cache: KVCache, params: SamplingParams) -> None:
        """One forward for the distinct prompts (right-padded); siblings copy the KV rows."""
        leaders: dict[int, Request] = {}
        for r in admitted:
            leaders.setdefault(r.prompt_index, r)
        firsts = list(leaders.values())
        width = max(len(r.prompt_ids) for r in firsts)
        pad = next(iter(self.eos_ids), 0)
        ids = torch.tensor([r.prompt_ids + [pad] * (width - len(r.prompt_ids)) for r in firsts],
                           device=self.model.device)
        slot_t = torch.tensor([r.slot for r in firsts], device=self.model.device)
        logits, hidden = self.model.prefill(ids, cache, slot_t)
        last = torch.tensor([len(r.prompt_ids) - 1 for r in firsts], device=self.model.device)
        last_logits = logits[torch.arange(len(firsts), device=last.device), last]
        row = {r.prompt_index: k for k, r in enumerate(firsts)}
        for r in admitted:
            leader = leaders[r.prompt_index]
            if r is not leader:
                cache.copy_slot(leader.slot, r.slot, len(r.prompt_ids))
            r.cached = len(r.prompt_ids)
        self._emit(admitted, last_logits[[row[r.prompt_index] for r in admitted]], params)
        if self.proposer is not None and self.proposer.needs_hidden:
            for r in admitted:
                r.extend_hidden = [hidden[row[r.prompt_index], : len(r.prompt_ids)]]
                r.extend_tokens = r.prompt_ids[1:] + r.output_ids[:1]

    def _speculate(self, running: list[Request], cache: KVCache, params: SamplingParams,
                   stats: RolloutStats, strategy: Strategy) -> None:
        """One SD step (see rollout/speculative.py): draft a tree, verify it in one target
        forward, walk it with the exact rule, commit the accepted path."""
        starts = torch.tensor([r.cached for r in running], device=self.model.device)
        tree = self.proposer.propose(running, starts, strategy)
        logits, hidden = self.model.decode(tree.tokens, cache, slice(0, len(running)), starts,
                                           starts[:, None] + tree.depths, tree.attention_mask())
        probs = target_probs(logits, params)
        parents, tokens, valid = tree.parents.tolist(), tree.tokens.tolist(), tree.valid.tolist()
        for b, r in enumerate(running):
            before = len(r.output_ids)

            def emit(token: int, r=r) -> bool:
                self._append(r, token, params)
                return r.finish_reason is not None

            path = walk_tree(probs[b], children_of(parents[b], tokens[b], valid[b]), r.generator,
                             params.greedy, emit)
            stats.record_sd(len(r.output_ids) - before, sum(valid[b]) - 1)
            if r.finish_reason:
                continue
            if len(path) > 1:
                cache.move_rows(r.slot, [r.cached + i for i in path], [r.cached + j for j in range(len(path))])
            if self.proposer.needs_hidden:
                r.extend_hidden = [hidden[b, path]]
                r.extend_tokens = r.output_ids[-len(path):]
            r.cached += len(path)

    def _emit(self, requests: list[Request], logits: torch.Tensor, params: SamplingParams) -> None:
        probs = target_probs(logits, params)
        tokens = sample(probs, [r.generator for r in requests], params.greedy).tolist()
        for r, tok in zip(requests, tokens):
            self._append(r, tok, params)

    def _append(self, r: Request, token: int, params: SamplingParams) -> None:
        r.output_ids.append(token)
        if token in self.eos_ids:
            r.finish_reason = "stop"
        elif params.stop and self._hit_stop(r, params.stop):
            r.finish_reason = "stop"
        elif len(r.output_ids) >= r.max_new_tokens:
            r.finish_reason = "length"

    def _hit_stop(self, r: Request, stops: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(r.output_ids)
        longest = max(len(s) for s in stops)
        # Only a stop string ending in the newest token can be new; look just behind it.
        tail_from = max(0, len(text) - longest - len(self.tokenizer.decode(r.output_ids[-1:])))
        hits = [i for s in stops if (i := text.find(s, tail_from)) >= 0]
        if hits:
            r.stop_at = min(hits)
        return bool(hits)

    def _complete(self, r: Request) -> Completion:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids)
            if r.stop_at is not None:
                text = text[: r.stop_at]
        return Completion(r.prompt_index, r.sample_index, r.output_ids, text, r.finish_reason or "length")

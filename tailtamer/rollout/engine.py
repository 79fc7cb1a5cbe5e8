"""The rollout engine: continuous batching over the slots of a static KV cache.

Each request (one sample of one prompt) takes a free cache slot, is prefilled, and then
decodes one token per step alongside every other running request. A finished request frees
its slot at once and the next queued request takes it. Sibling samples admitted together
share one prefill (the prompt's KV rows are copied), which is what GRPO's n samples per
prompt need. Per decode step the engine records the time and the number of running
requests: that timeline is where the long tail shows.

With a speculator, steps with few enough running requests (the long tail) are speculative:
the proposer drafts a tree per request, the target verifies every tree in one forward, and
the exact rule (rollout/speculative.py) accepts a path, for the whole batch at once.
Sampling draws the token at response index t with the request's noise for index t
(rollout/sampling.py), so a step costs one vectorised draw for the batch, and SD emits what
plain decoding would.

A step is schedule -> run -> commit: `_schedule` admits requests and picks a prefill, a plain
step or an SD step (the tuner's arm); `RUNS[kind]` runs its forward (`_prefill`,
`_decode_one`, or `_speculate`: propose -> verify -> accept) and returns the tokens to commit
and the pairs the proposer observes; `_commit` is the one place that appends tokens,
checks stops, hands the proposer its observations, records the tuner and the stats, and
compacts the batch. The step is timed at its two ends, around run and commit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from tailtamer.config_fields import at_least, f
from tailtamer.errors import ConfigError, DataError, TailtamerError
from tailtamer.model.transformer import KVCache, Transformer
from tailtamer.token_budget import token_budget_chunks
from tailtamer.rollout.sampling import SamplingParams, TargetDraws, request_key, sample, target_probs
from tailtamer.rollout.speculative import Strategy, accept, rows_ahead
from tailtamer.rollout.speculator import Speculator
from tailtamer.rollout.stats import PHASES, RolloutStats
from tailtamer.rollout.suffix_index import SOURCE_NAMES


class NonFiniteLogits(TailtamerError):
    """The model's output is NaN or inf: there is nothing to sample from."""


# A prefill forward's fixed cost, in padded tokens' worth of compute, by device type: on the
# base model on a CPU a forward costs ~3.6 ms beyond ~37 us a token (64 prompts of 7-49 tokens:
# 116 ms padded as one batch, 53 ms in 5 groups by length; 2026-12-05, the Xeon). Not measured
# on a GPU, where a forward's kernel launches cost more: there the prompts stay one batch.
PREFILL_GROUP_TOKENS = {"cpu": 96}
PREFILL_GROUP_ROWS = 64  # prompts a grouped forward holds at most: bounds the search for the cuts


@dataclass(frozen=True)
class EngineConfig:
    # 512 holds a 64 x 8 rollout at once, 1.7x the tokens/s of 64 on the base model (README)
    max_batch_size: int = f(512, "requests decoded together (cache slots = min(this, requests))")
    max_seq_len: int | None = f(None, "prompt + response limit; default: the model's context")
    max_tokens: int | None = f(None, "admit while sum(prompt + max_new_tokens) of running requests fits")

    def __post_init__(self):
        at_least(self, "engine", 1, "max_batch_size")
        at_least(self, "engine", 2, *(name for name in ("max_seq_len", "max_tokens") if getattr(self, name) is not None))


def check_prompt(ids: list[int], where: str, max_seq_len: int) -> None:
    """A prompt an engine can run: not empty, and one new token fits after it."""
    if not ids:
        raise DataError(f"{where}: prompt is empty after tokenization")
    if len(ids) >= max_seq_len:
        raise DataError(f"{where}: prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                        f"(prompt + at least one new token)")


@dataclass
class Request:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    key: int  # its random stream (rollout/sampling.py)
    max_new_tokens: int
    row: int = 0  # its row of a `generate` call's random streams (`TargetDraws`)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of output_ids, with SamplingParams.logprobs
    slot: int = -1
    cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    stop_at: int | None = None  # character offset where a stop string begins

    @property
    def budget(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass
class Step:
    """One engine step as scheduled: `kind` prefill (the newly admitted `requests`), plain or
    sd (every running request; `strategy` the tuner's arm). `tuned`: the tuner chose for this
    step (the long tail) and is told how it went; `catch_up`: the first step of a drafter arm
    after plain steps, a prefill or model-free drafts, whose drafter first catches up."""
    kind: str
    requests: list[Request]
    strategy: Strategy | None = None
    tuned: bool = False
    catch_up: bool = False


@dataclass
class Outcome:
    """What a step's forward produced, for `_commit`: per request the tokens to append in
    order (checked finite) and the KV rows the forward made valid (`rows`; a request that
    stops after k of its tokens keeps min(k + 1, rows): what the forward consumed of its
    output); the arguments of each `Proposer.observe` call; for an SD step the tokens drafted
    and, for a tree, each request's accepted nodes and, where the tree says, the sources of
    its accepted drafts and of every draft (`Tree.sources`)."""
    tokens: list[list[int]]
    rows: list[int]
    observed: list[tuple] = field(default_factory=list)
    drafted: list[int] | None = None
    paths: list[list[int] | None] | None = None
    sources: list[list[int]] | None = None
    drafted_sources: list[int] | None = None
    logprobs: list[list[float]] | None = None  # beside `tokens`, with SamplingParams.logprobs


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    logprobs: list[float] | None = None  # with SamplingParams.logprobs: each token's, as drawn


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig = EngineConfig(),
                 eos_ids: tuple[int, ...] | None = None, speculator: Speculator | None = None):
        """`speculator` (rollout/speculator.py): a proposer and a tuner that picks a strategy
        (or plain decoding) per step; with its `bs_threshold`, steps with more running
        requests than that decode plainly: SD only in the long tail (TLT §2.3)."""
        self.model, self.tokenizer, self.config, self.speculator = model, tokenizer, config, speculator
        if eos_ids is None:
            eos_ids = model.config.eos_ids or (
                (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ())
        self.eos_ids = frozenset(eos_ids)
        self.max_seq_len = min(config.max_seq_len or model.config.max_position_embeddings,
                               model.config.max_position_embeddings)
        self._cache: KVCache | None = None
        self._draws: TargetDraws | None = None  # this generate's sampling parameters and noise (None: greedy)
        self._zero = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # a draw at each request's next index

    @property
    def proposer(self):
        return self.speculator.proposer if self.speculator is not None else None

    @property
    def tuner(self):
        return self.speculator.tuner if self.speculator is not None else None

    def _cache_for(self, slots: int, length: int) -> KVCache:
        c = self._cache
        if c is None or c.slots < slots or c.max_len < length or c.dtype != self.model.dtype:
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
            check_prompt(ids, labels[i] if labels else f"prompt {i}", self.max_seq_len)
            new = min(params.max_new_tokens, self.max_seq_len - len(ids))
            requests += [Request(i, j, list(ids), request_key(params.seed, first_index + i, j), new,
                                 row=len(requests) + j) for j in range(params.n)]
        return requests

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, labels: list[str] | None = None,
                 first_index: int = 0, keep_hidden: Callable[[list[int], int, torch.Tensor], None] | None = None
                 ) -> tuple[list[Completion], RolloutStats]:
        """`keep_hidden(tokens, response_start, hidden)`, with a proposer that observes the
        target's hidden states: called as each request finishes, with its prompt and response
        tokens and the final hidden states of those a forward consumed (all but the last, or
        all; a view of the proposer's, valid until the call returns), so the adaptive drafter
        learns from the rollout's own forwards (no extra one)."""
        if not prompts:
            raise DataError("no prompts to generate from")
        requests = self.make_requests(prompts, params, labels, first_index)
        slots = min(self.config.max_batch_size, len(requests))
        longest = max(r.budget for r in requests)
        device = self.model.device
        self._logprobs = params.logprobs
        self._draws = None if params.greedy else TargetDraws(
            params, torch.tensor([r.key for r in requests], device=device), self.model.config.vocab_size)
        spec = self.speculator
        if spec is not None:
            verify, draft_rows = rows_ahead(spec.tuner.strategies)
            spec.proposer.reserve(slots, longest + max(verify, draft_rows) + 1)
            spec.proposer.couple(self._draws)
            longest += verify
        cache = self._cache_for(slots, longest)
        queue, running, done = deque(requests), [], []
        stats, start = RolloutStats(), time.perf_counter()
        setup_start = self._setup_s()
        drafted = False  # did the last step draft with the drafter (then it is caught up)
        while queue or running:
            PHASES.mark("engine loop")
            step = self._schedule(queue, running, slots, drafted)
            if step.catch_up:
                # The switch: the drafter catches up on what plain steps, prefills and
                # model-free drafts left, charged to no arm (the first arm pulled would
                # otherwise pay it).
                t0 = time.perf_counter()
                if spec.proposer.catch_up(running):
                    stats.catch_up_s += time.perf_counter() - t0
                PHASES.mark("sd: catch-up at the switch (no arm)")
            drafted = step.kind == "sd" and not step.strategy.model_free
            setup, t0 = self._setup_s(), time.perf_counter()
            PHASES.mark("engine loop")
            outcome = RUNS[step.kind](self, step, cache, params)
            stats.setup_s = self._setup_s() - setup_start
            t0 += self._setup_s() - setup  # a compile in this step is charged to no arm
            running = self._commit(step, outcome, running, params, cache, stats, (start, t0), done, keep_hidden)
        stats.seconds = time.perf_counter() - start - stats.setup_s
        stats.tokens = sum(len(r.output_ids) for r in done)
        done.sort(key=lambda r: (r.prompt_index, r.sample_index))
        return [self._complete(r) for r in done], stats

    def _setup_s(self) -> float:
        return self.proposer.setup_s if self.proposer is not None else 0.0

    def _schedule(self, queue: deque, running: list[Request], slots: int, drafted: bool) -> Step:
        """Admit queued requests into free slots (then the step is their prefill), else ask the
        tuner, in the long tail, for an SD strategy or plain decoding."""
        admitted = self._admit(queue, running, slots)
        if admitted:
            return Step("prefill", admitted)
        spec = self.speculator
        tuned = spec is not None and (spec.bs_threshold is None or len(running) <= spec.bs_threshold)
        strategy = spec.tuner.select(len(running)) if tuned else None
        if strategy is None:
            return Step("plain", running, tuned=tuned)
        # after plain steps, a prefill or model-free drafts (the suffix index's), a drafter arm
        # first catches up; a model-free arm needs no drafter
        return Step("sd", running, strategy, tuned, catch_up=not drafted and not strategy.model_free)

    def _commit(self, step: Step, out: Outcome, running: list[Request], params: SamplingParams, cache: KVCache,
                stats: RolloutStats, clock: tuple[float, float], done: list[Request], keep_hidden) -> list[Request]:
        """The one place a step's tokens become the requests': the proposer observes the
        step's pairs, tokens are appended up to a stop, KV rows are counted (a tree's accepted
        path moved to consecutive rows), the tuner and the stats record the step (`clock`: when
        the rollout and this step started), finished requests hand over their hidden states and
        free their slots. Returns the running requests."""
        for args in out.observed:
            self.proposer.observe(*args)
        if out.observed:
            PHASES.mark(OBSERVE[step.kind])
        moves, emitted = [], 0
        for i, (r, tokens, rows) in enumerate(zip(step.requests, out.tokens, out.rows)):
            before = len(r.output_ids)
            for k, token in enumerate(tokens):
                self._append(r, token, params)
                if out.logprobs is not None:
                    r.logprobs.append(out.logprobs[i][k])
                if r.finish_reason:
                    break
            appended = len(r.output_ids) - before
            emitted += appended
            if out.drafted is not None:
                stats.record_sd(appended, out.drafted[i], out.sources[i] if out.sources is not None else None,
                                len(step.requests))
            if r.finish_reason:  # what the forward consumed of its output still counts (`keep_hidden`)
                r.cached += min(appended + 1, rows)
                continue
            nodes = out.paths[i] if out.paths is not None else None
            if nodes is not None and nodes[:rows] != list(range(rows)):  # a tree's path: its rows to consecutive ones
                moves.append((r.slot, [r.cached + j for j in nodes[:rows]], [r.cached + j for j in range(rows)]))
            r.cached += rows
        if out.drafted is not None:
            stats.record_drafted_sources(out.drafted_sources, out.drafted)
        PHASES.mark(BOOKKEEPING[step.kind])
        if moves:
            cache.move_rows(moves)
            PHASES.mark("sd: commit (KV moves)")
        end = time.perf_counter()
        seconds = end - clock[1]
        if step.kind == "prefill":
            stats.prefill_s += seconds
            running = running + step.requests
        else:
            if step.tuned:
                self.speculator.tuner.record(step.strategy, len(running), seconds, emitted)
            stats.record_step(end - clock[0] - stats.setup_s, seconds, len(running),
                              step.strategy.name if step.strategy else "plain", emitted)
        finished = [r for r in running if r.finish_reason]
        if not finished:
            return running
        done += finished
        if self.proposer is not None:
            self.proposer.retire(finished)
        if keep_hidden is not None and self.proposer is not None and self.proposer.needs_hidden:
            for r in finished:
                keep_hidden(r.prompt_ids + r.output_ids, len(r.prompt_ids), self.proposer.hidden_of(r.slot, r.cached))
        return self._compact(running, cache)

    def _draw(self, requests: list[Request], logits: torch.Tensor, params: SamplingParams,
              offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens the target samples from logits (B, q, V), position (b, i) with the
        request's noise for response index len(output_ids) + offsets[b, i] (the index that draw
        would emit; offsets (B, q) or (1, q), in [0, q));
        -1 where the logits are not finite (see `_checked`). With `params.logprobs`, also each
        token's log-probability under the distribution it was drawn from (greedy: the
        temperature-1 distribution), else None."""
        if params.greedy:
            tokens = logits.argmax(-1)
            probs = torch.softmax(logits.float(), -1) if params.logprobs else None
        else:
            probs = target_probs(logits, params)
            tokens = sample(probs, self._draws.at(requests, offsets))
        tokens = torch.where(torch.isfinite(logits.sum(-1)), tokens, -1)
        return tokens, probs.gather(-1, tokens.clamp(min=0)[..., None])[..., 0].log() if params.logprobs else None

    @staticmethod
    def _checked(tokens: list[int]) -> list[int]:
        if min(tokens) < 0:
            raise NonFiniteLogits("the model produced non-finite logits (NaN or inf): its weights, or config.json "
                                  "values such as rms_norm_eps or rope_theta, make it diverge")
        return tokens

    def _decode_one(self, step: Step, cache: KVCache, params: SamplingParams) -> Outcome:
        """A plain decode step: one token per running request; with a proposer that wants
        them, the target's features of the step are its observations (one tensor write), so
        switching to SD later needs no extra forward."""
        running = step.requests
        device, B = self.model.device, len(running)
        ids = torch.tensor([[r.output_ids[-1]] for r in running], device=device)
        cached = [r.cached for r in running]
        starts = torch.tensor(cached, device=device)
        PHASES.mark("plain: host bookkeeping")
        logits, hidden = self.model.decode(ids, cache, slice(0, B), starts, span=max(cached) + 1)
        PHASES.mark("plain: target forward")
        tokens, lps = self._draw(running, logits, params, self._zero)
        PHASES.mark("plain: sample")
        observed = [(slice(0, B), starts[:, None], hidden, tokens)] if self._observes() else []
        return Outcome([[t] for t in self._checked(tokens[:, 0].tolist())], [1] * B, observed,
                       logprobs=lps.tolist() if lps is not None else None)

    def _observes(self) -> bool:
        return self.proposer is not None and self.proposer.needs_hidden

    def _admit(self, queue: deque, running: list[Request], slots: int) -> list[Request]:
        if not queue or len(running) >= slots:
            return []
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
                self.proposer.move_slot(r.slot, hole, r.cached)
            r.slot = hole
        return sorted(alive, key=lambda r: r.slot)

    def _prefill(self, step: Step, cache: KVCache, params: SamplingParams) -> Outcome:
        """The distinct prompts' forwards, in groups by length, each right-padded to its
        longest prompt (`token_budget_chunks`: the cuts of the sorted lengths that minimise the
        padded tokens plus a forward's fixed cost each); siblings copy the KV rows. Each
        request's first token, and per group the prompt's pairs for the proposer."""
        admitted, device = step.requests, self.model.device
        leaders: dict[int, Request] = {}
        for r in admitted:
            leaders.setdefault(r.prompt_index, r)
        firsts = list(leaders.values())
        pad = next(iter(self.eos_ids), 0)
        if self.proposer is not None:
            self.proposer.admit(admitted)
        lengths = [len(r.prompt_ids) for r in firsts]
        overhead = PREFILL_GROUP_TOKENS.get(device.type)
        keep = self._observes()
        row, groups, logits = {}, [], []
        # no token budget beyond the rows' (the old single batch had none): max_tokens never binds
        for group in [list(range(len(firsts)))] if overhead is None else \
                token_budget_chunks(lengths, PREFILL_GROUP_ROWS, PREFILL_GROUP_ROWS * max(lengths), overhead):
            lead = [firsts[i] for i in group]
            width = max(len(r.prompt_ids) for r in lead)
            ids = torch.tensor([r.prompt_ids + [pad] * (width - len(r.prompt_ids)) for r in lead], device=device)
            out, hidden = self.model.prefill(ids, cache, torch.tensor([r.slot for r in lead], device=device),
                                             torch.tensor([len(r.prompt_ids) - 1 for r in lead], device=device))
            at = {r.prompt_index: k for k, r in enumerate(lead)}
            row.update({p: len(row) + k for p, k in at.items()})
            groups.append((ids, hidden if keep else None, at))
            logits.append(out)
        for r in admitted:
            leader = leaders[r.prompt_index]
            if r is not leader:
                cache.copy_slot(leader.slot, r.slot, len(r.prompt_ids))
            r.cached = len(r.prompt_ids)
        rows = torch.tensor([row[r.prompt_index] for r in admitted], device=device)
        first, lps = self._draw(admitted, torch.cat(logits)[rows], params, self._zero)
        first = first[:, 0]
        observed = []
        if keep:  # pairs (h_j, x_(j+1)) over each prompt; the pair at the prompt's end gets the first token
            for ids, hidden, at in groups:
                mine = [i for i, r in enumerate(admitted) if r.prompt_index in at]
                of = torch.tensor([at[admitted[i].prompt_index] for i in mine], device=device)  # leader rows
                after = torch.cat([ids[:, 1:], ids[:, :1]], 1)[of]
                after[torch.arange(len(mine), device=device),
                      torch.tensor([len(admitted[i].prompt_ids) - 1 for i in mine], device=device)] = first[mine]
                slots = torch.tensor([admitted[i].slot for i in mine], device=device)
                observed.append((slots, torch.arange(ids.shape[1], device=device).expand(len(mine), -1), hidden[of],
                                 after))
        return Outcome([[t] for t in self._checked(first.tolist())], [0] * len(admitted), observed,
                       logprobs=lps.tolist() if lps is not None else None)

    def _speculate(self, step: Step, cache: KVCache, params: SamplingParams) -> Outcome:
        """One SD step (see rollout/speculative.py): propose a tree per request, verify every
        tree in one target forward, accept a path with the exact rule for the whole batch."""
        running, strategy = step.requests, step.strategy
        device, B = self.model.device, len(running)
        cached = [r.cached for r in running]
        starts = torch.tensor(cached, device=device)
        PHASES.mark("sd: host bookkeeping")
        tree = self.proposer.propose(running, starts, strategy)
        positions, mask = tree.verify_inputs(starts)
        PHASES.mark("sd: tree mask")
        logits, hidden = self.model.decode(tree.tokens, cache, slice(0, B), starts, positions, mask,
                                           span=max(cached) + tree.tokens.shape[1])
        PHASES.mark("sd: verify (target forward)")
        N = tree.tokens.shape[1]
        draws, lps = self._draw(running, logits, params,
                                torch.arange(N, device=device)[None] if tree.chain else tree.depths)
        PHASES.mark("sd: sample")
        path, tokens, length = accept(tree, draws)
        PHASES.mark("sd: accept")
        lengths = length.tolist()
        observed = []
        if self.proposer.needs_hidden:
            # the pairs of the path's accepted nodes; the rest (rejected drafts') at position -1
            positions = torch.tensor([[c + i if i < n else -1 for i in range(path.shape[1])]
                                      for c, n in zip(cached, lengths)], device=device)
            kept = hidden if tree.chain else hidden[torch.arange(B, device=device)[:, None], path]  # a chain's path: 0..depth
            observed.append((slice(0, B), positions, kept, tokens))
        # a chain drafts its depth and its path is 0..depth: no device reads for either
        drafted = [tree.depth] * B if tree.chain else (tree.valid.sum(1) - 1).tolist()
        paths = None if tree.chain else path.tolist()
        accepted = [self._checked(toks[:n]) for toks, n in zip(tokens.tolist(), lengths)]
        sources = drafted_sources = None
        if tree.sources is not None:
            sources = [row[1:n] for row, n in zip(tree.sources.gather(1, path).tolist(), lengths)]
            drafted_sources = torch.bincount(tree.sources[tree.valid], minlength=len(SOURCE_NAMES) + 1).tolist()
        if lps is not None:  # the walk's emitted tokens' (each drawn at its node of the path)
            lps = [row[:n] for row, n in zip(lps.gather(1, path).tolist(), lengths)]
        return Outcome(accepted, lengths, observed, drafted, paths, sources, drafted_sources, lps)

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
        return Completion(r.prompt_index, r.sample_index, r.output_ids, text, r.finish_reason or "length",
                          r.logprobs if self._logprobs else None)


# The forward each kind of scheduled step runs (`Engine.generate`: schedule -> RUNS[kind] -> commit).
RUNS = {"prefill": Engine._prefill, "plain": Engine._decode_one, "sd": Engine._speculate}
# The profiler's phase names (`tailtamer bench profile`) for a step's commit.
OBSERVE = {"prefill": "prefill", "plain": "plain: drafter observe", "sd": "sd: drafter observe"}
BOOKKEEPING = {"prefill": "prefill", "plain": "plain: host bookkeeping", "sd": "sd: host bookkeeping"}

"""The EAGLE proposer: draft trees from a one-layer drafter fed with the target's own features.

Per slot it keeps the pairs (h_j, x_{j+1}) the engine observed (the target's final hidden state
at each committed position and the token after it) and how many of them its drafter has run
over (`drafted`). An SD step first runs the drafter over the rest ("draft extend", so its KV
cache holds true features for every committed position), then expands the tree from the last
pair. A plain step costs the engine two tensor writes here (observe), nothing more.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from functools import lru_cache

import torch
import torch.nn.functional as F

from tailtamer.model.draft_step import chain_index
from tailtamer.model.transformer import rotary_tables
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.sampling import SamplingParams, TargetDraws, coupled_drafts, perturbed
from tailtamer.rollout.speculative import Strategy, Tree
from tailtamer.rollout.stats import PHASES


def chain_tree(tokens: torch.Tensor) -> Tree:
    """The Tree of chains (B, depth + 1): the pending token, then each level's draft."""
    parents, depths, valid = _chain_shape(tokens.shape[0], tokens.shape[1] - 1, tokens.device)
    return Tree(tokens=tokens, parents=parents, depths=depths, valid=valid, depth=tokens.shape[1] - 1, chain=True)


@lru_cache(maxsize=64)
def _chain_shape(batch: int, depth: int, device: torch.device):
    """A chain's parents, depths and valid flags: the same at every step (read, never written),
    so built once per batch size and depth rather than in every SD step."""
    return (torch.arange(-1, depth, device=device).expand(batch, -1),
            torch.arange(depth + 1, device=device).expand(batch, -1),
            torch.ones(batch, depth + 1, dtype=torch.bool, device=device))


def children(logits: torch.Tensor, k: int, g: torch.Tensor | None = None, params: SamplingParams | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability scores, tokens) (..., k) of a draft node's k children from the drafter's
    logits (..., V): its top-k tokens, or with the noise g (..., V) the target will draw after
    the node with, the Gumbel-top-k of its distribution under that noise (`perturbed`): the
    coupled draft (`coupled_drafts`) first, scored as the top-1 (it is the child the target's
    draw most likely takes), then the tokens the target's draw most likely takes when it is
    not that one, each scored by its log-probability. On the base model's warm-up drafter at
    T = 1, teacher-forced, the target draws one of two such children with probability 0.936,
    one coupled draft 0.888."""
    logp = torch.log_softmax(logits.float(), -1)
    if g is None:
        return logp.topk(k, dim=-1)
    tokens = perturbed(logits, params, g).topk(k, dim=-1).indices
    scores = logp.gather(-1, tokens)
    scores[..., 0] = logp.amax(-1)
    return scores, tokens


def eagle_tree(drafter, cache, batch: int, starts: torch.Tensor, root_logits: torch.Tensor,
               root_hidden: torch.Tensor, pending: torch.Tensor, strategy: Strategy, max_start: int,
               draws: tuple[torch.Tensor, SamplingParams] | None = None) -> Tree:
    """EAGLE-2 style dynamic tree (Li et al. 2024b): expand the top-k beams by cumulative draft
    log-probability for `depth` levels, then keep the N-1 best of all candidates. With a
    confidence (D_K_N@C), expansion stops once every request's best beam is below C (deeper
    nodes only score lower), and the tree keeps the best N-1 of the candidates drafted.

    root_logits / root_hidden: the drafter's output for pair (h_{n-1}, s) with s pending, i.e.
    its guess of the distribution after s. Draft rows of depth-d beams go to drafter cache
    rows starts + (d-1)K + i at position starts - 1 + d; each beam attends to its ancestors'
    rows only (a window mask over all draft rows of this step). `draws` = (g (B, depth, V), the
    target's params): each node's children are coupled with the target's draw (`children`),
    level d + 1 drafted with g[:, d].
    """
    B, K, D = batch, strategy.topk, strategy.depth
    dev = root_logits.device
    g, params = draws if draws is not None else (None, None)
    score, tok = children(root_logits, K, None if g is None else g[:, 0], params)  # (B, K)
    cand_tok, cand_score = [tok], [score]
    cand_parent = [torch.full((B, K), -1, device=dev)]
    cand_depth = [torch.ones(B, K, dtype=torch.long, device=dev)]
    beam_idx = torch.arange(K, device=dev).expand(B, K)  # candidate index of each beam
    beam_tok, beam_score = tok, score
    beam_hidden = root_hidden[:, None].expand(B, K, root_hidden.shape[-1])
    rows = (D - 1) * K
    beam_anc = torch.zeros(B, K, max(rows, 1), dtype=torch.bool, device=dev)
    n_cand, levels = K, D
    for d in range(1, D):
        if strategy.confidence and bool((beam_score[:, 0] < math.log(strategy.confidence)).all()):
            levels = d  # topk's scores are sorted: column 0 is each request's best beam
            break
        col = (d - 1) * K + torch.arange(K, device=dev)
        mask = beam_anc[:, :, : d * K].clone()
        mask[:, torch.arange(K), col] = True
        positions = (starts - 1 + d)[:, None].expand(B, K)
        PHASES.mark("sd: draft tree bookkeeping")
        logits, hidden = drafter.decode(beam_tok, beam_hidden, cache, slice(0, B), starts + (d - 1) * K,
                                        positions, mask, span=max_start + d * K)
        PHASES.mark(f"sd: draft level {d + 1}")
        child_score, child_tok = children(logits, K, None if g is None else g[:, d, None].expand(B, K, -1), params)
        child_score = beam_score[:, :, None] + child_score
        cand_tok.append(child_tok.reshape(B, K * K))
        cand_score.append(child_score.reshape(B, K * K))
        cand_parent.append(beam_idx[:, :, None].expand(B, K, K).reshape(B, K * K))
        cand_depth.append(torch.full((B, K * K), d + 1, device=dev))
        best_score, best = child_score.reshape(B, K * K).topk(K, dim=-1)
        parent_beam = best // K
        beam_tok = torch.gather(child_tok.reshape(B, K * K), 1, best)
        beam_score = best_score
        beam_hidden = torch.gather(hidden, 1, parent_beam[:, :, None].expand(B, K, hidden.shape[-1]))
        beam_anc = torch.gather(mask, 1, parent_beam[:, :, None].expand(B, K, mask.shape[-1]))
        beam_anc = torch.nn.functional.pad(beam_anc, (0, max(rows, 1) - beam_anc.shape[-1]))
        beam_idx = n_cand + best
        n_cand += K * K
    PHASES.mark("sd: draft tree bookkeeping")
    tokens, scores = torch.cat(cand_tok, 1), torch.cat(cand_score, 1)
    parents, depths = torch.cat(cand_parent, 1), torch.cat(cand_depth, 1)
    # Stable sort: among equal scores the shallower (earlier) candidate wins, so every chosen
    # node's parent is chosen too (a finite child's score never exceeds its parent's; a node
    # orphaned by NaN scores gets parent -1, which `accept` never reaches).
    N = min(strategy.verify, n_cand + 1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : N - 1]
    chosen = torch.sort(order, dim=1).values  # candidate order = depth order: parents first
    # Map candidate index -> tree index (1-based; 0 is the pending root).
    tree_index = torch.full((B, n_cand), -1, dtype=torch.long, device=dev)
    tree_index.scatter_(1, chosen, torch.arange(1, N, device=dev).expand(B, -1))
    chosen_parent = torch.gather(parents, 1, chosen)
    parent_tree = torch.where(chosen_parent < 0, torch.zeros_like(chosen_parent),
                              torch.gather(tree_index, 1, chosen_parent.clamp(min=0)))
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    PHASES.mark("sd: draft tree select")
    return Tree(tokens=torch.cat([pending[:, None], torch.gather(tokens, 1, chosen)], 1),
                parents=torch.cat([zero - 1, parent_tree], 1),
                depths=torch.cat([zero, torch.gather(depths, 1, chosen)], 1),
                valid=torch.ones(B, N, dtype=torch.bool, device=dev), depth=levels)


QUEUE_LIMIT = 32  # observed steps kept before they are written (they hold the verify's hidden states)
BUCKETS = (1, 2, 4, 8)  # batch sizes of the compiled chains (at 16 eager is as fast: `bench profile`)


class CompiledChain:
    """Draft chains compiled with `torch.compile`, as gpt-fast and nano-vllm compile their
    decode steps: `DraftStep.draft_chain`, the extend and every level in one graph. Eager, a
    depth-4 chain at batch 1 is ~250 tensor operations of a few microseconds each, plus a
    Python round trip per level (since the drafter's cheaper inference step, about as fast
    as this graph: `bench profile`).

    Shapes are static but for the attention span: a graph per batch bucket (`BUCKETS` up to
    the cache's slots; larger batches run eager) and depth, the extend padded to depth + 1
    pairs (the most an SD step of that depth leaves; a longer backlog runs eager). A batch is
    padded up to its bucket with rows of the free slots above it, whose drafter rows a request
    admitted there overwrites from row 0 before reading any. A graph is compiled when a chain
    first needs it, in seconds (Inductor caches the code on disk, so a later process takes a
    fraction); `seconds` adds them up, which the engine charges to no step. If compiling
    fails, chains run eager and `error` says why.
    """

    def __init__(self, drafter):
        self.drafter = drafter
        # dynamic: the span varies at every step (dynamo still specialises the batch and width);
        # fullgraph: a graph break would put Python between the levels again, so it fails instead;
        # compile_threads=1: compile in this process, not in a pool of compile processes that every
        # worker would start (the shutdown warning seen with compiling was tqdm's lock: dist._spawned);
        # cpp_wrapper on a CPU: the graph's ~100 kernel calls from C++, not from generated Python
        # (a depth-4 chain at batch 1: 0.48 -> 0.41 ms in the engine, and it compiles no slower)
        options = {"compile_threads": 1, "cpp_wrapper": drafter.fc.weight.device.type == "cpu"}
        self.fn = torch.compile(drafter.step().draft_chain, dynamic=True, fullgraph=True, options=options)
        self.ready: set[tuple[int, int]] = set()  # (bucket, depth) compiled
        self.seconds = 0.0
        self.error: str | None = None

    def bucket(self, batch: int, cache) -> int | None:
        """The compiled batch size for `batch` chains, if there is one."""
        b = next((b for b in BUCKETS if b >= batch), None)
        return b if self.fn is not None and b is not None and b <= cache.slots else None

    def __call__(self, cache, ids, hidden, index, last, depth: int, span: int, bucket: int,
                 coupled: tuple | None = None) -> torch.Tensor | None:
        """The (B, depth) drafts, or None if the graph failed to compile."""
        B, pad = ids.shape[0], bucket - ids.shape[0]
        if pad:
            ids, index, last = F.pad(ids, (0, 0, 0, pad)), F.pad(index, (0, 0, 0, pad)), F.pad(last, (0, pad))
            hidden = F.pad(hidden, (0, 0, 0, 0, 0, pad))
            if coupled is not None:  # the padding rows' draws: any noise
                coupled = (F.pad(coupled[0], (0, 0, 0, 0, 0, pad)), *coupled[1:])
        w = self.drafter.fc.weight
        tables = rotary_tables(self.drafter.config, w.device, w.dtype)
        self.drafter.step()  # its weights current: the graph reads them
        new, t0 = (bucket, depth) not in self.ready, time.perf_counter()
        try:  # dynamo keeps 8 graphs per function by default, fewer than buckets x depths
            with torch._dynamo.config.patch(cache_size_limit=8 * len(BUCKETS)) if new else nullcontext():
                drafts = self.fn(cache.kv[0], cache, slice(0, bucket), ids, hidden, index, last, depth, span, tables,
                                 coupled=coupled)[:B]
        except Exception as e:  # no C++ compiler, an unsupported op, a bug: the eager chain still works
            self.fn, self.error, drafts = None, f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}", None
        if new or drafts is None:  # compiling (or failing to), charged to no step
            self.seconds += time.perf_counter() - t0
        if drafts is not None:
            self.ready.add((bucket, depth))
        return drafts


class EagleProposer(Proposer):
    needs_hidden = True

    def __init__(self, drafter: torch.nn.Module, compiled: bool = False):
        self.drafter = drafter
        self.chain = CompiledChain(drafter) if compiled else None
        self.cache = None
        self.features = None  # (slots, max_len, H): h_j of each committed position j
        self.next_tokens = None  # (slots, max_len): x_{j+1}
        self.drafted: list[int] = []  # per slot: pairs the drafter's cache holds
        self.slot_rows = None  # (slots,): each slot's first row in the flattened features
        self.queued: list[tuple] = []  # steps' observations not yet written (`observe`)
        self.chained: list[int] | None = None  # per request, where the last chain's extend ended
        self.recent: tuple | None = None  # (firsts, features, tokens) the SD step observed from there
        self.draws: TargetDraws | None = None  # how the target draws this generate's tokens (None: greedy)

    @property
    def setup_s(self) -> float:
        return self.chain.seconds if self.chain is not None else 0.0

    @property
    def notice(self) -> str | None:
        if self.chain is None or not self.chain.seconds:
            return None
        if self.chain.error:
            return f"spec.compile: compiling the draft chains failed ({self.chain.error}); they run eager"
        return (f"spec.compile: draft chains compiled in {self.chain.seconds:.1f} s so far (batch sizes x depths: "
                f"{', '.join(f'{b}x{d}' for b, d in sorted(self.chain.ready))})")

    def reserve(self, slots: int, max_len: int) -> None:
        # the drafter's inference weights derived afresh: between rollouts it may have been
        # trained by a fused optimizer step, which no version counter records (`DraftStep`)
        self.drafter.step(rebuild=True)
        w = self.drafter.fc.weight
        if self.features is None or self.features.shape[0] < slots or self.features.shape[1] < max_len:
            H = self.drafter.config.hidden_size
            self.features = torch.zeros(slots, max_len, H, dtype=w.dtype, device=w.device)
            self.next_tokens = torch.zeros(slots, max_len, dtype=torch.long, device=w.device)
            self.slot_rows = torch.arange(slots, device=w.device) * max_len
        # A draft extend right-pads every request to the longest backlog in the batch (a
        # late-admitted request's whole prompt), so drafter rows reach up to twice max_len.
        c = self.cache
        if c is None or c.slots < slots or c.max_len < 2 * max_len:
            self.cache = self.drafter.new_cache(slots, 2 * max_len)
        self.drafted = [0] * self.features.shape[0]
        self.queued, self.chained, self.recent = [], None, None

    def couple(self, draws: TargetDraws | None) -> None:
        self.draws = draws

    def admit(self, requests: list) -> None:
        for r in requests:
            self.drafted[r.slot] = 0

    def observe(self, slots, positions, hidden, next_tokens) -> None:
        chained, self.chained, self.recent = self.chained, None, None
        if chained is not None and isinstance(slots, slice) and positions.shape[0] == len(chained):
            # An SD step's pairs, from each request's `cached`, where its chain left it: the
            # next chain's backlog (accepted pairs first, the rest padding), read from here
            # instead of gathered back out of `features` (~30 µs of a 3-ms step at batch 1).
            self.recent = (chained, hidden, next_tokens)
        if isinstance(slots, slice):
            # A plain or SD step's pairs (slots 0..B-1, in order): queued, and written with the
            # next ones at the next read or move, one write per width. A write per step cost
            # ~25 µs in a rollout (1-1.5% of a plain step, ~1% of an SD step at batch 1); the
            # queue's writes per finished request or switch cost about as much as one. In one
            # write the same row must not be written twice: an SD step marks the pairs of its
            # rejected drafts (position -1), which go to the unused last row.
            self.queued.append((positions, hidden, next_tokens))
            if len(self.queued) >= QUEUE_LIMIT:
                self._flush()
            return
        self._flush()
        self._write(slots * self.features.shape[1], positions, hidden, next_tokens)

    def _flush(self) -> None:
        if self.queued:
            widths: dict[int, list] = {}
            for entry in self.queued:
                widths.setdefault(entry[0].shape[1], []).append(entry)
            self.queued = []
            for entries in widths.values():
                positions, hidden, tokens = zip(*entries)
                first = torch.cat([self.slot_rows[: len(p)] for p in positions])
                self._write(first, torch.cat(positions), torch.cat(hidden), torch.cat(tokens))

    def _write(self, first, positions, hidden, next_tokens) -> None:
        """Pairs at `positions` (n, k) of the slots whose first flat rows are `first` (n,),
        through one flat index (advanced (slot, position) indexing took twice as long); those
        at position -1 (not committed) and past the end to each slot's last row, which no
        request reaches (`reserve` leaves room for a whole tree past the longest)."""
        S, L, H = self.features.shape
        index = (first[:, None] + positions.clamp(max=L - 1).remainder(L)).flatten()
        self.features.view(S * L, H).index_copy_(0, index, hidden.reshape(-1, H).to(self.features.dtype))
        self.next_tokens.view(S * L).index_copy_(0, index, next_tokens.reshape(-1))

    def hidden_of(self, slot: int, rows: int) -> torch.Tensor:
        self._flush()
        return self.features[slot, :rows]

    def move_slot(self, src: int, dst: int, rows: int) -> None:
        self._flush()
        self.recent = None  # its rows are the batch's before the move
        if self.drafted[src]:  # in plain decoding nothing is drafted: the drafter's cache is empty
            self.cache.copy_slot(src, dst, self.drafted[src])
        self.features[dst, :rows] = self.features[src, :rows]
        self.next_tokens[dst, :rows] = self.next_tokens[src, :rows]
        self.drafted[dst] = self.drafted[src]

    def catch_up(self, running: list) -> bool:
        """Run the drafter over every observed pair but each request's last (the backlog of
        plain steps, prefills and model-free drafts), leaving the SD step only its own extend."""
        self._flush()
        behind = [r for r in running if r.cached - self.drafted[r.slot] > 1]
        if behind:
            self._share_siblings(behind)
            rest = [r for r in behind if r.cached - self.drafted[r.slot] > 1]
            if rest:
                self._extend(rest, [r.cached - 1 for r in rest])
        return bool(behind)

    def _share_siblings(self, behind: list) -> None:
        """Siblings of a prompt that nothing has been drafted for yet hold the same pairs over
        the prompt (one prefill observed them): the drafter runs over the first sibling's
        backlog, and each other copies its rows up to where their pairs part, as the engine
        copies the target's prompt rows. A default job's rollout starts with 8 siblings per
        prompt, so this is 1/8 of the drafter work at the switch."""
        groups: dict[int, list] = {}
        for r in behind:
            if self.drafted[r.slot] == 0:
                groups.setdefault(r.prompt_index, []).append(r)
        leaders, copies = [], []
        for leader, *siblings in (g for g in groups.values() if len(g) > 1):
            end = leader.cached - 1
            rows = torch.tensor([r.slot for r in siblings], device=self.features.device)
            same = (self.features[rows, :end] == self.features[leader.slot, :end]).all(-1) \
                & (self.next_tokens[rows, :end] == self.next_tokens[leader.slot, :end])
            common = same.int().cumprod(1).sum(1).tolist()  # pairs equal from the first on
            leaders.append(leader)
            copies += [(leader.slot, r.slot, min(n, r.cached - 1)) for r, n in zip(siblings, common) if n]
        if leaders:
            self._extend(leaders, [r.cached - 1 for r in leaders])
        for src, dst, n in copies:
            self.cache.copy_slot(src, dst, n)
            self.drafted[dst] = n

    def _backlog(self, slot_ids: list[int], firsts: list[int], ends: list[int], width: int):
        """The pairs [first, end) of each slot (`firsts` = its `drafted`), right-padded to
        `width`: tokens, features, first rows and last real index; marks them drafted."""
        dev = self.features.device
        starts = torch.tensor(firsts, device=dev)
        rows = torch.tensor(slot_ids, device=dev)[:, None]
        index = (starts[:, None] + torch.arange(width, device=dev)).clamp(max=self.features.shape[1] - 1)
        last = torch.tensor([e - f - 1 for f, e in zip(firsts, ends)], device=dev)
        for s, e in zip(slot_ids, ends):
            self.drafted[s] = e
        return self.next_tokens[rows, index], self.features[rows, index], starts, last

    def _extend(self, requests: list, ends: list[int]):
        """The drafter over pairs [drafted, end) of each request, written into its cache;
        returns its logits and features at each request's last pair."""
        slot_ids = [r.slot for r in requests]
        firsts = [self.drafted[s] for s in slot_ids]
        width = max(e - f for f, e in zip(firsts, ends))
        slots = slice(0, len(requests)) if slot_ids == list(range(len(requests))) else \
            torch.tensor(slot_ids, device=self.features.device)
        ids, hidden, starts, last = self._backlog(slot_ids, firsts, ends, width)
        span = max(firsts) + width
        return self.drafter.decode(ids, hidden, self.cache, slots, starts, span=span, last=last)

    def _chain(self, running: list, depth: int, floor: float = 0.0) -> Tree:
        """A chain (strategy D_1_(D+1)): `Drafter.draft_chain` over each request's backlog,
        compiled (`CompiledChain`) where it applies (a compiled bucket, a backlog of at most
        depth + 1 pairs, a fixed depth), else eager. The backlog is the last SD step's pairs
        when they are it (`observe`), else gathered from `features`; its last pair's token is
        pending. With a confidence `floor` (D_1_(D+1)@C) it may stop short of `depth`."""
        slot_ids, ends = [r.slot for r in running], [r.cached for r in running]
        # the engine keeps a batch in slots 0..B-1 (`Engine._compact`), as the verify reads it
        assert slot_ids == list(range(len(running))), slot_ids
        firsts = [self.drafted[s] for s in slot_ids]
        width = max(e - f for f, e in zip(firsts, ends))
        bucket = self.chain.bucket(len(running), self.cache) if self.chain is not None and not floor else None
        if bucket is not None and width > depth + 1:
            bucket = None  # a longer backlog runs eager
        W = width if bucket is None else depth + 1  # a compiled chain's extend is padded to depth + 1 pairs
        recent, self.recent = self.recent, None
        # (compiled, the same width: a narrowed, strided backlog would be a new graph)
        if recent is not None and recent[0] == firsts and recent[1].shape[1] >= W and (
                bucket is None or recent[1].shape[1] == W):
            hidden, ids = recent[1][:, :W], recent[2][:, :W]
            # every backlog W pairs long (batch 1 always): its last pair is the last column,
            # taken with a slice instead of an index tensor and two gathers
            lasts = [e - f - 1 for f, e in zip(firsts, ends)]
            last = None if bucket is None and min(lasts) == W - 1 else torch.tensor(lasts, device=ids.device)
            for s, e in zip(slot_ids, ends):
                self.drafted[s] = e
        else:
            self._flush()
            ids, hidden, _, last = self._backlog(slot_ids, firsts, ends, W)
        # every backlog the same W pairs at the same rows (batch 1 always): the eager chain takes
        # its rows by slicing, and every row's last pair is its last column
        same = bucket is None and len(set(firsts)) == 1 and len(set(ends)) == 1
        if same:
            last = None
        pending = ids.narrow(1, W - 1, 1) if last is None else ids.gather(1, last[:, None])
        index = None if same else chain_index(firsts, ends, W, depth, ids.device)
        span = max(max(firsts) + W, max(ends) + depth - 1)
        coupled = None if self.draws is None else (self.draws.ahead(running, depth), coupled_drafts, self.draws.params)
        drafts = None
        if bucket is not None:
            drafts = self.chain(self.cache, ids, hidden, index, last, depth, span, bucket, coupled)
            if drafts is not None:
                PHASES.mark("sd: draft chain (compiled)")
        if drafts is None:  # eager, or the graph failed to compile
            drafts = self.drafter.draft_chain(
                self.cache.kv[0], self.cache, slice(0, len(running)), ids, hidden, index, last, depth, span,
                mark=lambda d: PHASES.mark(f"sd: draft level {d + 1}" if d else "sd: drafter extend (draft level 1)"),
                first=firsts[0] if same else None, floor=floor, coupled=coupled)
        self.chained = ends
        return chain_tree(torch.cat((pending, drafts), 1))

    def propose(self, running: list, starts: torch.Tensor, strategy: Strategy) -> Tree:
        if strategy.topk == 1:
            return self._chain(running, strategy.depth, strategy.confidence)
        self.recent = None
        self._flush()
        pending = self.next_tokens[torch.arange(len(running), device=starts.device), starts - 1]
        logits, out = self._extend(running, [r.cached for r in running])
        PHASES.mark("sd: drafter extend (draft level 1)")
        draws = None if self.draws is None else (self.draws.ahead(running, strategy.depth), self.draws.params)
        return eagle_tree(self.drafter, self.cache, len(running), starts, logits, out, pending, strategy,
                          max(r.cached for r in running), draws)

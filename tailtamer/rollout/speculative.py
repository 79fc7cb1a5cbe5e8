"""Lossless speculative decoding: draft a token tree, verify it in one target forward, commit.

One SD step for a batch of running requests, each with a pending token s (sampled, not yet
in the target's KV cache):
  1. a proposer (EAGLE drafter or n-gram) returns a tree of N nodes per request: node 0 is s,
     the others are draft tokens with a parent each (`Tree`);
  2. the target runs once over the N nodes with the tree attention mask (rotary position =
     cache length + depth), giving its next-token distribution p at every node;
  3. `walk_tree` emits tokens by the exact rule below, `commit` moves the accepted nodes'
     KV rows to consecutive positions; the last emitted token is the new pending token.

The rule (SpecInfer, Miao et al. 2024, for deterministic distinct drafts; the rule of
SGLang's tree_speculative_sampling_target_only, fastrl-code.md §3.4): at the current node,
draw x ~ p with the request's own generator; if x is the token of one of the node's
children, descend into that child and repeat; otherwise emit x and stop. Every emitted token
is a draw from the target's conditional distribution given everything before it, so the
output distribution is exactly the target's; a child is accepted with probability p(child),
the most a deterministic proposal allows. Greedy decoding is the same walk with x = argmax p.
Because each emitted token consumes exactly one draw from the request's generator, SD and
plain decoding produce the same tokens for the same seed (up to float rounding of p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailtamer.errors import ConfigError
from tailtamer.rollout.sampling import sample


# Acceptance rules by name. Only the exact rule exists: relaxed rules (acceptance thresholds
# below 1, "typical" acceptance, greedy verification of sampled requests) change what the
# policy samples, so they are refused by name instead of being options.
ACCEPTANCE_RULES = ("exact",)
LOSSY_RULES = ("typical", "threshold", "relaxed", "greedy_under_sampling", "lenient")


# BEG-MAB defaults: two real choices per tokens-to-verify group (fastrl's defaults have one,
# so its bandit never learns), buckets of batch sizes 1-2, 3-8 and 9+ (Strategy.verify 8/5/3).
DEFAULT_MAB_STRATEGIES = ("4_2_8", "3_3_8", "4_1_5", "2_2_5", "2_1_3", "1_2_3")
DEFAULT_BUCKET_THRESHOLDS = (1, 3, 9)


@dataclass(frozen=True)
class SpecConfig:
    mode: str = "off"  # off | on (SD every step, fixed strategy) | adaptive (SD in the long tail, tuned)
    strategy: str = "4_2_8"  # DEPTH_TOPK_VERIFY for mode=on and tuner=fixed
    drafter: str | None = None  # an EAGLE drafter directory, or "ngram" (model-free)
    acceptance: str = "exact"  # the only rule; see ACCEPTANCE_RULES
    bs_threshold: int = 4  # adaptive: speculate once at most this many requests run (bench sd: SD >= plain only for B <= 4 here)
    tuner: str = "beg"  # adaptive: beg (bucketed epsilon-greedy bandit) or fixed
    strategies: tuple[str, ...] = DEFAULT_MAB_STRATEGIES  # beg: the arms (plus "no SD" in every bucket)
    bucket_thresholds: tuple[int, ...] = DEFAULT_BUCKET_THRESHOLDS  # beg: one per tokens-to-verify group
    epsilon: float = 0.1  # beg: exploration probability
    window: int = 30  # beg: rewards kept per arm (median)
    seed: int = 0  # beg: exploration randomness (never the sampling randomness)

    def __post_init__(self):
        if self.mode not in ("off", "on", "adaptive"):
            raise ConfigError(f"spec.mode must be off, on or adaptive, got {self.mode!r}")
        if self.acceptance in LOSSY_RULES or self.acceptance not in ACCEPTANCE_RULES:
            raise ConfigError(f"spec.acceptance {self.acceptance!r} is refused: tailtamer only verifies "
                              f"losslessly ({', '.join(ACCEPTANCE_RULES)}); a relaxed rule would change "
                              f"what the policy samples")
        try:
            Strategy.parse(self.strategy)
        except ConfigError as e:
            raise ConfigError(f"spec.strategy: {e}") from None
        if self.mode != "off" and not self.drafter:
            raise ConfigError(f"spec.mode {self.mode} needs a drafter: a drafter directory or 'ngram'")
        if self.tuner not in ("beg", "fixed"):
            raise ConfigError(f"spec.tuner must be beg or fixed, got {self.tuner!r}")
        if self.bs_threshold < 1:
            raise ConfigError(f"spec.bs_threshold must be >= 1, got {self.bs_threshold}")
        if self.mode == "adaptive" and self.tuner == "beg":
            self.make_tuner()  # validates strategies against bucket thresholds

    def make_tuner(self):
        from tailtamer.rollout.tuner import BEGTuner, FixedTuner

        if self.mode == "on" or self.tuner == "fixed":
            return FixedTuner(Strategy.parse(self.strategy))
        return BEGTuner([Strategy.parse(s) for s in self.strategies], list(self.bucket_thresholds),
                        self.epsilon, self.window, self.seed)


@dataclass(frozen=True)
class Strategy:
    """`D_K_N`: draft depth D, top-k K per expansion, N tokens to verify (tree size with the root)."""

    depth: int
    topk: int
    verify: int

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.verify < 2:
            raise ConfigError(f"strategy {self.name}: need depth >= 1, topk >= 1 and tokens to verify >= 2")
        if self.verify - 1 > self.candidates:
            raise ConfigError(f"strategy {self.name}: {self.verify - 1} draft tokens requested but depth "
                              f"{self.depth} x top-k {self.topk} yields only {self.candidates} candidates")

    @property
    def candidates(self) -> int:
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def name(self) -> str:
        return f"{self.depth}_{self.topk}_{self.verify}"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        parts = str(text).split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ConfigError(f"strategy {text!r} is not DEPTH_TOPK_VERIFY (e.g. 4_2_8)")
        return cls(*map(int, parts))


@dataclass
class Tree:
    """Per request (B rows) N nodes; node 0 is the pending token. parent = -1 for the root and
    for padding nodes (`valid` False), which no walk ever reaches."""

    tokens: torch.Tensor  # (B, N) long
    parents: torch.Tensor  # (B, N) long
    depths: torch.Tensor  # (B, N) long
    valid: torch.Tensor  # (B, N) bool

    def attention_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[b, i, j] = node j is node i or one of its ancestors (parent -1 = none)."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    ancestor = parents
    for _ in range(N - 1):  # one level per pass; stops at the deepest node
        has = ancestor >= 0
        if not has.any():
            break
        mask |= torch.nn.functional.one_hot(ancestor.clamp(min=0), N).bool() & has[..., None]
        ancestor = torch.where(has, torch.gather(parents, 1, ancestor.clamp(min=0)), ancestor)
    return mask


def children_of(parents: list[int], tokens: list[int], valid: list[bool]) -> list[dict[int, int]]:
    """children[node] = {token: child index}; drafts of one parent are distinct by construction."""
    children: list[dict[int, int]] = [{} for _ in parents]
    for i, (p, ok) in enumerate(zip(parents, valid)):
        if i and ok and p >= 0:
            children[p].setdefault(tokens[i], i)
    return children


def walk_tree(probs: torch.Tensor, children: list[dict[int, int]], generator: torch.Generator,
              greedy: bool, emit) -> list[int]:
    """The exact acceptance walk for one request (module docstring). probs (N, V) are the
    target's processed distributions at each node; `emit(token) -> bool` records a token and
    says whether the request is finished. Returns the accepted path of node indices (root
    first); the last emitted token follows the path's last node."""
    node, path = 0, [0]
    while True:
        x = int(sample(probs[node][None], [generator], greedy)[0])
        if emit(x):
            return path
        child = children[node].get(x)
        if child is None:
            return path
        node = child
        path.append(child)


def eagle_tree(drafter, cache, batch: int, starts: torch.Tensor, root_logits: torch.Tensor,
               root_hidden: torch.Tensor, pending: torch.Tensor, strategy: Strategy) -> Tree:
    """EAGLE-2 style dynamic tree (Li et al. 2024b): expand the top-k beams by cumulative draft
    log-probability for `depth` levels, then keep the N-1 best of all candidates.

    root_logits / root_hidden: the drafter's output for pair (h_{n-1}, s) with s pending, i.e.
    its guess of the distribution after s. Draft rows of depth-d beams go to drafter cache
    rows starts + (d-1)K + i at position starts - 1 + d; each beam attends to its ancestors'
    rows only (a window mask over all draft rows of this step).
    """
    B, K, D = batch, strategy.topk, strategy.depth
    dev = root_logits.device
    logp = torch.log_softmax(root_logits.float(), -1)
    score, tok = logp.topk(K, dim=-1)  # (B, K)
    cand_tok, cand_score = [tok], [score]
    cand_parent = [torch.full((B, K), -1, device=dev)]
    cand_depth = [torch.ones(B, K, dtype=torch.long, device=dev)]
    beam_idx = torch.arange(K, device=dev).expand(B, K)  # candidate index of each beam
    beam_tok, beam_score = tok, score
    beam_hidden = root_hidden[:, None].expand(B, K, root_hidden.shape[-1])
    rows = (D - 1) * K
    beam_anc = torch.zeros(B, K, max(rows, 1), dtype=torch.bool, device=dev)
    n_cand = K
    for d in range(1, D):
        col = (d - 1) * K + torch.arange(K, device=dev)
        mask = beam_anc[:, :, : d * K].clone()
        mask[:, torch.arange(K), col] = True
        positions = (starts - 1 + d)[:, None].expand(B, K)
        logits, hidden = drafter.decode(beam_tok, beam_hidden, cache, slice(0, B), starts + (d - 1) * K,
                                        positions, mask)
        child_score, child_tok = torch.log_softmax(logits.float(), -1).topk(K, dim=-1)  # (B, K, K)
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
    tokens, scores = torch.cat(cand_tok, 1), torch.cat(cand_score, 1)
    parents, depths = torch.cat(cand_parent, 1), torch.cat(cand_depth, 1)
    # Stable sort: among equal scores the shallower (earlier) candidate wins, so every chosen
    # node's parent is chosen too (a child's score never exceeds its parent's).
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : strategy.verify - 1]
    chosen = torch.sort(order, dim=1).values  # candidate order = depth order: parents first
    # Map candidate index -> tree index (1-based; 0 is the pending root).
    tree_index = torch.full((B, n_cand), -1, dtype=torch.long, device=dev)
    tree_index.scatter_(1, chosen, torch.arange(1, strategy.verify, device=dev).expand(B, -1))
    chosen_parent = torch.gather(parents, 1, chosen)
    parent_tree = torch.where(chosen_parent < 0, torch.zeros_like(chosen_parent),
                              torch.gather(tree_index, 1, chosen_parent.clamp(min=0)))
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    return Tree(tokens=torch.cat([pending[:, None], torch.gather(tokens, 1, chosen)], 1),
                parents=torch.cat([zero - 1, parent_tree], 1),
                depths=torch.cat([zero, torch.gather(depths, 1, chosen)], 1),
                valid=torch.ones(B, strategy.verify, dtype=torch.bool, device=dev))


class EagleProposer:
    """Drafts with an EAGLE drafter. Per request it keeps the pairs (h_j, x_{j+1}) the drafter
    has not yet seen (`Request.extend_hidden/extend_tokens`): the whole prompt after prefill,
    then the accepted path after each step. An SD step first runs the drafter over them
    ("draft extend", so its cache holds the target's true features for every committed
    position), then expands the tree from the last pair."""

    needs_hidden = True

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None

    def reserve(self, slots: int, max_len: int) -> None:
        c = self.cache
        if c is None or c.slots < slots or c.max_len < max_len:
            self.cache = self.drafter.new_cache(slots, max_len)

    def move_slot(self, src: int, dst: int, rows: int) -> None:
        self.cache.copy_slot(src, dst, rows)

    def catch_up(self, running) -> bool:
        """Run the drafter over every pending pair but each request's last: the backlog a
        plain phase (or a prefill) leaves. The engine times it apart from the SD step that
        follows, so the bandit does not charge the switch to the first arm it pulls. Returns
        whether there was a backlog."""
        behind = [r for r in running if len(r.extend_tokens) > 1]
        if behind:
            self._extend(behind, keep_last=True)
        return bool(behind)

    def _extend(self, running, keep_last: bool = False):
        """Draft extend: the drafter over the requests' pending pairs (all, or all but the
        last), writing its cache rows; returns its logits and features at each request's last
        pair processed."""
        dev = self.drafter.fc.weight.device
        B, cut = len(running), 1 if keep_last else 0
        lengths = [len(r.extend_tokens) - cut for r in running]
        width = max(lengths)
        H = running[0].extend_hidden[0].shape[-1]
        ids = torch.zeros(B, width, dtype=torch.long, device=dev)
        hidden = torch.zeros(B, width, H, dtype=self.drafter.fc.weight.dtype, device=dev)
        for b, (r, n) in enumerate(zip(running, lengths)):
            ids[b, :n] = torch.tensor(r.extend_tokens[:n], device=dev)
            hidden[b, :n] = torch.cat(r.extend_hidden)[:n]
        draft_starts = torch.tensor([r.draft_cached for r in running], device=dev)
        slot_ids = [r.slot for r in running]
        slots = slice(0, B) if slot_ids == list(range(B)) else torch.tensor(slot_ids, device=dev)
        logits, out = self.drafter.decode(ids, hidden, self.cache, slots, draft_starts)
        for r, n in zip(running, lengths):
            r.draft_cached += n
            rest = torch.cat(r.extend_hidden)[n:]
            r.extend_tokens, r.extend_hidden = r.extend_tokens[n:], [rest] if len(rest) else []
        rows, last = torch.arange(B, device=dev), torch.tensor(lengths, device=dev) - 1
        return logits[rows, last], out[rows, last]

    def propose(self, running, starts: torch.Tensor, strategy: Strategy) -> Tree:
        B, dev = len(running), starts.device
        logits, out = self._extend(running)
        pending = torch.tensor([r.output_ids[-1] for r in running], device=dev)
        return eagle_tree(self.drafter, self.cache, B, starts, logits, out, pending, strategy)


def make_speculator(spec: SpecConfig, target) -> dict:
    """Engine keyword arguments (proposer, tuner, bs_threshold) for `spec`; {} when it is off."""
    if spec.mode == "off":
        return {}
    if spec.drafter == "ngram":
        from tailtamer.rollout.ngram import NgramProposer

        proposer = NgramProposer()
    else:
        from tailtamer.model.drafter import load_drafter

        proposer = EagleProposer(load_drafter(spec.drafter, target))
    return {"proposer": proposer, "tuner": spec.make_tuner(),
            "bs_threshold": spec.bs_threshold if spec.mode == "adaptive" else None}

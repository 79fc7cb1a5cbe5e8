"""Lossless speculative decoding: the draft tree, its attention mask and the exact rule.

One SD step for a batch of running requests, each with a pending token s (sampled, not yet
in the target's KV cache):
  1. a proposer (rollout/eagle.py, rollout/suffix.py, rollout/fused.py) returns a tree of N
     nodes per request: node 0 is s, the others are draft tokens with a parent each (`Tree`);
  2. the target runs once over the N nodes with the tree attention mask (rotary position =
     cache length + depth), giving its next-token distribution p at every node;
  3. `accept` applies the exact rule below to the whole batch at once; the engine commits the
     accepted nodes' KV rows to consecutive positions; the last emitted token is pending.

The rule (SpecInfer, Miao et al. 2024, for deterministic distinct drafts; the rule of
SGLang's tree_speculative_sampling_target_only, fastrl-code.md §3.4): at the current node,
draw x ~ p; if x is the token of one of the node's children, descend into that child and
repeat; otherwise emit x and stop. Every emitted token is a draw from the target's
conditional distribution given everything before it, so the output distribution is exactly
the target's; a child is accepted with probability p(child) if it was drafted without the
target's noise, and with the coupled agreement of `drafter.estimate.chain_acceptance` if it
is the drafter's own draw with that noise (`sampling.coupled_drafts`). Greedy decoding is the
same walk with x = argmax p. The draw for the token at response index t uses the request's
noise for index t (rollout/sampling.py), whichever step emits it, so SD and plain decoding emit the same tokens for the same seed (up to float
rounding of p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailtamer.errors import ConfigError

# Acceptance rules by name. Only the exact rule exists: relaxed rules (acceptance thresholds
# below 1, "typical" acceptance, greedy verification of sampled requests) change what the
# policy samples, so they are refused by name instead of being options.
ACCEPTANCE_RULES = ("exact",)
LOSSY_RULES = ("typical", "threshold", "relaxed", "greedy_under_sampling", "lenient", "synthetic")


# Deeper drafts would need positions past the rotary table's headroom (model/transformer.py)
# and are never accepted anyway: EAGLE-2 and EAGLE-3 draft 5 to 8 levels.
MAX_DEPTH = 64
# A verify of N tokens a request costs N target tokens and an N x N tree mask: EAGLE-2
# verifies ~60, Sequoia's largest trees 768; a budget past this is a typo, which would only
# fail allocating.
MAX_VERIFY = 1024


@dataclass(frozen=True)
class Strategy:
    """`D_K_N`: draft depth D, top-k K per expansion, N tokens to verify (tree size with the root).

    `D_K_N@C`: the same budget, drafted only as deep as the drafter is confident. EAGLE-2 (Li
    et al. 2024, arXiv 2406.16858) observed that the drafter's probability approximates the
    chance a draft is accepted and reranks a fixed-depth tree by it; here it also sets the
    depth. A path's confidence is the product of the drafter's probabilities along it;
    drafting stops after the first level at which every running request's best path is
    below C (one confident request keeps the batch drafting), so D is the most it drafts.
    A chain then verifies the levels it drafted; a tree keeps its best N - 1 candidates (at
    most as many as were drafted). Which drafts are verified never changes what is accepted
    from them (`accept`), so this is lossless for any C.

    `sD_K_N`: the model-free drafter alone (rollout/suffix.py): at most N - 1 drafts from the
    suffix index of the request's group and history, at most D deep (and no deeper than the
    match allows), at most K children a node; with @C none whose estimated path probability
    is below C. `D_K_N+sM`: the fused tree, the EAGLE tree D_K_N and up to M drafts of the
    suffix index merged into it, verified in one forward (N + M tokens at most)."""

    depth: int
    topk: int
    verify: int
    confidence: float = 0.0  # 0: always D levels
    suffix: int = 0  # fused: drafts of the suffix index added to the EAGLE tree
    model_free: bool = False  # sD_K_N: drafted by the suffix index alone

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.verify < 2:
            raise ConfigError(f"strategy {self.name}: need depth >= 1, topk >= 1 and tokens to verify >= 2")
        if self.depth > MAX_DEPTH:
            raise ConfigError(f"strategy {self.name}: depth at most {MAX_DEPTH} (drafts that deep are never accepted)")
        if self.verify > MAX_VERIFY:
            raise ConfigError(f"strategy {self.name}: at most {MAX_VERIFY} tokens to verify a request, got "
                              f"{self.verify}")
        if self.topk == 1 and self.verify != self.depth + 1:  # a chain drafts its depth, all verified
            s = "s" if self.model_free else ""
            longer = f", or {s}{self.verify - 1}_1_{self.verify} for {self.verify - 1} drafts" \
                if self.verify - 1 <= MAX_DEPTH else ""
            raise ConfigError(f"strategy {self.name}: a chain (top-k 1) verifies its {self.depth} drafts and the "
                              f"pending token; write {s}{self.depth}_1_{self.depth + 1}{longer}")
        if self.verify - 1 > self.candidates:
            tree = (f"a suffix tree of depth {self.depth} and top-k {self.topk} holds at most" if self.model_free
                    else f"depth {self.depth} x top-k {self.topk} yields only")
            raise ConfigError(f"strategy {self.name}: {self.verify - 1} draft tokens requested but {tree} "
                              f"{self.candidates} candidates")
        if not 0 <= self.confidence < 1:
            raise ConfigError(f"strategy {self.name}: the confidence after @ must be in (0, 1), a path probability")
        if self.suffix < 0 or self.suffix > MAX_DEPTH or (self.suffix and self.model_free):
            raise ConfigError(f"strategy {self.name}: +sM adds 1 to {MAX_DEPTH} suffix drafts to an EAGLE tree")

    @property
    def candidates(self) -> int:
        """The most drafts a tree of this depth and top-k can offer: EAGLE's K at the first level
        and K² at each further one (the top K children of the K best nodes); the suffix index's
        trie K + K² + ... + K^D."""
        if self.model_free:
            return sum(self.topk ** d for d in range(1, self.depth + 1))
        return self.topk + (self.depth - 1) * self.topk ** 2

    @property
    def width(self) -> int:
        """The most tokens a request's tree verifies (the pending one included)."""
        return self.verify + self.suffix

    @property
    def name(self) -> str:
        return (("s" if self.model_free else "") + f"{self.depth}_{self.topk}_{self.verify}"
                + (f"@{self.confidence!r}" if self.confidence else "") + (f"+s{self.suffix}" if self.suffix else ""))

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        body, plus, extra = str(text).partition("+s")
        model_free = body.startswith("s")
        shape, at, floor = body[model_free:].partition("@")
        parts = shape.split("_")
        if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts) or (
                plus and not (extra.isascii() and extra.isdigit())):
            raise ConfigError(f"strategy {text!r} is not DEPTH_TOPK_VERIFY (e.g. 4_2_8), DEPTH_TOPK_VERIFY@CONFIDENCE "
                              f"(e.g. 12_1_13@0.3), sD_K_N (the suffix drafter alone, e.g. s8_2_9) or D_K_N+sM (M "
                              f"suffix drafts fused into the EAGLE tree, e.g. 4_1_5+s8)")
        try:
            confidence = float(floor) if at else 0.0
        except ValueError:
            confidence = -1.0
        if at and not 0 < confidence < 1:
            raise ConfigError(f"strategy {text!r}: the confidence after @ must be a number in (0, 1), a path "
                              f"probability")
        if plus and model_free:
            raise ConfigError(f"strategy {text!r}: +sM fuses suffix drafts into an EAGLE tree; {body} is the suffix "
                              f"drafter's arm already")
        if plus and int(extra) == 0:  # else read as the arm without it, another arm's name
            raise ConfigError(f"strategy {text!r}: +sM adds 1 to {MAX_DEPTH} suffix drafts to an EAGLE tree; write "
                              f"{body} for the EAGLE tree alone")
        return cls(*map(int, parts), confidence, int(extra) if plus else 0, model_free)


def rows_ahead(strategies: list[Strategy]) -> tuple[int, int]:
    """(verify, draft rows): the most tokens any of the arms verifies, which the target's cache
    holds past a request's end, and the most draft rows any drafts into the drafter's cache
    (a tree's beams below the first level; the suffix index drafts none)."""
    return (max(s.width for s in strategies),
            max(((s.depth - 1) * s.topk for s in strategies if not s.model_free), default=0))


@dataclass
class Tree:
    """Per request (B rows) N nodes, parents before children; node 0 is the pending token.
    parent = -1 for the root and for padding nodes (`valid` False), which no walk reaches.
    Children of one node carry distinct tokens."""

    tokens: torch.Tensor  # (B, N) long
    parents: torch.Tensor  # (B, N) long
    depths: torch.Tensor  # (B, N) long
    valid: torch.Tensor  # (B, N) bool
    depth: int  # the deepest node's depth (at most)
    chain: bool = False  # node i is at depth i with parent i - 1, all valid (N = depth + 1): causal attention
    sources: torch.Tensor | None = None  # (B, N) where each draft came from (suffix_index.SOURCE_NAMES); None: EAGLE

    def verify_inputs(self, starts: torch.Tensor):
        """(rotary positions, tree mask) for the verify forward; None, None for a chain, whose
        causal default the model applies with fewer operations."""
        if self.chain:
            return None, None
        return starts[:, None] + self.depths, ancestor_mask(self.parents, self.depth)


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """mask[b, i, j] = node j is node i or one of its ancestors (parent -1 = none), for trees
    at most `depth` deep: one level per pass."""
    B, N = parents.shape
    mask = torch.eye(N, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    ancestor = parents
    for _ in range(depth):
        has = ancestor >= 0
        mask |= torch.nn.functional.one_hot(ancestor.clamp(min=0), N).bool() & has[..., None]
        ancestor = torch.where(has, torch.gather(parents, 1, ancestor.clamp(min=0)), ancestor)
    return mask


def accept(tree: Tree, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact rule for a whole batch at once. draws (B, N): the target's draw x at every
    node (a sample of p, or argmax p), made with the noise of the response index the node's
    draw would emit. A node is reached when its token is its parent's draw and its parent is
    reached; the reached nodes form one chain from the root (distinct children), the walk's
    path, and the walk emits x at each node of it: the accepted drafts, then the target's own
    token. Returns (path (B, depth + 1): node indices in depth order; tokens (B, depth + 1):
    the emitted tokens; length (B,): how many of each are valid)."""
    if tree.chain:
        return accept_chain(tree.tokens, draws)
    parent = tree.parents.clamp(min=0)
    # A node without a parent is never reached, even if marked valid: its verify logits were
    # computed without the root and the path (a tree built from NaN scores can hold one), so
    # emitting its draw would break the rule. Checked here, where losslessness is decided.
    match = tree.valid & (tree.parents >= 0) & (tree.tokens == draws.gather(1, parent))
    match[:, 0] = True
    reached = match
    for _ in range(tree.depth):
        reached = match & reached.gather(1, parent)
    key = torch.where(reached, tree.depths, tree.depth + 1)
    path = key.argsort(dim=1, stable=True)[:, : tree.depth + 1]
    return path, draws.gather(1, path), reached.sum(1)


def accept_chain(tokens: torch.Tensor, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept` for chains (node i at depth i, child of node i − 1), in a third of its operations
    (an SD step at batch 1 is a few milliseconds): draft i is reached when tokens[i] = draws[i − 1]
    and every draft before it is, so the walk's length is n = 1 + Σ_i Π_{j ≤ i} [tokens[j] =
    draws[j − 1]], its path the nodes 0..depth in order and its tokens the draws themselves."""
    B, N = tokens.shape
    length = (tokens[:, 1:] == draws[:, :-1]).cumprod(1).sum(1) + 1
    return torch.arange(N, device=tokens.device).expand(B, N), draws, length

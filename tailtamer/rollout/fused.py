"""The EAGLE drafter and the suffix index in one proposer: each alone, or fused in one tree.

An arm's strategy says which: `D_K_N` the EAGLE tree (rollout/eagle.py), `sD_K_N` the suffix
index's (rollout/suffix.py), `D_K_N+sM` both, merged into one trie verified by one target
forward. Where the two propose the same token at the same place the node is shared, so a
fused tree verifies at most N + M tokens and the suffix index pays only where it adds a guess.

Why the exact rule stays exact for a fused tree, whatever proposed its nodes: the rule
(`speculative.accept`) takes at every node the target's draw x, made with the request's noise
for the response index x would be emitted at (Gumbel-max: x = argmax log p + g, exactly a draw
of p; argmax p when greedy), descends into the child whose token is x (children carry distinct
tokens, so at most one), and else emits x. A node is reached only when every token above it is
its parent's draw, so its verify saw exactly the tokens emitted before, and the walk emits
what plain decoding emits with the same noise, one token per response index. The tree decides
only how many of those draws one forward confirms. So any mix of sources is exact: the index's
followers, chosen without the noise, are confirmed with probability p(t) (SpecInfer, Miao et
al. 2024, for several deterministic drafts at a node), and EAGLE's drafts coupled to that very
noise (`sampling.coupled_drafts`) more often, which only changes speed.
"""

from __future__ import annotations

import torch

from tailtamer.rollout.eagle import EagleProposer
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.speculative import Strategy, Tree
from tailtamer.rollout.stats import PHASES
from tailtamer.rollout.suffix import SuffixProposer, build_tree
from tailtamer.rollout.suffix_index import EAGLE

SUFFIX_TOPK = 2  # children a node of a fused tree's suffix part (its budget: the arm's M)


class FusedProposer(Proposer):
    needs_hidden = True

    def __init__(self, eagle: EagleProposer, suffix: SuffixProposer):
        self.eagle, self.suffix = eagle, suffix
        self.drafter = eagle.drafter

    @property
    def setup_s(self) -> float:
        return self.eagle.setup_s

    @property
    def notice(self) -> str | None:
        return self.eagle.notice

    def reserve(self, slots: int, max_len: int) -> None:
        self.eagle.reserve(slots, max_len)
        self.suffix.reserve(slots, max_len)

    def couple(self, draws) -> None:
        self.eagle.couple(draws)

    def admit(self, requests: list) -> None:
        self.eagle.admit(requests)
        self.suffix.admit(requests)

    def retire(self, requests: list) -> None:
        self.suffix.retire(requests)

    def observe(self, slots, positions, hidden, next_tokens) -> None:
        self.eagle.observe(slots, positions, hidden, next_tokens)

    def move_slot(self, src: int, dst: int, rows: int) -> None:
        self.eagle.move_slot(src, dst, rows)

    def hidden_of(self, slot: int, rows: int) -> torch.Tensor:
        return self.eagle.hidden_of(slot, rows)

    def catch_up(self, running: list) -> bool:
        return self.eagle.catch_up(running)

    def propose(self, running: list, starts: torch.Tensor, strategy: Strategy) -> Tree:
        if strategy.model_free:
            return self.suffix.propose(running, starts, strategy)
        tree = self.eagle.propose(running, starts, strategy)
        if not strategy.suffix:
            return tree
        nodes = self.suffix.drafts(running, strategy.suffix, strategy.suffix, SUFFIX_TOPK, 0.0)
        if not any(nodes):
            return tree
        self.eagle.chained = None  # its next chain reads its backlog from the features, not this step's path
        fused = fuse(tree, nodes)
        PHASES.mark("sd: fuse the trees")
        return fused


def fuse(tree: Tree, nodes: list[list[tuple]]) -> Tree:
    """`tree` (its nodes all valid) with each request's suffix nodes (token, parent, depth,
    probability, source; parent -1 = the root, parents first) merged in: a node whose token its
    parent already has as a child is that child, the others are appended (`build_tree`: a
    chain where the index only extended EAGLE's chain in every request)."""
    tokens, parents, depths = (t.tolist() for t in (tree.tokens, tree.parents, tree.depths))
    sources = tree.sources.tolist() if tree.sources is not None else [[0] + [EAGLE] * (len(row) - 1) for row in tokens]
    for b, row in enumerate(nodes):
        tok, par, dep, src = tokens[b], parents[b], depths[b], sources[b]
        child = {(par[i], tok[i]): i for i in range(1, len(tok))}
        at: list[int] = []  # suffix node -> tree node
        for token, parent, _, _, source in row:
            p = at[parent] if parent >= 0 else 0
            i = child.get((p, token))
            if i is None:
                i = child[p, token] = len(tok)
                tok.append(token)
                par.append(p)
                dep.append(dep[p] + 1)
                src.append(source)
            at.append(i)
    return build_tree(tokens, parents, depths, sources, tree.tokens.device)

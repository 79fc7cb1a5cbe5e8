"""Model-free drafting from the prompt and the sibling responses of the same prompt group.

The fallback before a learned drafter exists (TLT-Base; Lookahead-style retrieval, Zhao et
al. 2024): find earlier occurrences of the request's last n tokens (longest n first) in its
own prompt + response and in its siblings' responses, and propose what followed them. Up
to top-k distinct continuations are merged into a trie, so several guesses are verified in
one target forward. Proposals only affect speed: verification is the same exact rule.
"""

from __future__ import annotations

import torch

from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.speculative import Strategy, Tree


def continuations(context: list[int], corpus: list[list[int]], max_n: int, min_n: int, length: int,
                  limit: int) -> list[list[int]]:
    """Up to `limit` distinct continuations (each up to `length` tokens) of the longest suffix
    of `context` (max_n down to min_n tokens) found in `corpus`, most recent match first."""
    found: list[list[int]] = []
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        key = context[-n:]
        for seq in corpus:
            own = seq is context
            end = len(seq) - (1 if own else 0)  # in its own context, skip the suffix itself
            last = key[-1]
            for start in range(end - n, -1, -1):
                if seq[start + n - 1] == last and seq[start: start + n] == key:
                    follow = seq[start + n: start + n + length]
                    if follow and follow not in found:
                        found.append(follow)
                        if len(found) == limit:
                            return found
        if found:
            return found
    return found


def trie_tree(pending: int, branches: list[list[int]], size: int) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, depths) of a trie rooted at the pending token, at most `size` nodes,
    filled breadth-first so shallow (likelier) nodes are kept."""
    tokens, parents, depths = [pending], [-1], [0]
    index: dict[tuple[int, ...], int] = {(): 0}
    for depth in range(1, max((len(b) for b in branches), default=0) + 1):
        for branch in branches:
            if len(branch) < depth or len(tokens) == size:
                continue
            prefix = tuple(branch[:depth])
            if prefix in index:
                continue
            index[prefix] = len(tokens)
            tokens.append(branch[depth - 1])
            parents.append(index[prefix[:-1]])
            depths.append(depth)
    return tokens, parents, depths


class NgramProposer(Proposer):
    """Reads the text itself, so of the engine's hooks it needs only `admit` (the siblings)."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.groups: dict[int, list] = {}

    def reserve(self, slots: int, max_len: int) -> None:
        self.groups = {}

    def admit(self, requests: list) -> None:
        """Group requests by prompt so each can read its siblings' responses."""
        for r in requests:
            self.groups.setdefault(r.prompt_index, []).append(r)

    def propose(self, running: list, starts: torch.Tensor, strategy: Strategy) -> Tree:
        N, dev = strategy.verify, starts.device
        tokens, parents, depths, valid = [], [], [], []
        for r in running:
            context = r.prompt_ids + r.output_ids
            corpus = [context] + [s.output_ids for s in self.groups.get(r.prompt_index, []) if s is not r]
            branches = continuations(context, corpus, self.max_n, self.min_n, strategy.depth, strategy.topk)
            t, p, d = trie_tree(r.output_ids[-1], branches, N)
            pad = N - len(t)
            tokens.append(t + [0] * pad)
            parents.append(p + [-1] * pad)
            depths.append(d + [1] * pad)
            valid.append([True] * len(t) + [False] * pad)
        as_tensor = lambda rows, dtype: torch.tensor(rows, dtype=dtype, device=dev)  # noqa: E731
        return Tree(as_tensor(tokens, torch.long), as_tensor(parents, torch.long), as_tensor(depths, torch.long),
                    as_tensor(valid, torch.bool), depth=strategy.depth)

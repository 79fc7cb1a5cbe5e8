"""The model-free drafter: drafts from the group's siblings, the request's own text and the
prompt's earlier responses, through one suffix index per prompt group (rollout/suffix_index.py).

GRPO samples each prompt several times and sees it again in later epochs. A long-tail request's
siblings have often already written what it is about to write, and so have earlier responses
to the same prompt: Seer (arXiv 2511.14617) drafts from the siblings, RhymeRL (arXiv
2508.18588) from the previous epoch, SuffixDecoding (arXiv 2411.04975) from both through
suffix trees. Here each group's index holds every sibling's prompt + response, extended as the
engine commits tokens (so running siblings read each other at once), and the last responses to
the same prompt from earlier rollouts (`DraftHistory`, kept with the checkpoint). Proposals
only affect speed: verification is the same exact rule, and a deterministic draft is accepted
with probability p(token) (rollout/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tailtamer.rollout.draft_history import DraftHistory
from tailtamer.rollout.eagle import chain_tree
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.speculative import Strategy, Tree
from tailtamer.rollout.stats import PHASES
from tailtamer.rollout.suffix_index import SuffixIndex

# Draft at most ALPHA x the matched length (SuffixDecoding's max_spec_factor, 1 there): a
# match of a few tokens predicts little, a long one (a sibling's line repeated) a lot.
ALPHA = 2.0
MIN_MATCH = 2  # a one-token match is a unigram guess


@dataclass
class _Group:
    """A prompt group: its index (built when one of its requests is first drafted for), its
    members [request, tokens indexed, text in the index] and the prompt's earlier responses."""
    earlier: tuple
    index: SuffixIndex | None = None
    members: list = field(default_factory=list)


class SuffixProposer(Proposer):
    """Reads the text itself: of the engine's hooks it needs `admit` (the groups), `retire`
    (finished responses into the history) and `propose`. A group's index is built when one of
    its requests is first drafted for, and then extended by what was committed since, so a
    rollout in which the bandit never picks a suffix arm pays nothing for it."""

    def __init__(self, history: DraftHistory | None = None):
        self.history = history
        self.groups: dict[int, _Group] = {}  # by prompt index
        self.texts: dict[tuple[int, int], int] = {}  # (prompt index, sample index) -> its text in the index
        self.counts = {"indexed": 0, "drafted": 0}  # tokens, for the cost per token (`bench profile`)

    def reserve(self, slots: int, max_len: int) -> None:
        self.groups, self.texts = {}, {}

    def admit(self, requests: list) -> None:
        for r in requests:
            if r.prompt_index not in self.groups:
                # the earlier rollouts' responses, as they are now: this rollout's finished
                # siblings, added to the history as they retire, are members already, and would
                # be counted twice and push the earlier ones out before the index is built
                earlier = self.history.responses(r.prompt_ids) if self.history is not None else ()
                self.groups[r.prompt_index] = _Group(earlier)
            self.groups[r.prompt_index].members.append([r, 0, -1])

    def retire(self, requests: list) -> None:
        if self.history is not None:
            for r in requests:
                self.history.add(r.prompt_ids, r.output_ids)

    def _sync(self, prompt_indices) -> None:
        """These groups' indexes (made with the prompt's earlier responses at first) extended by
        every member's tokens committed since: O(new tokens)."""
        for p in prompt_indices:
            group = self.groups[p]
            if group.index is None:
                group.index = SuffixIndex()
                prompt = group.members[0][0].prompt_ids
                for response in group.earlier:
                    group.index.extend(group.index.add_text(prompt, history=True), response)
                    self.counts["indexed"] += len(prompt) + len(response)
            index = group.index
            for m in group.members:
                r, done, text = m
                if text < 0:
                    m[2] = self.texts[r.prompt_index, r.sample_index] = index.add_text(r.prompt_ids + r.output_ids)
                    self.counts["indexed"] += len(r.prompt_ids) + len(r.output_ids)
                elif len(r.output_ids) > done:
                    index.extend(text, r.output_ids[done:])
                    self.counts["indexed"] += len(r.output_ids) - done
                m[1] = len(r.output_ids)

    def drafts(self, running: list, depth: int, size: int, topk: int, floor: float) -> list[list[tuple]]:
        """Per request the index's draft nodes after its pending token (`SuffixIndex.draft`)."""
        self._sync({r.prompt_index for r in running})
        PHASES.mark("sd: suffix index update")
        out = [self.groups[r.prompt_index].index.draft(self.texts[r.prompt_index, r.sample_index], depth, size, topk,
                                                       ALPHA, floor, MIN_MATCH) for r in running]
        self.counts["drafted"] += sum(map(len, out))
        PHASES.mark("sd: suffix drafts")
        return out

    def propose(self, running: list, starts: torch.Tensor, strategy: Strategy) -> Tree:
        nodes = self.drafts(running, strategy.depth, strategy.verify - 1, strategy.topk, strategy.confidence)
        return tree_of([r.output_ids[-1] for r in running], nodes, starts.device)


def tree_of(pending: list[int], nodes: list[list[tuple]], device) -> Tree:
    """The Tree of per-request draft nodes (token, parent, depth, probability, source; parent
    -1 = the pending root), `build_tree`'s."""
    return build_tree([[s] + [n[0] for n in row] for s, row in zip(pending, nodes)],
                      [[-1] + [n[1] + 1 for n in row] for row in nodes], [[0] + [n[2] for n in row] for row in nodes],
                      [[0] + [n[4] for n in row] for row in nodes], device)


def build_tree(tokens: list[list[int]], parents: list[list[int]], depths: list[list[int]],
               sources: list[list[int]], device) -> Tree:
    """The Tree of per-request nodes (all valid, parents first, node 0 the pending root), as
    wide as the most any request has, not the arm's budget: a step whose drafts are few
    verifies few. Where every request's nodes are one chain of the same length it is verified
    as a chain (causal attention, in fewer operations); else each request's nodes are padded
    with nodes no walk reaches (parent -1, not valid)."""
    width = max(map(len, tokens))
    if all(len(p) == width and p == list(range(-1, width - 1)) for p in parents):
        return replace(chain_tree(torch.tensor(tokens, device=device)), sources=torch.tensor(sources, device=device))
    pad = lambda rows, value: [row + [value] * (width - len(row)) for row in rows]  # noqa: E731
    as_tensor = lambda rows, dtype: torch.tensor(rows, dtype=dtype, device=device)  # noqa: E731
    return Tree(as_tensor(pad(tokens, 0), torch.long), as_tensor(pad(parents, -1), torch.long),
                as_tensor(pad(depths, 1), torch.long), as_tensor(pad([[True] * len(t) for t in tokens], False), torch.bool),
                depth=max(1, max(max(row) for row in depths)), sources=as_tensor(pad(sources, 0), torch.long))

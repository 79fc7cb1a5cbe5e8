"""A suffix index over a prompt group's texts: what followed the longest match, and how often.

One index per prompt group holds its texts: the siblings' prompt + response, each extended
token by token as the engine commits it, and earlier responses to the same prompt (history).
It is a generalised suffix automaton (Blumer et al. 1985; the online construction of
Inenaga et al. 2005), each text keeping its own `last` state, so texts may grow in any
interleaving. A state stands for a set of substrings with the same end positions; `count`
is how many end positions that is, over all texts, and `latest` the text of the most recent
(exact while each token's walk below stays within `WALK` states; lower bounds past it).

Costs: extending a text by a token adds at most two states (amortised O(1) transitions) and
then walks the new end position's suffix links to count it, at most `WALK` states. The walk's
length is the number of distinct right-contexts of the text's suffixes: a few states on real
text (`bench profile`), but it grows with a loop's length when a text repeats a short period,
the runaway response of a long tail (one token repeated: 65 µs a token at 2,000 tokens,
quadratic). The walk reaches the longest suffixes first; past `WALK` states the shorter
suffixes' `count` and `latest` stop growing. They only order and prune the drafts and label
their source, never decide what is emitted; inside a loop each node has one follower anyway.

Matching is free: the longest suffix of a text, at most `MAX_MATCH` tokens, that was followed
by something somewhere is the first state with transitions on the suffix-link path from the
state of the text's last `MAX_MATCH` tokens (a state's strings share their end positions, hence
their followers), so the match length and the counts of every follower come straight from the
automaton. Each text keeps that state, its window, moved along by every token it is extended
by (amortised O(1)). The bound is what lets a loop draft deep: matched in full, a text that
repeats itself matches everything but its last period, which only that period followed;
matched on its last `MAX_MATCH` tokens, it matches an earlier turn of the loop, whose
continuation runs on as far as the arm drafts (SuffixDecoding bounds its pattern length the
same way).

Drafts (`SuffixIndex.draft`): a trie grown best-first from the match by estimated path
probability, each child's probability count(child) / Σ count(children) (SuffixDecoding, Oliaro
et al. 2024, arXiv 2411.04975, scores its tree the same way), as deep as α × the match
length allows. Tested against a brute-force scan of the texts (tests/test_suffix_index.py).
"""

from __future__ import annotations

import heapq
import itertools

# Where a draft token came from (`Tree.sources`): the EAGLE drafter, or the suffix index by the
# text of the token's latest occurrence (0: the pending root and padding).
EAGLE, OWN, SIBLING, HISTORY = 1, 2, 3, 4
WALK = 32  # states counted per new end position (the module's docstring)
MAX_MATCH = 32  # tokens a match is at most (ditto): deep enough to place a draft, short enough to find a loop's turn
SOURCE_NAMES = {EAGLE: "eagle", OWN: "own", SIBLING: "siblings", HISTORY: "history"}


class SuffixIndex:
    def __init__(self):
        self.next: list[dict[int, int]] = [{}]  # state -> {token: state}
        self.link: list[int] = [-1]  # suffix link (root: -1)
        self.length: list[int] = [0]  # the longest string of the state
        self.count: list[int] = [0]  # end positions of its strings, over all texts (`WALK`: at most)
        self.latest: list[int] = [-1]  # the text of its most recent end position
        self.lasts: list[int] = []  # text -> the state of the whole text
        self.windows: list[tuple[int, int]] = []  # text -> (state, n) of its last n = min(MAX_MATCH, len) tokens
        self.history: list[bool] = []  # text -> an earlier step's response (else a live request)

    def add_text(self, tokens=(), history: bool = False) -> int:
        """A new text (empty, or `tokens`); returns its id."""
        self.lasts.append(0)
        self.windows.append((0, 0))
        self.history.append(history)
        text = len(self.lasts) - 1
        self.extend(text, tokens)
        return text

    def extend(self, text: int, tokens) -> None:
        """Append `tokens` to `text`."""
        link, count, latest = self.link, self.count, self.latest
        last = self.lasts[text]
        w, n = self.windows[text]
        for c in tokens:
            last = self._step(last, c)
            v, walk = last, WALK  # count the new end position in the states it belongs to
            while v > 0 and walk:
                count[v] += 1
                latest[v] = text
                v = link[v]
                walk -= 1
            # the window's string was a suffix of the text, so + c it is one now: a transition
            w, n = self.next[self._seat(w, n)][c], min(n + 1, MAX_MATCH)
        self.lasts[text] = last
        self.windows[text] = (w, n)

    def _seat(self, v: int, n: int) -> int:
        """The state holding the n-token string that state v holds (one of its strings, or a
        string of a state a split took it into: the shorter strings go to the clone, v's link)."""
        length, link = self.length, self.link
        while v > 0 and length[link[v]] >= n:
            v = link[v]
        return v

    def _step(self, last: int, c: int) -> int:
        """The state of (text + c), given `last`, the state of the text."""
        nxt, link, length = self.next, self.link, self.length
        q = nxt[last].get(c)
        if q is not None:  # (text + c) already occurs: reuse its state, or split it off
            return q if length[q] == length[last] + 1 else self._split(last, c, q)
        cur = self._new(length[last] + 1, {}, 0, 0, -1)
        p = last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
        else:
            q = nxt[p][c]
            link[cur] = q if length[p] + 1 == length[q] else self._split(p, c, q)
        return cur

    def _split(self, p: int, c: int, q: int) -> int:
        """Clone q into the state of p's strings + c (the shorter half of q's strings), which
        keeps q's end positions (the walk in `extend` then adds the new one, within `WALK`)."""
        nxt, link = self.next, self.link
        clone = self._new(self.length[p] + 1, dict(nxt[q]), link[q], self.count[q], self.latest[q])
        link[q] = clone
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        return clone

    def _new(self, length: int, nxt: dict, link: int, count: int, latest: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.latest.append(latest)
        return len(self.next) - 1

    def match(self, text: int) -> tuple[int, int]:
        """(state, length): the longest suffix of `text`, at most MAX_MATCH tokens, that is followed
        by a token somewhere (in any text, its own earlier part included); (0, 0) if none."""
        v, n = self.windows[text]
        v = self._seat(v, n)  # other texts' tokens may have split its state since
        nxt, link = self.next, self.link
        if v > 0 and nxt[v]:
            return v, n
        v = link[v] if v > 0 else 0
        while v > 0 and not nxt[v]:
            v = link[v]
        return (v, self.length[v]) if v > 0 else (0, 0)

    def followers(self, state: int) -> dict[int, int]:
        """{token: how often it followed the state's strings}."""
        return {c: self.count[s] for c, s in self.next[state].items()}

    def source(self, state: int, text: int) -> int:
        """OWN, SIBLING or HISTORY: where the state's latest occurrence is, seen from `text`."""
        t = self.latest[state]
        return OWN if t == text else HISTORY if self.history[t] else SIBLING

    def draft(self, text: int, depth: int, size: int, topk: int, alpha: float = 1.0, floor: float = 0.0,
              min_match: int = 1) -> list[tuple[int, int, int, float, int]]:
        """Draft tokens after `text`: up to `size` nodes (token, parent, depth, path probability,
        source), parents first (parent -1: the text's end), grown best-first by path probability
        from the longest match, at most min(depth, ⌊alpha × match length⌋) deep, at most `topk`
        children a node, none below path probability `floor`; among equal probabilities the
        node found first wins. Empty without a match of at least `min_match` tokens."""
        state, matched = self.match(text)
        limit = min(depth, int(alpha * matched))
        if matched < min_match or limit < 1 or size < 1:
            return []
        count, nodes, frontier, tie = self.count, [], [], itertools.count()

        def grow(s: int, node: int, d: int, p: float) -> None:
            kids = self.next[s]
            if d >= limit or not kids:
                return
            total = sum(count[u] for u in kids.values())
            for c, u in heapq.nlargest(topk, kids.items(), key=lambda kv: count[kv[1]]):
                q = p * count[u] / total
                if q < floor:
                    break
                heapq.heappush(frontier, (-q, next(tie), c, u, node, d + 1))

        grow(state, -1, 0, 1.0)
        while frontier and len(nodes) < size:
            neg_p, _, c, u, parent, d = heapq.heappop(frontier)
            nodes.append((c, parent, d, -neg_p, self.source(u, text)))
            grow(u, len(nodes) - 1, d, -neg_p)
        return nodes

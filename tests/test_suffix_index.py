"""The suffix index against a brute-force scan of its texts."""

import random

import pytest

from tailtamer.rollout.suffix_index import HISTORY, MAX_MATCH, OWN, SIBLING, WALK, SuffixIndex


def occurrences(texts, pattern):
    """(text, end) of every occurrence of `pattern`."""
    n = len(pattern)
    return [(t, i + n - 1) for t, s in enumerate(texts) for i in range(len(s) - n + 1) if s[i: i + n] == pattern]


def brute_match(texts, text, most=MAX_MATCH):
    """The longest suffix of `text`, at most `most` tokens, followed by a token somewhere."""
    s = texts[text]
    for n in range(min(len(s), most), 0, -1):
        if any(end + 1 < len(texts[t]) for t, end in occurrences(texts, s[-n:])):
            return n
    return 0


def grown(seed, n_texts=4, alphabet=3, steps=60, history=1):
    """An index and its texts, extended in a random interleaving; the log of end positions."""
    rng = random.Random(seed)
    index, texts, log = SuffixIndex(), [], []
    for t in range(n_texts):
        first = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 6))]
        index.add_text(first, history=t < history)
        texts.append(list(first))
        log += [(t, i) for i in range(len(first))]
    for _ in range(steps):
        t = rng.randrange(n_texts)
        chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
        index.extend(t, chunk)
        log += [(t, len(texts[t]) + i) for i in range(len(chunk))]
        texts[t] += chunk
    return index, texts, log


@pytest.mark.parametrize("seed", range(40))
def test_match_counts_and_followers_equal_a_brute_force_scan(seed):
    index, texts, log = grown(seed, alphabet=2 + seed % 4)
    for t, s in enumerate(texts):
        state, length = index.match(t)
        assert length == brute_match(texts, t)
        if not length:
            assert state == 0
            continue
        pattern = s[-length:]
        ends = occurrences(texts, pattern)
        assert index.count[state] == len(ends)
        expected = {}
        for u, end in ends:
            if end + 1 < len(texts[u]):
                c = texts[u][end + 1]
                expected[c] = len(occurrences(texts, pattern + [c]))
        assert index.followers(state) == expected
        latest = max(ends, key=log.index)[0]
        assert index.latest[state] == latest
        assert index.source(state, t) == (OWN if latest == t else HISTORY if latest < 1 else SIBLING)


@pytest.mark.parametrize("seed", range(20))
def test_every_substring_has_its_count(seed):
    index, texts, _ = grown(seed, n_texts=3, steps=30)
    for s in texts:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + 6) + 1):
                v = 0
                for c in s[i:j]:
                    v = index.next[v][c]
                assert index.count[v] == len(occurrences(texts, s[i:j]))


@pytest.mark.parametrize("seed", range(20))
def test_drafts_are_a_trie_of_real_continuations_best_first(seed):
    index, texts, _ = grown(seed, alphabet=3, steps=80)
    for t in range(len(texts)):
        matched = index.match(t)[1]
        nodes = index.draft(t, depth=6, size=10, topk=2, alpha=2.0)
        if not matched:
            assert nodes == []
            continue
        assert 1 <= len(nodes) <= 10
        paths, probs = [], []
        for token, parent, depth, p, source in nodes:
            assert parent < len(paths)
            path = (paths[parent] if parent >= 0 else []) + [token]
            assert depth == len(path) <= min(6, 2 * matched)
            pattern = texts[t][-matched:]
            # its probability: the product of each step's share among the followers
            q = 1.0
            for k in range(len(path)):
                before = pattern + path[:k]
                follow = [texts[u][e + 1] for u, e in occurrences(texts, before) if e + 1 < len(texts[u])]
                assert follow.count(path[k]) > 0
                q *= follow.count(path[k]) / len(follow)
            assert p == pytest.approx(q)
            assert source in (OWN, SIBLING, HISTORY)
            paths.append(path)
            probs.append(p)
        assert len({tuple(p) for p in paths}) == len(paths)  # siblings in the trie are distinct
        assert probs == sorted(probs, reverse=True)  # best first


def test_the_most_frequent_follower_comes_first_and_the_match_bounds_the_depth():
    index = SuffixIndex()
    for response in ([5, 1, 2, 3, 4], [5, 1, 2, 9], [5, 1, 2, 3, 7]):
        index.add_text(response)
    me = index.add_text([8, 1, 2])  # matches [1, 2]: followed by 3 twice, 9 once
    nodes = index.draft(me, depth=8, size=4, topk=3)
    assert [n[0] for n in nodes][:2] == [3, 9] and nodes[0][3] == pytest.approx(2 / 3)
    assert max(n[2] for n in nodes) <= 2  # alpha 1: no deeper than the 2 matched tokens
    assert index.draft(me, depth=8, size=4, topk=3, min_match=3) == []
    assert [n[0] for n in index.draft(me, depth=8, size=4, topk=1, floor=0.5)] == [3]


def test_a_text_alone_drafts_from_its_own_past():
    index = SuffixIndex()
    me = index.add_text([1, 2, 3, 4, 1, 2])
    assert [(n[0], n[4]) for n in index.draft(me, depth=2, size=4, topk=2)] == [(3, OWN), (4, OWN)]


@pytest.mark.parametrize("period", [1, 3, 40])
def test_a_long_loop_costs_a_bounded_walk_a_token_and_is_drafted_deep(period):
    """A runaway response repeats a period; counting each end position in every state of its
    suffix-link path would cost a walk as long as the loop (quadratic). At most WALK states are
    counted a token; matched on its last MAX_MATCH tokens, the loop drafts on as deep as asked
    (matched in full it matched all but its last period, which only that period followed)."""
    loop = random.Random(period).sample(range(100), period)
    index = SuffixIndex()
    me = index.add_text(loop * (2000 // period))
    assert sum(index.count) <= WALK * 2000  # unbounded: 2000 · 2001 / 2 for one repeated token
    nodes = index.draft(me, depth=48, size=48, topk=1, alpha=2.0)
    assert [n[0] for n in nodes] == (loop * (48 // period + 1))[:48] and index.match(me)[1] == MAX_MATCH
    window = index.windows[me][0]  # kept seated (its shortest string at most MAX_MATCH + 1 long): O(1) to seat
    assert index.length[index.link[window]] <= MAX_MATCH


def test_a_window_follows_its_string_into_states_other_texts_split():
    """A text's last MAX_MATCH tokens are kept as a state; texts added later split states, and
    the window follows its string into the part split off (else its match would be a longer
    string, or one with fewer followers)."""
    a = list(range(10, 10 + MAX_MATCH + 8))  # every substring once: one state holds all its suffixes
    index = SuffixIndex()
    me = index.add_text(a)
    index.add_text(a[-MAX_MATCH - 4:] + [3])  # the suffixes up to MAX_MATCH + 4 tokens split off, followed by 3
    index.add_text(a[-MAX_MATCH:] + [2])  # those up to MAX_MATCH split off again, followed by 2
    state, length = index.match(me)
    assert length == MAX_MATCH == brute_match([a, a[-MAX_MATCH - 4:] + [3], a[-MAX_MATCH:] + [2]], 0)
    assert index.followers(state) == {2: 1, 3: 1}

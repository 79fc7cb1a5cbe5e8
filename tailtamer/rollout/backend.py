"""The rollout backend seam: what the RL step asks of whatever engine rolls out.

  generate(prompts, params, first_index, keep_hidden) -> (completions, RolloutStats)
                         a step's prompts (token ids), sampled as `params` says; prompt i
                         samples from the stream of (params.seed, first_index + i, sample), so
                         workers given shards sample what one engine would;
  publish_policy(model)  the policy after an update: the next generate runs it, or a
                         RolloutBackendError says it does not (never a silently stale engine);
  publish_drafter(d)     the drafter after a spot-training round, likewise;
  close()                free the engine's memory (and processes).

Properties: `hidden_states` says whether generate hands the target's hidden states to
`keep_hidden` (our engine's forwards compute them; vLLM's EAGLE path cannot return them, so
there the drafter learns from the update's own forward: rl/trainer.py); `drafter` is the
trainable drafter module the trainer's spot trainer updates (None without one); `notice` a
line for the user about one-off costs.

Backends, by `rollout.backend`:
  tailtamer  our embedded engine (rollout/engine.py): runs the trainer's own modules, so a
             publish has nothing to copy; CPU, one GPU, tests, and the exactness oracle;
  vllm       one vLLM `LLM` per worker (rollout/vllm_backend.py): the long-tail switch and the
             bandit drive its per-batch-size draft length, weights are pushed into the running
             engine and checked.
SGLang fits the same seam: `update_weights_from_tensor` for both publishes (it updates the
drafter too), its adaptive speculation's per-batch-size steps for the schedule.
"""

from __future__ import annotations

from typing import Callable

import torch

from tailtamer.errors import TailtamerError
from tailtamer.rollout.engine import Completion, Engine
from tailtamer.rollout.sampling import SamplingParams
from tailtamer.rollout.stats import RolloutStats


class RolloutBackendError(TailtamerError):
    """The rollout engine failed or runs something other than what was published."""


class EmbeddedBackend:
    """Our own engine behind the seam. It runs the very modules the trainer updates (no
    copies), so publishing is a no-op; the trainer's checksum check covers it."""

    name = "tailtamer"
    hidden_states = True

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def drafter(self):
        return self.engine.proposer.drafter if self.engine.proposer is not None else None

    @property
    def notice(self) -> str | None:
        return self.engine.proposer.notice if self.engine.proposer is not None else None

    @property
    def tuner(self):
        return self.engine.tuner

    @property
    def bs_threshold(self) -> int | None:
        return self.engine.speculator.bs_threshold if self.engine.speculator is not None else None

    def generate(self, prompts: list[list[int]], params: SamplingParams, first_index: int = 0,
                 keep_hidden: Callable[[list[int], int, torch.Tensor], None] | None = None,
                 labels: list[str] | None = None) -> tuple[list[Completion], RolloutStats]:
        return self.engine.generate(prompts, params, labels, first_index, keep_hidden)

    def publish_policy(self, model) -> None:
        pass

    def publish_drafter(self, drafter) -> None:
        pass

    def close(self) -> None:
        pass


BACKENDS = ("tailtamer", "vllm")

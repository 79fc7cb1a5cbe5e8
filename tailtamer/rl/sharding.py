"""How the policy's training copy is laid out over the workers (`run.shard`), as a registry.

- `none`: every worker holds the whole policy; the engine runs the very module the update
  trains, and gradients are summed by one flat all-reduce per optimizer step
  (`Workers.reduce_gradients`).
- `fsdp`: the policy the update trains is sharded with PyTorch's FSDP2 (`fully_shard` per
  decoder layer and at the root): parameters, gradients and AdamW state are split across the
  workers, and each forward all-gathers a layer's weights just before it runs. The rollout
  cannot run on that copy (workers decode different numbers of steps, and every sharded
  forward is a collective), so each worker also keeps the whole policy for its engine, the
  old log-probs and checkpoints, refreshed from the shards after every update (`publish`).

Both keep checkpoints in one format (`optimizer.pt` as an unsharded AdamW writes it), so a run
can be resumed with either setting.
"""

from __future__ import annotations

import copy

import torch

from tailtamer.dist import Workers
from tailtamer.errors import ConfigError


class Replicated:
    """run.shard=none: the trained module is the engine's module."""

    def __init__(self, workers: Workers):
        self.workers = workers
        self.policy: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.policy = model
        return model

    loss_scale = 1.0

    def reduce(self, params: list, totals: torch.Tensor) -> torch.Tensor:
        return self.workers.reduce_gradients(params, totals)

    def extra_calls(self, plan) -> list[int]:
        return [0] * len(plan)

    def publish(self, model: torch.nn.Module) -> None:
        pass

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


class FullyShard(Replicated):
    """run.shard=fsdp: FSDP2 shards of the policy for the update, the whole copy for the rest."""

    def __init__(self, workers: Workers):
        if workers.world < 2:
            raise ConfigError("run.shard=fsdp needs at least 2 workers (run.workers, or torchrun's processes); "
                              "with one worker there is nothing to shard across: use run.shard=none")
        super().__init__(workers)
        # FSDP averages gradients over the workers; the update needs their sum (its token
        # weights are normalised over every worker's samples). gloo has no pre-scaled sum for
        # set_gradient_divide_factor(1), so the loss is scaled instead.
        self.loss_scale = float(workers.world)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        policy = copy.deepcopy(model)
        for layer in policy.layers:
            fully_shard(layer)
        fully_shard(policy)
        self.policy = policy
        return policy

    def reduce(self, params: list, totals: torch.Tensor) -> torch.Tensor:
        return self.workers.sum(totals)  # the gradients were reduce-scattered in backward

    def extra_calls(self, plan) -> list[int]:
        """Per minibatch, how many empty forward+backward passes this worker adds so that
        every worker makes as many (each is a collective; workers hold different numbers of
        micro-batches, as their samples' lengths differ)."""
        counts = self.workers.gather([len(minibatch) for minibatch in plan])
        return [max(c[i] for c in counts) - len(minibatch) for i, minibatch in enumerate(plan)]

    def publish(self, model: torch.nn.Module) -> None:
        """Copy the updated shards, gathered, into the engine's whole copy (every worker in the
        same order: each gather is a collective)."""
        with torch.no_grad():
            for (name, shard), (_, whole) in zip(self.policy.named_parameters(), model.named_parameters()):
                whole.copy_(shard.full_tensor())

    def optimizer_state(self, optimizer) -> dict:
        """The whole AdamW state, keyed as an unsharded optimizer keys it, on worker 0 (which
        writes checkpoints; the others take part in the gather and get {})."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.policy, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:
            return {}
        index = {name: i for i, (name, _) in enumerate(self.policy.named_parameters())}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in self.policy.named_parameters()]
        full = {"state": {names[i]: value for i, value in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.policy, optimizer, full, options=StateDictOptions(full_state_dict=True))


SHARDINGS = {"none": Replicated, "fsdp": FullyShard}

"""Coupled drafts: under sampling, a drafter drafts the token it would draw itself with the
uniform the target will draw that response index with (rollout/sampling.py). The engine hands
the proposer those uniforms, aligned with its own draws; a drafter equal to the target has
every draft accepted; EAGLE's chains and trees draft with the right uniform at every level."""

import pytest
import torch

import tailtamer.rollout.eagle as eagle
from tailtamer.model.drafter import init_drafter
from tailtamer.rollout.eagle import EagleProposer, chain_tree, children
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.proposer import Proposer
from tailtamer.rollout.sampling import SamplingParams, coupled_drafts, sample, target_probs
from tailtamer.rollout.speculator import Speculator
from conftest import random_model, tiny_config


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config()).double()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 60, (int(k),), generator=g).tolist() for k in torch.randint(2, 10, (n,), generator=g)]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(top_k=5),
                                    SamplingParams(top_p=0.8, temperature=1.3)])
def test_a_coupled_draft_is_what_the_target_would_draw_with_the_drafters_distribution(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(400, 7, 50, generator=g, dtype=torch.float64) * 3
    u = torch.rand(400, 7, generator=g, dtype=torch.float64)
    assert torch.equal(coupled_drafts(logits, params, u), sample(target_probs(logits, params), u))
    assert torch.equal(coupled_drafts(logits, params, None), logits.argmax(-1))
    # so a drafter whose distribution is the target's drafts the target's own draw
    drafted = coupled_drafts(logits, params, u)
    assert len(set(drafted.flatten().tolist())) > 10  # not the argmax: the draws spread


def test_a_nodes_children_start_with_its_coupled_draft_and_are_distinct():
    g = torch.Generator().manual_seed(2)
    logits, u = torch.randn(300, 40, generator=g), torch.rand(300, generator=g, dtype=torch.float64)
    score, tokens = children(logits, 3, u, SamplingParams())
    assert torch.equal(tokens[:, 0], coupled_drafts(logits, SamplingParams(), u))
    assert all(len(set(row)) == 3 for row in tokens.tolist())
    logp = torch.log_softmax(logits, -1)
    assert torch.equal(score[:, 0], logp.amax(-1))  # ranked as the top-1 is
    assert torch.equal(score[:, 1:], logp.gather(1, tokens[:, 1:]))
    top = children(logits, 3)
    assert torch.equal(top[1], logp.topk(3).indices)  # greedy: the top-k


class SelfDrafter(Proposer):
    """Drafts chains with the target itself (a full forward per level), coupled through the
    engine's `TargetDraws` shifted by `shift` response indices (0: aligned)."""

    def __init__(self, model, shift: int = 0):
        self.model, self.shift, self.draws = model, shift, None

    def couple(self, draws):
        self.draws = draws

    def propose(self, running, starts, strategy):
        D = strategy.depth
        u = self.draws.ahead(running, D + self.shift)[:, self.shift:]
        chains = []
        for r, uniforms in zip(running, u):
            row = r.prompt_ids + r.output_ids
            for k in range(D):
                logits, _ = self.model(torch.tensor([row]))
                row.append(int(coupled_drafts(logits[0, -1], self.draws.params, uniforms[k])))
            chains.append(row[-D - 1:])  # the pending token, then the drafts
        return chain_tree(torch.tensor(chains))


def test_a_drafter_equal_to_the_target_has_every_draft_accepted_under_sampling(target):
    """The uniforms the engine hands over are the ones it draws each node's token with: a
    drafter with the target's distribution drafts exactly the target's draws, so every SD step
    emits depth + 1 tokens (but where a response ends); drafted with the next index's uniforms
    (the negative control), most drafts are rejected."""
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=2, seed=3)
    prompts, config = _prompts(3), EngineConfig(max_batch_size=6)
    with torch.inference_mode():
        plain, _ = Engine(target, config=config).generate(prompts, params)
        accepted = {}
        for shift in (0, 1):
            out, stats = Engine(target, config=config, speculator=Speculator.fixed(SelfDrafter(target, shift), "3_1_4")
                                ).generate(prompts, params)
            assert [c.token_ids for c in out] == [c.token_ids for c in plain]
            accepted[shift] = stats.summary()["accept_len_mean"]
    assert len({t for c in plain for t in c.token_ids}) > 10  # sampled, not a repeated argmax
    assert accepted[0] > 3.6, accepted  # of 4 at most; a response's last step emits fewer
    assert accepted[1] < 2.0, accepted


@pytest.mark.parametrize("strategy", ["4_1_5", "3_2_6"])
def test_eagle_drafts_each_level_with_the_uniform_its_parents_draw_uses(target, monkeypatch, strategy):
    """Every call of `coupled_drafts` in an EAGLE chain or tree gets, for level k + 1, the
    uniforms of response index len(output_ids) + k of each request (the parent node's draw)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=5)
    engine = Engine(target, config=EngineConfig(max_batch_size=4),
                    speculator=Speculator.fixed(EagleProposer(init_drafter(target, std=0.2)), strategy))
    expected, got = [], []
    propose = EagleProposer.propose

    def spy_propose(self, running, starts, st):
        rows = torch.tensor([r.row for r in running])[:, None]
        index = torch.tensor([len(r.output_ids) for r in running])[:, None] + torch.arange(st.depth)
        # past a response's budget the draws share the last column (and are discarded)
        table = engine._draws.uniforms
        expected.append(table[rows, index.clamp(max=table.shape[1] - 1)])  # (B, depth)
        return propose(self, running, starts, st)

    def spy_draws(logits, params, u):
        got.append(u.reshape(u.shape[0], -1)[:, 0])  # (B,): a tree's beams share their row's uniform
        return coupled_drafts(logits, params, u)

    monkeypatch.setattr(EagleProposer, "propose", spy_propose)
    monkeypatch.setattr(eagle, "coupled_drafts", spy_draws)
    with torch.inference_mode():
        plain, _ = Engine(target, config=EngineConfig(max_batch_size=4)).generate(_prompts(2, 1), params)
        out, _ = engine.generate(_prompts(2, 1), params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    depth = int(strategy.split("_")[0])
    assert len(got) == depth * len(expected) and len(expected) > 5
    for step, want in enumerate(expected):
        assert torch.equal(torch.stack(got[step * depth: (step + 1) * depth], 1), want), step

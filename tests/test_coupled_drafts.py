"""Coupled drafts: under sampling, a drafter drafts the token it would draw itself with the
noise the target will draw that response index with (rollout/sampling.py). The engine hands
the proposer that noise, aligned with its own draws; a drafter equal to the target has every
draft accepted; EAGLE's chains and trees draft with the right noise at every level."""

import pytest
import torch

import tailtamer.rollout.eagle as eagle
from tailtamer.model.drafter import init_drafter
from tailtamer.rollout.eagle import EagleProposer, chain_tree, children
from tailtamer.rollout.engine import Engine, EngineConfig
from tailtamer.rollout.proposer import Proposer
from tailtamer.drafter.estimate import chain_acceptance
from tailtamer.rollout.sampling import SamplingParams, coupled_drafts, gumbels, perturbed, request_key, sample, target_probs
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
    noise = _noise(400 * 7, 50).reshape(400, 7, 50)
    assert torch.equal(coupled_drafts(logits, params, noise), sample(target_probs(logits, params), noise))
    assert torch.equal(coupled_drafts(logits, params, None), logits.argmax(-1))
    # so a drafter whose distribution is the target's drafts the target's own draw
    drafted = coupled_drafts(logits, params, noise)
    assert len(set(drafted.flatten().tolist())) > 10  # not the argmax: the draws spread


def _noise(n, vocab, seed=11):
    return gumbels(torch.tensor([request_key(seed, i, 0) for i in range(n)]), torch.zeros(n, 1, dtype=torch.long),
                   vocab)[:, 0]


def test_coupled_drafts_agree_with_the_target_as_often_as_the_estimate_says():
    """`chain_acceptance`'s closed form against the frequency with which a coupled draft from
    q equals the target's draw from p under the same noise, for several pairs (p, q)."""
    g = torch.Generator().manual_seed(4)
    p_logits = torch.randn(6, 9, generator=g, dtype=torch.float64) * 1.5
    q_logits = p_logits + torch.randn(6, 9, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2, 6)[:, None]
    noise = _noise(20_000, 9)
    params = SamplingParams()
    for p, q, alpha in zip(p_logits, q_logits, chain_acceptance(p_logits, q_logits, params)):
        agree = coupled_drafts(q.expand(len(noise), 9), params, noise) == sample(
            target_probs(p.expand(len(noise), 9), params), noise)
        assert agree.double().mean().item() == pytest.approx(alpha.item(), abs=0.012)
    assert 0.3 < chain_acceptance(p_logits, q_logits, params).min() < 0.9  # the pairs differ


def test_a_nodes_children_are_the_gumbel_top_k_starting_with_its_coupled_draft():
    g = torch.Generator().manual_seed(2)
    logits, noise = torch.randn(300, 40, generator=g), _noise(300, 40)
    score, tokens = children(logits, 3, noise, SamplingParams())
    assert torch.equal(tokens[:, 0], coupled_drafts(logits, SamplingParams(), noise))
    assert torch.equal(tokens, perturbed(logits, SamplingParams(), noise).topk(3).indices)
    assert all(len(set(row)) == 3 for row in tokens.tolist())
    # a target near the drafter: where its draw is not the first child, it is the second more
    # often than not (of 37 other tokens)
    target = sample(torch.softmax(logits + 0.5 * torch.randn(300, 40, generator=g), -1), noise)
    missed = target != tokens[:, 0]
    assert missed.sum() > 30 and (target[missed] == tokens[missed, 1]).double().mean() > 0.5
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
        noise = self.draws.ahead(running, D + self.shift)[:, self.shift:]
        chains = []
        for r, g in zip(running, noise):
            row = r.prompt_ids + r.output_ids
            for k in range(D):
                logits, _ = self.model(torch.tensor([row]))
                row.append(int(coupled_drafts(logits[0, -1], self.draws.params, g[k])))
            chains.append(row[-D - 1:])  # the pending token, then the drafts
        return chain_tree(torch.tensor(chains))


def test_a_drafter_equal_to_the_target_has_every_draft_accepted_under_sampling(target):
    """The noise the engine hands over is the noise it draws each node's token with: a drafter
    with the target's distribution drafts exactly the target's draws, so every SD step emits
    depth + 1 tokens (but where a response ends); drafted with the next index's noise (the
    negative control), most drafts are rejected."""
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
def test_eagle_drafts_each_level_with_the_noise_its_parents_draw_uses(target, monkeypatch, strategy):
    """Every EAGLE chain's or tree's level k + 1 is drafted with the noise of response index
    len(output_ids) + k of each request (the parent node's draw), hashed here afresh."""
    params = SamplingParams(temperature=1.0, max_new_tokens=30, n=2, seed=5)
    engine = Engine(target, config=EngineConfig(max_batch_size=4),
                    speculator=Speculator.fixed(EagleProposer(init_drafter(target, std=0.2)), strategy))
    expected, got = [], []
    propose = EagleProposer.propose

    def spy_propose(self, running, starts, st):
        keys = engine._draws.keys[[r.row for r in running]]
        index = torch.tensor([len(r.output_ids) for r in running])[:, None] + torch.arange(st.depth)
        expected.append(gumbels(keys, index, target.config.vocab_size))  # (B, depth, V)
        return propose(self, running, starts, st)

    def spy_draws(logits, params, g):
        got.append(g.reshape(g.shape[0], -1, g.shape[-1])[:, 0])  # (B, V): a tree's beams share their row's noise
        return perturbed_(logits, params, g)

    perturbed_ = eagle.coupled_drafts if strategy.split("_")[1] == "1" else eagle.perturbed
    monkeypatch.setattr(EagleProposer, "propose", spy_propose)
    monkeypatch.setattr(eagle, "coupled_drafts" if strategy.split("_")[1] == "1" else "perturbed", spy_draws)
    with torch.inference_mode():
        plain, _ = Engine(target, config=EngineConfig(max_batch_size=4)).generate(_prompts(2, 1), params)
        out, _ = engine.generate(_prompts(2, 1), params)
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    depth = int(strategy.split("_")[0])
    assert len(got) == depth * len(expected) and len(expected) > 5
    for step, want in enumerate(expected):
        assert torch.equal(torch.stack(got[step * depth: (step + 1) * depth], 1), want), step

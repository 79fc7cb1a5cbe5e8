"""Multi-process runs: 2 gloo workers on CPU (idle detection, preemption, publish checksums,
data-parallel update equality, a dying worker), and the pure pieces of tailtamer/dist.py."""

import datetime
import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from tailtamer.config import load_train_config
from tailtamer.errors import ConfigError, TailtamerError
from tailtamer.dist import WorkerError, Workers, resolve_workers, spawn
from tailtamer.rl.batching import balanced_shares, balanced_shares_by_group, rebalance
from tailtamer.rl.run_dir import resume_note
from tailtamer.rl.trainer import TrainingError, check_same_weights, run_worker, train
from tailtamer.stopping import Interrupted
from test_trainer import TIME_FIELDS, _comparable, _rows

SLOW_S = 0.8  # extra rollout time of worker 1: the long-tail shard


def quiet(*_args) -> None:
    pass


def uneven_worker(cfg, resume, kill_at_rollout=None):
    """run_worker, except that worker 1's rollouts take SLOW_S longer (it has the long tail);
    halfway through its wait it records the state worker 0 reports in the c10d store; at
    rollout number `kill_at_rollout` it kills itself with SIGKILL."""
    from tailtamer.rollout.engine import Engine

    if os.environ["RANK"] == "1":
        original, rollouts = Engine.generate, []
        store = torch.distributed.PrefixStore("tailtamer", torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=30)))

        def slow_generate(self, prompts, params, labels=None, first_index=0, keep_hidden=None):
            out = original(self, prompts, params, labels, first_index, keep_hidden)
            if params.temperature > 0:  # a rollout, not the greedy evaluation
                rollouts.append(1)
                time.sleep(SLOW_S / 2)
                if len(rollouts) == kill_at_rollout:
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(os.path.join(cfg.run.out_dir, cfg.run.name, "peer_states.txt"), "a") as f:
                    f.write(store.get("state/0").decode() + "\n")
                time.sleep(SLOW_S / 2)
            return out

        Engine.generate = slow_generate
    return run_worker(cfg, resume, quiet)


@pytest.fixture
def drafter_dir(model_dir, tmp_path):
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import load_model

    out = tmp_path / "drafter"
    save_drafter(init_drafter(load_model(model_dir), seed=3), out)
    return out


def test_idle_worker_spot_trains_is_preempted_and_publishes(toy, drafter_dir, tmp_path):
    cfg = load_train_config(None, toy + ["run.steps=4", "run.name=spot2", "run.save_every=4", "run.workers=2",
                                         "spec.mode=on", f"spec.drafter={drafter_dir}", "spec.strategy=2_1_3",
                                         "spot.max_steps=100000", "spot.tokens_per_step=64"])
    run = tmp_path / "runs" / "spot2"
    summary = spawn(2, uneven_worker, (cfg, None), partial(resume_note, run))
    assert summary["workers"] == 2
    rows = _rows(run)
    assert [r["workers"] for r in rows] == [2] * 4
    # Worker 0 finishes first every step; from step 0 on (its buffer holds the responses its
    # own rollout just gave) it trains the drafter while worker 1 generates, and stops soon
    # after worker 1 is done: long before its step limit (100000 steps would take minutes).
    assert all(r["idle_worker_s"] > SLOW_S / 2 for r in rows)
    for r in rows:
        assert r["drafter_steps"] > 0 and r["drafter_loss"] > 0
        assert 0 <= r["drafter_preempt_s"] < SLOW_S / 4
        spans = {(w, phase) for w, phase, *_ in r["timeline"]}
        assert (0, "spot") in spans and (1, "spot") not in spans
        # worker 0 scored its rewards in that idle time too, before worker 1's shard was done
        scored = min(b for w, phase, _, b in r["timeline"] if (w, phase) == (0, "rewards"))
        assert scored < next(b for w, phase, _, b in r["timeline"] if (w, phase) == (1, "rollout"))
    states = (run / "peer_states.txt").read_text().split()
    assert states[0] in ("IDLE", "TRAINING") and set(states[1:]) == {"TRAINING"}
    # Published: one new drafter per step that both engines run (compared every step, or the
    # run would have stopped), and it is the one checkpointed.
    shas = [r["drafter_sha"] for r in rows]
    assert len(set(shas)) == 4
    from tailtamer.model.drafter import load_drafter, weights_checksum
    from tailtamer.model.io import load_model

    saved = run / "checkpoints" / "step-000004"
    assert weights_checksum(load_drafter(saved / "drafter", load_model(saved))) == shas[-1]
    assert weights_checksum(load_drafter(run / "drafter", load_model(saved))) == shas[-1]  # the async copy
    # In idle time, the adaptive drafter and the frozen warm-up drafter are scored on the
    # step's newest responses, before the drafter trains on them.
    assert all(r["accept_len_est_frozen"] >= 1.0 and r["accept_len_est"] >= 1.0 for r in rows)
    assert rows[0]["accept_len_est"] == rows[0]["accept_len_est_frozen"]  # nothing trained yet
    assert (run / "timeline.png").is_file()


def test_two_workers_roll_out_and_update_like_one(toy, tmp_path):
    """With several minibatches too: membership is fixed by the samples' global indices."""
    base = toy + ["run.steps=2", "rl.minibatches=4", "rl.micro_batch_size=5"]
    one = train(load_train_config(None, base + ["run.name=one"]), log=quiet, console=quiet)
    two = spawn(2, run_worker, (load_train_config(None, base + ["run.name=two", "run.workers=2"]), None, quiet),
                partial(resume_note, tmp_path / "runs" / "two"))
    assert one["workers"] == 1 and two["workers"] == 2
    for step, (a, b) in enumerate(zip(_rows(tmp_path / "runs" / "one"), _rows(tmp_path / "runs" / "two"))):
        # The same samples (each prompt keeps its sampling stream on whichever worker has it) ...
        assert a["lengths"] == b["lengths"] and a["reward_mean"] == b["reward_mean"]
        # ... and the same update: gradients summed over workers with globally normalised token
        # weights equal the single worker's, up to float summation order, which the AdamW
        # steps between minibatches amplify a little (a different minibatch membership
        # changed the loss by 40%).
        for key in ("loss", "grad_norm", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-7), (step, key)


def test_a_dying_worker_stops_the_run_and_the_checkpoint_resumes(toy, tmp_path, monkeypatch):
    import tailtamer.dist as dist

    # worker 0 waits for the dead one's shard at a barrier without a timeout, so the launcher
    # ends it once the grace is over (30 s in a run)
    monkeypatch.setattr(dist, "FAILURE_GRACE_S", 3.0)
    common = toy + ["run.save_every=2", "rl.lr=1e-3", "run.workers=2", "run.dist_timeout_s=60"]
    run = tmp_path / "runs" / "dies"
    cfg = load_train_config(None, common + ["run.steps=6", "run.name=dies"])
    start = time.time()
    with pytest.raises(WorkerError, match=r"worker 1 died \(killed by SIGKILL\).*stays valid"):
        spawn(2, uneven_worker, (cfg, None, 5), partial(resume_note, run))  # dies in its 5th rollout
    assert time.time() - start < 60  # stopped by the launcher, not by the collective timeout
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step-000002", "step-000004") and (run / "checkpoints" / latest / "state.json").is_file()
    spawn(2, run_worker, (load_train_config(run / "config.yaml", []), run, quiet), partial(resume_note, run))
    whole = load_train_config(None, common + ["run.steps=6", "run.name=whole"])
    spawn(2, run_worker, (whole, None, quiet), partial(resume_note, tmp_path / "runs" / "whole"))
    assert _comparable(_rows(run)) == _comparable(_rows(tmp_path / "runs" / "whole"))
    assert TIME_FIELDS - {"drafter_preempt_s"} <= set(_rows(run)[0])  # a drafter field; no drafter here


def long_tail_worker(cfg, resume, seconds):
    """run_worker, except that worker 1's rollouts take `seconds` longer."""
    from tailtamer.rollout.engine import Engine

    if os.environ["RANK"] == "1":
        original = Engine.generate

        def slow_generate(self, *args, **kwargs):
            time.sleep(seconds)
            return original(self, *args, **kwargs)

        Engine.generate = slow_generate
    return run_worker(cfg, resume, quiet)


def test_waiting_for_the_long_tail_has_no_timeout(toy, tmp_path):
    """A rollout may run for hours; the wait for the last shard is not a collective with
    run.dist_timeout_s (here 2 s against a 4 s tail)."""
    cfg = load_train_config(None, toy + ["run.steps=2", "run.workers=2", "run.name=tail", "run.dist_timeout_s=2"])
    summary = spawn(2, long_tail_worker, (cfg, None, 4.0), partial(resume_note, tmp_path / "runs" / "tail"))
    assert summary["steps"] == 2 and all(r["idle_worker_s"] > 3 for r in _rows(tmp_path / "runs" / "tail"))


def slow_reward_worker(cfg, resume, seconds):
    """run_worker, except that worker 1's reward scoring takes `seconds` longer."""
    from tailtamer.rl.rewards import RewardScorer

    if os.environ["RANK"] == "1":
        original = RewardScorer.score_calls

        def slow_score_calls(self, items):
            time.sleep(seconds)
            return original(self, items)

        RewardScorer.score_calls = slow_score_calls
    return run_worker(cfg, resume, quiet)


def test_waiting_for_a_slow_reward_has_no_timeout(toy, tmp_path):
    """Each worker scores as soon as its shard is done; the others then wait for the last
    one's scoring (a slow verifier, say) at a store barrier, not in a collective with
    run.dist_timeout_s (here 2 s against 4 s of scoring)."""
    cfg = load_train_config(None, toy + ["run.steps=2", "run.workers=2", "run.name=reward", "run.dist_timeout_s=2",
                                         "run.eval_every=0"])
    summary = spawn(2, slow_reward_worker, (cfg, None, 4.0), partial(resume_note, tmp_path / "runs" / "reward"))
    assert summary["steps"] == 2


def kill_worker_1():
    w = Workers.from_env(30)
    if w.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    w.sum(torch.ones(1))  # worker 0 fails here: its peer is gone


def average_drafters(weights):
    """Each worker's module starts at its own values; returns every worker's values after
    averaging with this worker's weight `weights[rank]`, and the frozen tensor's."""
    w = Workers.from_env(30)
    torch.manual_seed(w.rank)
    module = torch.nn.Linear(3, 2)
    module.bias.requires_grad_(False)  # frozen, as the drafter's shared embedding and head are
    before = [p.tolist() for p in module.parameters()]
    finish = w.start_average(module, weights[w.rank])
    w.sum(torch.ones(1))  # a collective while the average travels (the update's)
    assert [p.tolist() for p in module.parameters()] == before  # written in only by finish()
    finish()
    # plain lists: a tensor would travel to the launcher as a shared-memory handle
    return w.gather(([p.tolist() for p in module.parameters()], before))


def test_drafters_are_averaged_by_the_steps_each_worker_trained():
    # θ ← Σ_r w_r θ_r / Σ_r w_r on every worker; frozen tensors keep their own values
    after, before = zip(*spawn(2, average_drafters, ([1.0, 3.0],), partial(resume_note, Path("runs/x"))))
    mine, theirs = torch.tensor(before[0][0]), torch.tensor(before[1][0])
    assert not torch.allclose(mine, theirs)
    expected = (1.0 * mine + 3.0 * theirs) / 4.0
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(after[rank][0]), expected, rtol=1e-6, atol=1e-7)
        assert after[rank][1] == before[rank][1]
    # a worker that trained nothing adds nothing; if none trained, nothing changes
    after, before = zip(*spawn(2, average_drafters, ([0.0, 2.0],), partial(resume_note, Path("runs/x"))))
    assert after[0][0] == after[1][0] == before[1][0]
    after, before = zip(*spawn(2, average_drafters, ([0.0, 0.0],), partial(resume_note, Path("runs/x"))))
    assert all(after[rank][0] == before[rank][0] for rank in (0, 1))


def test_the_dead_worker_is_named_not_the_peer_that_noticed():
    for _ in range(3):  # whichever the launcher sees first, the dead one is reported
        with pytest.raises(WorkerError, match=r"worker 1 died \(killed by SIGKILL\).*no checkpoint was written yet"):
            spawn(2, kill_worker_1, (), partial(resume_note, Path("runs/x")))


def fail_worker_0_while_1_computes():
    w = Workers.from_env(30)
    if w.rank == 0:
        raise TailtamerError("a bad row")
    time.sleep(120)  # no collective to notice the failure in: the launcher has to end it


def test_a_worker_that_does_not_end_after_a_failure_is_killed_after_the_grace(monkeypatch):
    """The first failure is reported, once the others end or FAILURE_GRACE_S after it."""
    import tailtamer.dist as dist

    monkeypatch.setattr(dist, "FAILURE_GRACE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"^worker 0: a bad row$"):
        spawn(2, fail_worker_0_while_1_computes, (), partial(resume_note, Path("runs/x")))
    assert time.monotonic() - t0 < 60


def interrupt_worker_1():
    w = Workers.from_env(30)
    if w.rank == 1:
        raise KeyboardInterrupt  # Ctrl-C before a step: no StopRequest holds SIGINT yet
    w.sum(torch.ones(1))


def test_ctrl_c_before_the_first_step_is_a_stop_not_a_death(tmp_path):
    with pytest.raises(Interrupted, match=r"stopped by Ctrl-C; no checkpoint was written yet, so there is nothing"):
        spawn(2, interrupt_worker_1, (), partial(resume_note, tmp_path / "never"))


def test_a_stop_passed_on_by_the_launcher_is_named_as_the_launcher_received_it():
    """A Ctrl-C to the launcher reaches the workers as SIGTERM: a worker that dies of it before
    its first step is the stop, not a crash, and the stop is the user's Ctrl-C."""
    from tailtamer.dist import _failure

    stopped = _failure([-signal.SIGTERM, None], [], "Ctrl-C", "nothing to resume")
    assert isinstance(stopped, Interrupted) and str(stopped) == "stopped by Ctrl-C; nothing to resume"
    assert isinstance(_failure([-signal.SIGTERM, None], [], None, "r"), WorkerError)  # no stop asked: a death
    after = Interrupted("stopped by SIGTERM after step 3 of 9; resume with X", "SIGTERM")
    assert str(after.stopped_by("Ctrl-C")) == "stopped by Ctrl-C after step 3 of 9; resume with X"
    assert after.stopped_by("SIGTERM") is after


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but not RANK: "),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "WORLD_SIZE=2 but RANK=x, not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "1"}, "WORLD_SIZE=2 but not MASTER_ADDR"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2, outside a group of "
                                                                                 "WORLD_SIZE=2 workers"),
    ({"WORLD_SIZE": "0", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=0, outside a group of "
                                                                                 "WORLD_SIZE=0 workers"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "p"}, "WORLD_SIZE=2 but MASTER_PORT=p, not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}, "WORLD_SIZE=2 but not MASTER_PORT"),
])
def test_an_incomplete_torchrun_environment_is_one_line(env, message):
    """A stray WORLD_SIZE raised KeyError: 'RANK' (and a RANK of letters ValueError, before the
    worker's device was picked)."""
    from tailtamer.dist import torchrun_env

    with pytest.raises(ConfigError, match=f"^the environment sets {message}"):
        torchrun_env(env)
    assert torchrun_env({}) == torchrun_env({"WORLD_SIZE": "1"}) == (1, 0, 0)  # a group of one needs no more
    assert torchrun_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                         "MASTER_PORT": "29500"}) == (4, 3, 1)


def test_a_group_whose_other_workers_never_come_is_one_line(monkeypatch):
    """It ended in DistStoreError's traceback."""
    from tailtamer.dist import _free_port

    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    with pytest.raises(WorkerError, match=r"^worker 0 of 2 could not join the group at 127.0.0.1:\d+ within "
                                          r"run.dist_timeout_s=2 s"):
        Workers.from_env(2)


def test_a_worker_error_is_reported_with_its_message(toy, tmp_path):
    cfg = load_train_config(None, toy + ["run.steps=1", "run.workers=2", "rl.reward=no_such_module:f"])
    with pytest.raises(WorkerError, match=r"worker \d: .*no_such_module"):
        spawn(2, run_worker, (cfg, None, quiet), partial(resume_note, tmp_path / "runs" / "x"))


def test_shards_are_contiguous_and_cover_everything():
    for world in (1, 2, 3, 5):
        for n in (world, 7, 16):
            shards = [Workers(rank, world).shard(n) for rank in range(world)]
            assert shards[0][0] == 0 and shards[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))
            sizes = [hi - lo for lo, hi in shards]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_balanced_shares_deal_out_long_tailed_costs():
    costs = [320, 30, 28, 300, 25, 40, 35, 290, 22, 31, 27, 26]
    shares = balanced_shares(costs, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    loads = [sum(costs[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs)  # LPT: no worker beyond one item over another
    assert all(len([i for i in share if costs[i] >= 290]) == 1 for share in shares)  # one long each
    assert balanced_shares(costs, 3) == shares and balanced_shares(costs, 1) == [list(range(len(costs)))]


def test_worker_count_defaults_to_the_cores_and_never_exceeds_the_prompts():
    assert resolve_workers(3, 16) == 3 and resolve_workers(8, 4) == 4
    assert resolve_workers(0, 1024) == (os.cpu_count() or 1)
    assert resolve_workers(0, 1024, gpus=3) == 3 and resolve_workers(5, 1024, gpus=3) == 5  # one per GPU


def test_spawned_workers_get_the_built_in_base_model_resolved_by_the_launcher(tmp_path, monkeypatch):
    """The launcher, which has every core, finds or trains the base model, not worker 0 with
    its one core; here a cached one is found."""
    from tailtamer.rl import trainer
    from tailtamer.sft import SFTConfig

    base = tmp_path / f"base-{SFTConfig().preset}-{SFTConfig().key()}"
    base.mkdir()
    (base / "sft.json").write_text("{}")
    monkeypatch.setenv("TAILTAMER_CACHE", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    seen = {}
    monkeypatch.setattr(trainer, "spawn", lambda world, entry, args, run_dir: seen.update(world=world, cfg=args[0]))
    trainer.launch(load_train_config(None, ["run.workers=2", "spec.mode=off"]))
    assert seen["world"] == 2 and seen["cfg"].run.model == str(base)


def test_one_worker_collectives_are_the_identity():
    w = Workers()
    x = torch.arange(3.0)
    assert torch.equal(w.sum(x), x) and w.gather("a") == ["a"] and w.rollout_over(0)
    assert w.share(lambda: 5) == 5


def test_diverged_weights_are_detected():
    check_same_weights([("p", "d"), ("p", "d")], step=3)
    with pytest.raises(TrainingError, match="worker 1's drafter weights .* differ"):
        check_same_weights([("p", "d"), ("p", "x")], step=3)
    with pytest.raises(TrainingError, match="worker 2's policy"):
        check_same_weights([("p", None), ("p", None), ("q", None)], step=3)


def test_each_minibatch_is_balanced_across_workers():
    # every optimizer step ends in an all-reduce: a minibatch dealt unevenly keeps workers waiting
    costs = [320, 30, 28, 300, 25, 40, 35, 290, 22, 31, 27, 26, 200, 18, 19, 250]
    groups = [0, 1] * 8
    shares = balanced_shares_by_group(costs, groups, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    for g in (0, 1):
        loads = [sum(costs[i] for i in share if groups[i] == g) for share in shares]
        assert max(loads) - min(loads) <= max(c for c, x in zip(costs, groups) if x == g)
    # a step-level deal can leave one minibatch lopsided; this one cannot
    step_level = balanced_shares(costs, 2)
    lopsided = [abs(sum(costs[i] for i in step_level[0] if groups[i] == g)
                    - sum(costs[i] for i in step_level[1] if groups[i] == g)) for g in (0, 1)]
    balanced = [abs(sum(costs[i] for i in shares[0] if groups[i] == g)
                    - sum(costs[i] for i in shares[1] if groups[i] == g)) for g in (0, 1)]
    assert max(balanced) < max(lopsided)


@pytest.mark.slow
def test_fsdp_sharded_policy_trains_and_resumes_like_the_unsharded_one(toy, tmp_path):
    """run.shard=fsdp: FSDP2 shards of the policy for the update, the whole policy for the
    rollout; the same samples and, up to float summation order, the same update as
    unsharded; its checkpoint (the optimizer state gathered) resumes the run."""
    base = toy + ["rl.minibatches=2", "rl.micro_batch_size=5", "run.workers=2", "run.save_every=2", "rl.lr=1e-3"]
    spawn(2, run_worker, (load_train_config(None, base + ["run.steps=4", "run.name=flat"]), None, quiet),
          partial(resume_note, tmp_path / "runs" / "flat"))
    sharded = base + ["run.shard=fsdp", "run.name=sharded"]
    run = tmp_path / "runs" / "sharded"
    spawn(2, run_worker, (load_train_config(None, sharded + ["run.steps=2"]), None, quiet), partial(resume_note, run))
    spawn(2, run_worker, (load_train_config(run / "config.yaml", ["run.steps=4"]), run, quiet),
          partial(resume_note, run))
    flat, rows = _rows(tmp_path / "runs" / "flat"), _rows(run)
    assert len(rows) == 4
    for step, (a, b) in enumerate(zip(flat, rows)):
        assert a["lengths"] == b["lengths"] and a["reward_mean"] == b["reward_mean"], step
        for key in ("loss", "grad_norm", "clip_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-7), (step, key)
    with pytest.raises(ConfigError, match="run.shard=fsdp needs at least 2 workers"):
        train(load_train_config(None, toy + ["run.shard=fsdp", "run.workers=1", "run.name=one"]), log=quiet)



def test_rebalance_deals_only_what_the_update_computes():
    """Two workers' samples (the other's through a stubbed gather): the shares hold every
    sample once, whole, and balance the tokens the update computes; samples of advantage 0
    and dropped ones cost nothing."""
    from tailtamer.rl.batching import Samples

    def samples(first: int, lengths: list[int], advantages: list[float], keep: list[bool]) -> Samples:
        n, width = len(lengths), max(lengths) + 3
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width - 1, dtype=torch.bool)
        for i, length in enumerate(lengths):
            ids[i, : length + 2] = torch.arange(1, length + 3) + 100 * (first + i)
            mask[i, 1: 1 + length] = True
        return Samples(ids, mask, torch.tensor(keep), torch.tensor(advantages), torch.arange(first, first + n))

    mine = samples(0, [5, 40, 7, 30], [1.0, 0.0, -1.0, 0.0], [True, True, True, True])
    theirs = samples(4, [50, 6, 9, 12], [0.0, 0.5, -0.5, 2.0], [True, True, True, False])
    one_minibatch = lambda index: torch.zeros_like(index)  # noqa: E731

    def sent(s: Samples) -> list:  # what a worker puts into the gather
        w, out = Workers(rank=0, world=2), []
        w.gather = lambda obj: out.append(obj) or [obj, obj]
        rebalance(w, s, 0, one_minibatch, True)
        return out[0]

    both, shares = [sent(mine), sent(theirs)], []
    for rank, s in enumerate((mine, theirs)):
        w = Workers(rank=rank, world=2)
        w.gather = lambda obj: both
        share = rebalance(w, s, 0, one_minibatch, True)
        shares.append(share.index.tolist())
        for i, j in enumerate(share.index.tolist()):  # every row arrives whole
            length = int(share.mask[i].sum())
            assert share.ids[i, : length + 2].tolist() == (torch.arange(1, length + 3) + 100 * j).tolist()
    assert sorted(shares[0] + shares[1]) == list(range(8))
    costs = {0: 7, 2: 9, 5: 8, 6: 11}  # the computed ones, dealt by their rows' widths
    loads = [sum(costs.get(i, 0) for i in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(costs.values())


def test_a_process_whose_parent_died_while_it_started_exits():
    """A launcher killed while its workers still import torch: each worker is told its parent's
    PID, so one that starts as an orphan (its parent already gone) ends at once."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID that is no process's parent now
    child = subprocess.run([sys.executable, "-c", f"import time; from tailtamer.stopping import exit_with_parent; "
                            f"exit_with_parent({gone.pid}); time.sleep(60)"], timeout=50)
    assert child.returncode == 1
    alive = subprocess.Popen([sys.executable, "-c", "import os, time; from tailtamer.stopping import "
                              "exit_with_parent; exit_with_parent(os.getppid()); time.sleep(2)"])
    assert alive.wait(timeout=50) == 0  # its parent (this process) lives: it runs to its end


def test_a_worker_that_fails_at_start_up_is_one_line_and_nothing_else(tmp_path):
    """Worker 0 hosts the c10d store: when it fails, its peer's store client loses the server
    and would log a C++ stack trace; the user sees only the launcher's one line."""
    import re
    import subprocess
    import sys

    broken = tmp_path / "empty-model"  # a directory, so found only when a worker loads it
    broken.mkdir()
    result = subprocess.run([sys.executable, "-m", "tailtamer", "train", f"run.model={broken}", "spec.mode=off",
                             "run.steps=1", "run.workers=2", f"run.out_dir={tmp_path / 'runs'}"],
                            capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"})
    assert result.returncode == 2, result.stderr
    assert re.fullmatch(rf"error: worker [01]: {re.escape(str(broken / 'tokenizer.json'))}: tokenizer.json not found\n",
                        result.stderr), \
        result.stderr

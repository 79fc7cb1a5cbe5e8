"""What an RL step reports: one clock for its phases, and every worker's share merged into the
`metrics.jsonl` row (identically on every worker, from the gathered shares)."""

from __future__ import annotations

import statistics
import time
from collections import Counter

from tailtamer.rl.rewards import failure_counts, merge_failures
from tailtamer.rollout.stats import mean_accept_len


class StepClock:
    """The phases of one worker's step on the wall clock (comparable across workers):
    `mark(name)` ends the phase called `name`, which began at the previous mark."""

    def __init__(self):
        self.start = self._last = time.time()
        self.spans: list[tuple[str, float, float]] = []

    def mark(self, name: str) -> float:
        now = time.time()
        self.spans.append((name, self._last, now))
        self._last = now
        return now

    def seconds(self, *names: str) -> float:
        return sum(b - a for name, a, b in self.spans if name in names)


def weighted(pairs: list[tuple[float, float]]) -> float | None:
    """Mean of (value, weight) pairs weighted by weight; None if no weight."""
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def worker_share(clock: StepClock, rollout, completions: list, rewards, correct, lengths, by_function: dict, keep,
                 advantages, drafter: dict | None, last_rollout_end: float, world: int, buffer_dropped: int,
                 reward_failures: dict, samples: list[dict]) -> dict:
    """This worker's share of a step's metrics row, as `merge` takes it from every worker:
    its samples' outcomes, its rollout's statistics (`RolloutStats`), its clock's spans, and
    its drafter's report (None: it did not train)."""
    summary = rollout.summary()
    rollout_end = clock.spans[0][2]
    spot_end = clock.spans[-1][2] if drafter is None else next(b for n, _, b in clock.spans if n == "spot")
    return {
        "correct": correct.tolist(), "rewards": rewards.flatten().tolist(), "lengths": lengths.tolist(),
        "by_function": by_function if len(by_function) > 1 else {},
        "truncated": sum(c.finish_reason == "length" for c in completions), "kept": keep.sum().item(),
        "zero_adv": int((advantages == 0).sum()),
        "tokens": summary["tokens"], "sd_tokens": rollout.sd_tokens,
        "compile_s": rollout.setup_s,
        "accept_lens": rollout.accept_lens, "tail_s": rollout.tail_seconds(),
        "accepted_by_class": rollout.accepted_by_class, "request_steps_by_class": rollout.request_steps_by_class,
        "rollout_end": rollout_end, "idle_s": max(0.0, last_rollout_end - rollout_end),
        "train_s": clock.seconds("old_logprobs", "update"), "drafter": drafter,
        "preempt_s": max(0.0, spot_end - last_rollout_end) if drafter and world > 1 else None,
        "buffer_dropped": buffer_dropped, "reward_failures": reward_failures, "timeline": clock.spans,
        "samples": samples,
    }


def accepted_by_source(parts: list[dict]) -> dict:
    """Accepted drafts per SD request-step by source (the EAGLE drafter, the request's own
    text, its siblings, the prompt's history), over all batch sizes and by batch-size class."""
    steps: Counter = sum((Counter(p["request_steps_by_class"]) for p in parts), Counter())
    by_class: dict[str, Counter] = {}
    for p in parts:
        for size, counts in p["accepted_by_class"].items():
            by_class.setdefault(size, Counter()).update(counts)
    total = sum(by_class.values(), Counter())
    n = sum(steps.values())
    return {"accepted_by_source": {s: c / n for s, c in sorted(total.items())} if n else {},
            "accepted_by_batch_size": {size: {s: c / steps[size] for s, c in sorted(counts.items())}
                                       for size, counts in by_class.items()}}


def merge(parts: list[dict], step: int, update: dict, checksums: tuple, drafter: bool) -> dict:
    """The row of step `step` from every worker's share (`parts`, as `rl_step` gathers them),
    the update's statistics (the same on every worker) and the weights' checksums."""
    every = lambda key: [x for p in parts for x in p[key]]  # noqa: E731
    lengths = every("lengths")
    start = min(p["timeline"][0][1] for p in parts)
    rollout_end = max(p["rollout_end"] for p in parts)
    failures = merge_failures([p["reward_failures"] for p in parts])
    row = {
        "step": step,
        "reward_mean": statistics.mean(every("rewards")),
        "accuracy": statistics.mean(every("correct")),
        "response_len_mean": statistics.mean(lengths),
        "response_len_p50": statistics.median(lengths),
        "response_len_max": max(lengths),
        "truncated_frac": sum(p["truncated"] for p in parts) / len(lengths),
        "rollout_s": rollout_end - start,
        "rollout_tail_s": max(p["tail_s"] for p in parts),
        "train_s": max(p["train_s"] for p in parts),
        "compile_s": max(p["compile_s"] for p in parts),  # spec.compile's, inside rollout_s (first steps)
        "step_s": max(p["timeline"][-1][2] for p in parts) - start,
        "sd_tokens_frac": sum(p["sd_tokens"] for p in parts) / max(1, sum(p["tokens"] for p in parts)),
        "accept_len_mean": mean_accept_len(sum((Counter(p["accept_lens"]) for p in parts), Counter())),
        **accepted_by_source(parts),
        "idle_worker_s": sum(p["idle_s"] for p in parts),
        # null without a drafter (so no logger plots a flat zero for it), as the row's contract keeps them
        "drafter_loss": None,
        "drafter_train_s": None,
        "workers": len(parts),
        **update,
        "kept_groups_frac": sum(p["kept"] for p in parts) / len(lengths),
        # samples of advantage exactly 0 (groups whose rewards agree): the update skips them (no KL/entropy term)
        "zero_adv_frac": sum(p["zero_adv"] for p in parts) / len(lengths),
        **failure_counts(failures),
        "reward_failures": failures,
        "weights_sha": checksums[0],
        "lengths": [int(x) for x in lengths],
        "timeline": [[r, name, round(a - start, 4), round(b - start, 4)]
                     for r, p in enumerate(parts) for name, a, b in p["timeline"] if b > a],
        "samples": sorted(every("samples"), key=lambda x: x["prompt_index"]),
    }
    for name in parts[0]["by_function"]:  # each of several reward functions, unweighted
        row[f"reward_fn/{name}"] = statistics.mean(x for p in parts for x in p["by_function"][name])
    if drafter:
        reports = [p["drafter"] for p in parts if p["drafter"] is not None]
        losses = [d["loss"] for d in reports if d["loss"] is not None]
        preempts = [p["preempt_s"] for p in parts if p["preempt_s"] is not None]
        row.update({
            "accept_len_est": weighted([d["accept_est"] for d in reports]),
            "accept_len_est_frozen": weighted([d["accept_est_frozen"] for d in reports]),
            "drafter_loss": statistics.mean(losses) if losses else None,
            "drafter_train_s": sum(d["seconds"] for d in reports),
            "drafter_steps": sum(d["steps"] for d in reports),
            "drafter_preempt_s": max(preempts) if preempts else None,
            "drafter_buffer_dropped": sum(p["buffer_dropped"] for p in parts),
        })
    if checksums[1] is not None:
        row["drafter_sha"] = checksums[1]
    return row


SAMPLES_LOGGED = 4  # prompts per logged step, the first sample of each


def logs_samples(every: int, step: int) -> bool:
    """Whether step `step` (counted from 1) writes samples: the first, then every `every`-th
    (run.log_samples_every; 0: none)."""
    return every > 0 and (step % every == 0 or step == 1)


def sample_log(tokenizer, batch: list, completions: list, rewards, first: int) -> list[dict]:
    """This worker's share of the samples a logged step shows: the first sample of each of the
    step's first SAMPLES_LOGGED prompts that this worker rolled out."""
    out = []
    for c in completions:
        if c.sample_index == 0 and first + c.prompt_index < SAMPLES_LOGGED:
            out.append({"prompt_index": first + c.prompt_index,
                        "prompt": tokenizer.decode(batch[c.prompt_index]["prompt_ids"], skip_special_tokens=False),
                        "response": c.text, "reward": rewards[c.prompt_index, 0].item(),
                        "length": len(c.token_ids), "finish_reason": c.finish_reason})
    return out

"""Plots written as PNG files (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def timeline_segments(timeline: list) -> list[tuple[float, float, str]]:
    """Merge consecutive decode steps with the same arm into (start, end, arm) spans."""
    spans: list[tuple[float, float, str]] = []
    previous_end = 0.0
    for end, _, arm in timeline:
        if spans and spans[-1][2] == arm:
            spans[-1] = (spans[-1][0], end, arm)
        else:
            spans.append((previous_end, end, arm))
        previous_end = end
    return spans


def plot_rollout_timeline(timeline: list, path: str | Path, title: str = "rollout") -> Path:
    """Running requests over time; spans decoded with speculation are shaded per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=110)
    times = [t for t, _, _ in timeline]
    running = [n for _, n, _ in timeline]
    ax.step(times, running, where="post", color="black", linewidth=1.2, label="running requests")
    colors: dict[str, str] = {}
    palette = ["tab:orange", "tab:green", "tab:purple", "tab:red", "tab:cyan", "tab:olive"]
    for start, end, arm in timeline_segments(timeline):
        if arm == "plain":
            continue
        color = colors.setdefault(arm, palette[len(colors) % len(palette)])
        ax.axvspan(start, end, color=color, alpha=0.3, linewidth=0)
    from matplotlib.patches import Patch

    handles = ax.get_legend_handles_labels()[0]
    handles += [Patch(color=c, alpha=0.3, label=f"SD {arm}") for arm, c in colors.items()]
    ax.set_yscale("symlog", linthresh=8)  # the tail (a handful of requests) stays visible
    ax.set_xlabel("seconds")
    ax.set_ylabel("running requests (symlog)")
    ax.set_title(title)
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_rl_curves(history: list[dict], path: str | Path, eval_at_start: float | None = None) -> Path:
    """Reward and accuracy per RL step (held-out greedy accuracy as dots; each reward function
    of several dotted) beside the response length distribution of every step. When reward
    and accuracy agree in every step (no penalty, one 0/1 reward), one line shows both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    rewards, accuracy = [r["reward_mean"] for r in history], [r["accuracy"] for r in history]
    if rewards == accuracy:
        a.plot(steps, rewards, label="reward = accuracy (train samples)")
    else:
        a.plot(steps, rewards, label="reward (train samples)")
        a.plot(steps, accuracy, "--", label="accuracy (train samples)")
    for name in [k for k in history[0] if k.startswith("reward_fn/")]:
        a.plot(steps, [r.get(name) for r in history], ":", label=f"{name[len('reward_fn/'):]} (unweighted)")
    held_out = [(r["step"], r["eval_accuracy"]) for r in history if "eval_accuracy" in r]
    if eval_at_start is not None:
        held_out.insert(0, (0, eval_at_start))
    if held_out:
        a.plot(*zip(*held_out), "o-", label="greedy accuracy (held out)")
    a.set_xlabel("RL step")
    a.set_ylabel("mean over samples")
    a.set_title("reward and accuracy", fontsize=10)
    a.legend(fontsize=8)
    b.boxplot([r["lengths"] for r in history], positions=steps, widths=0.6, showfliers=True,
              flierprops={"markersize": 3})
    every = max(1, len(steps) // 10)
    b.set_xticks(steps[::every], [str(x) for x in steps[::every]])
    b.set_xlabel("RL step")
    b.set_ylabel("response length (tokens)")
    b.set_title("response lengths (box: quartiles, whiskers: 1.5 IQR)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


PHASE_COLORS = {"rollout": "tab:blue", "spot": "tab:orange", "wait": "lightgray", "rewards": "tab:olive",
                "old_logprobs": "tab:cyan", "update": "tab:green", "publish": "tab:purple", "check": "tab:brown"}


def plot_worker_timeline(row: dict, path: str | Path) -> Path:
    """One RL step per worker: rollout, spot training of the drafter, waiting, update, publish
    (`row["timeline"]` = [[worker, phase, start_s, end_s], ...] from the step's metrics)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = row["timeline"]
    workers = sorted({r for r, *_ in spans})
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(workers) + 1.4), dpi=110)
    for rank, phase, start, end in spans:
        ax.barh(rank, end - start, left=start, color=PHASE_COLORS.get(phase, "black"), edgecolor="white", height=0.6)
    ax.set_yticks(workers, [f"worker {r}" for r in workers])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step began")
    ax.set_title(f"RL step {row['step']}: per-worker timeline")
    used = [p for p in PHASE_COLORS if any(s[1] == p for s in spans)]
    ax.legend(handles=[Patch(color=PHASE_COLORS[p], label=p) for p in used], loc="lower right", fontsize=8, ncol=len(used))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_accept_lengths(history: list[dict], path: str | Path) -> Path:
    """Accept length per RL step: measured in the rollout (SD steps only) and, where the
    drafter trained with a frozen copy to compare, estimated on each step's fresh responses
    for the adaptive drafter and for the frozen warm-up drafter (the same data for both);
    with suffix drafts, the accepted drafts of each source; drafter loss on the right axis,
    when the drafter trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(8, 4.3), dpi=110)
    if any(r.get("accept_len_est") is not None for r in history):
        ax.plot(steps, [r.get("accept_len_est") for r in history], "o-", label="adaptive drafter (estimate)")
        ax.plot(steps, [r.get("accept_len_est_frozen") for r in history], "s--",
                label="frozen warm-up drafter (estimate)")
    ax.plot(steps, [r["accept_len_mean"] for r in history], ".:", label="accept length (rollout's SD steps)")
    sources = sorted({s for r in history for s in r.get("accepted_by_source") or {}})
    if sources != ["eagle"]:  # drafts from the suffix index too: what each source's accepted drafts add
        for source in sources:
            ax.plot(steps, [(r.get("accepted_by_source") or {}).get(source, 0.0) for r in history], "-", alpha=0.7,
                    label=f"accepted drafts from {source} (per SD request-step)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("accept length (tokens / verify)")
    ax.set_title("drafter: accept length per RL step", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    losses = [(s, r["drafter_loss"]) for s, r in zip(steps, history) if r.get("drafter_loss") is not None]
    if losses:
        right = ax.twinx()
        line, = right.plot(*zip(*losses), color="gray", alpha=0.5, linewidth=1, label="drafter loss (right)")
        right.set_ylabel("drafter training loss", color="gray")
        handles, labels = handles + [line], labels + [line.get_label()]
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path

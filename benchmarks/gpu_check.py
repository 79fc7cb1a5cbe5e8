"""One GPU check, ready to run: parity, lossless SD, decode speed and 3 RL steps on one device.

    PYTHON=python3 bash benchmarks/gpu_check.sh --out gpu-check.json      # on a GPU machine
    bash benchmarks/gpu_check.sh --device cpu --out cpu-check.json         # here (cpu-small scale)

Prints ONE JSON report on stdout (progress goes to stderr) and writes it to --out FILE; exits 0
when every check that ran passed, 1 otherwise (2: bad arguments or a device this machine lacks).
`--device` defaults to cuda when this PyTorch sees a GPU, else cpu. The scale follows the device:
"full" on a GPU, "cpu-small" on the CPU (smaller models, fewer tokens, one CPU thread unless
--threads); --scale overrides it. --skip-train leaves out `rl_steps` (listed under "skipped").

Report: {"device", "torch", "transformers", "cuda" (torch.version.cuda), "gpu_name" (null on
CPU), "scale", "threads", "float32_matmul_precision", "checks": {name: {"ok", "seconds",
figures...}}, "skipped", "ok", "seconds", "budget_s"}.

NOTHING IN THIS FILE HAS BEEN RUN ON A GPU YET. The whole run should take ~3-5 minutes on one
GPU with the base model cached (an estimate). On 2 shared CPU cores at cpu-small: ~15 s with
--skip-train, ~35-60 s without. Every GPU figure below is an expectation, from
the CPU runs and from what the code does, not a measurement. The first run on GPU hardware is
the measurement; where it disagrees, the expectation was wrong (or the code is).

The checks, and what each figure should be:

1. parity: random Qwen2, Qwen3 (head_dim != hidden/heads) and Llama-3 (rope_type llama3,
   factor 8, original context 64; sequences longer than 64) models built in transformers,
   `save_pretrained`, loaded by tailtamer (`load_model`) and by transformers on the device.
   Weights are normal(0, std) with std chosen so activations stay O(1) (0.1 at hidden 64, 0.05
   at hidden 256: with larger weights attention is near one-hot and bfloat16 flips it).
     fp32_rel_max_diff      max|ours - transformers| / max|transformers| in float32.
                            CPU: 1e-6 to 1e-5. GPU: expected <= 1e-4 (TF32 off: torch's
                            default, reported as float32_matmul_precision). Pass: <= 1e-3.
     bf16_rel_max_diff      the same in bfloat16, both implementations in bfloat16, over the
                            float32 logit scale. CPU: exactly 0 (the same kernels in the same
                            order). GPU: expected ~0.01-0.02 (other attention kernels; on CPU,
                            transformers' own eager against its sdpa attention differs by
                            0.012-0.016 on these models). Pass: <= 0.05. A wrong model is O(1):
                            a Llama-3 model loaded without its rope scaling gives 0.77 (and
                            top-1 agreement 0.52); --inject-fault parity (one projection
                            negated) gives ~1.5 and top-1 ~0.
     top1_agreement         argmax(ours, bf16) == argmax(transformers, bf16), every position.
                            CPU: 1.0. GPU: expected >= 0.95, maybe below 0.98: random models
                            have near-ties (median top-2 margin ~10% of the logit scale) and
                            two correct bfloat16 implementations (transformers eager vs sdpa)
                            agree on 0.955-0.98 of positions here. Reported, not the pass figure.
     top1_agreement_up_to_ties
                            the same, but a position also agrees when both picks are within
                            2% of the logit scale of the float32 top logit (a near-tie bfloat16
                            cannot resolve). CPU 1.0; eager vs sdpa: 1.0. Pass: >= 0.98.
     hf_bf16_vs_fp32_*      transformers' own bfloat16 error, for scale (CPU: rel ~0.02,
                            top-1 0.95-0.98).
2. lossless_sd: a random target (and its float32 twin, the same weights) generates greedily
   through tailtamer's Engine, plainly and with SD at every step (`make_speculator(SpecConfig(
   mode="on", drafter=DIR, strategy=S), target)`), for drafters: random (init_drafter std 0.2:
   accepts almost nothing), warmed (train_drafter on the target's own greedy continuations:
   accepts ~1.5-1.7 tokens per step, so accepted paths are exercised) with strategies 4_1_5
   (chain), 4_2_8 (tree) and 4_1_5+s8 (the chain fused with suffix drafts), and the suffix
   drafter alone (s4_1_5, s4_2_8).
     float64.identical      every SD output equals plain greedy, token for token. Expected true
                            everywhere (CPU: true). Pass: true, with accepted_tokens > 0.
     float32.token_match_rate  share of token positions where SD equals plain greedy. CPU: 1.0.
                            GPU: expected >= 0.99 (verify forwards of 5-8 tokens reduce in
                            another order than 1-token decode steps; near-ties can flip and a
                            flip changes the rest of that sequence). Pass: >= 0.95.
3. bench: decode speed of a random model: on GPU the qwen2.5-0.5b preset (Qwen2.5-0.5B's shape,
   vocab 151936) in bfloat16 and float32 (the RL rollout runs float32 weights), on CPU the tiny
   preset in float32. Never asserted (ok is true when it ran); medians of interleaved repeats.
     plain[dtype][batch]    tokens/s and ms per decode step at batch 1 and 16. GPU, expected
                            (not measured): a 0.5B decode step is launch- and Python-bound
                            (reading 1 GB of bf16 weights takes ~0.2 ms at 4.8 TB/s), so
                            ~5-15 ms per step: ~70-200 tokens/s at batch 1 and nearly 16x that
                            at batch 16.
     verify_cost            t(forward of 8 new tokens)/t(1 token) over a 256-token KV cache
                            (128 on CPU). GPU expected ~1.0-1.3 at batch 1 and 16 (what makes
                            SD pay). CPU, tiny preset, one thread: 1.1-1.2 at batch 1, ~2.1 at 16.
     sd[dtype][batch]       an SD engine with a random one-layer EAGLE drafter, strategy 4_2_8
                            (verifies 8 tokens): accept_len ~1.0 (random drafter), and
                            sd_step_over_plain_step = ms per SD step / ms per plain step:
                            GPU expected ~1.5-3 (4 drafter forwards + one verify), which is
                            the accept length a trained drafter must beat for SD to pay. CPU,
                            tiny preset: 2.4-3.9 at batch 1, 3.5-5.8 at batch 16.
4. rl_steps: `python -m tailtamer train run.steps=3 run.eval_every=0 run.device=DEVICE
   run.out_dir=TMP run.workers=1` (+ rollout.prompts_per_step=4 rollout.group_size=4 on
   cpu-small), run.dtype=auto (bfloat16 training forwards on a GPU that has it). Pass: exit 0,
   3 rows in metrics.jsonl, finite losses, every reward_mean (and reward_fn/*) in [0, 1].
   CPU: 20-50 s (base model cached). GPU: unknown. The built-in base model and its drafter
   are trained ON THE CPU when missing from the cache (`tailtamer sft`: 470 s on 2 cores
   here, then the drafter warm-up: 56 s): on a fresh GPU machine carry the cache
   (`base_model_cached` and `drafter_cached` in the report say whether they were there):
   copy ~/.cache/tailtamer into the repository's ignored .cache/, carry it, and set
   TAILTAMER_CACHE=$PWD/.cache/tailtamer. Its timeout is what is left of --budget-s (480 s)
   after the other checks, at least 60 s.
5. vllm: the vLLM rollout backend (benchmarks/vllm_check.py says what and what to expect), in
   vLLM's environment; skipped where vLLM is not installed.

The project's rule holds here: no `torch.cuda` call outside tailtamer/device.py. Timing waits
for the device through `torch.accelerator.synchronize()` (torch >= 2.6), else a device-to-host
copy of one number (which waits for the device's queue); the GPU's name comes from
tailtamer.device.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):  # run as a file from a checkout (the GPU machine installs nothing)
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from tailtamer.device import device_name  # noqa: E402

import vllm_check  # noqa: E402  (beside this file)
from tailtamer.rollout.vllm_backend import vllm_installed  # noqa: E402

CHECK_NAMES = ("parity", "lossless_sd", "bench", "rl_steps", "vllm")
FAULTS = ("parity", "lossless_sd")

# Pass thresholds (the module docstring says why).
FP32_REL_TOL = 1e-3
BF16_REL_TOL = 0.05
TIE_REL = 0.02
EAGLE_CHECKS = ("4_1_5", "4_2_8", "4_1_5+s8")  # a chain, a tree, the chain fused with suffix drafts
SUFFIX_CHECKS = ("s4_1_5", "s4_2_8")  # the suffix drafter alone
TOP1_MIN = 0.98
FP32_SD_TOKEN_MATCH_MIN = 0.95

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

SCALES = {
    "full": {
        "parity": dict(hidden=256, intermediate=768, layers=4, heads=8, kv_heads=2, qwen3_head_dim=48, vocab=4096,
                       batch=4, seq=256, std=0.05),
        "lossless_sd": dict(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, vocab=1024, std=0.2,
                            prompts=16, batch=8, new_tokens=64, train_prompts=64, train_new_tokens=64,
                            drafter_steps=300),
        "bench": dict(preset="qwen2.5-0.5b", vocab=151936, dtypes=("bfloat16", "float32"), batches=(1, 16),
                      prompt_len=64, new_tokens=128, repeats=3, verify_context=256, verify_repeats=20),
        "rl_steps": dict(overrides=()),
    },
    "cpu-small": {
        "parity": dict(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, qwen3_head_dim=24, vocab=512,
                       batch=2, seq=128, std=0.1),
        "lossless_sd": dict(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=256, std=0.3,
                            prompts=6, batch=3, new_tokens=24, train_prompts=32, train_new_tokens=48,
                            drafter_steps=100),
        "bench": dict(preset="tiny", vocab=512, dtypes=("float32",), batches=(1, 16), prompt_len=32, new_tokens=32,
                      repeats=3, verify_context=128, verify_repeats=10),
        "rl_steps": dict(overrides=("rollout.prompts_per_step=4", "rollout.group_size=4")),
    },
}


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def _round(x, digits: int = 6):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v, digits) for v in x]
    return x


# --- the device ---------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no torch.cuda call: see the module docstring)."""
    if device.type == "cpu":
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
    else:  # torch < 2.6: a blocking copy of one number waits for the current stream
        torch.zeros((), device=device).item()


def timed(fn, device: torch.device):
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


# --- 1. parity ------------------------------------------------------------------------------------

def _hf_quiet():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def parity_configs(p: dict) -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["intermediate"],
                 num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                 max_position_embeddings=max(256, p["seq"]), eos_token_id=1, pad_token_id=0, rms_norm_eps=1e-6)
    return {
        "qwen2": Qwen2Config(**shape),
        "qwen3": Qwen3Config(**shape, head_dim=p["qwen3_head_dim"]),
        "llama3": LlamaConfig(**shape, rope_parameters=dict(LLAMA3_ROPE)),
    }


def random_hf_model(config, std: float, seed: int = 0):
    """A random transformers model: normal(0, std) weights, norms 1 + 0.1 noise, biases 0.1
    noise (tests/test_architectures.py's recipe, with the weight scale a parameter)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise if name.endswith(".bias") else std * noise)
    return model


def corrupt_(model) -> None:
    """A planted bug for --inject-fault: the first layer's attention output projection negated."""
    with torch.no_grad():
        model.layers[0].self_attn.o_proj.weight.neg_()


def compare_logits(ours_bf16, hf_bf16, ours_fp32, ref) -> dict:
    """Figures of one model (every tensor (B, T, V) float32 on one device; `ref` transformers in float32)."""
    scale = ref.abs().max()
    rel = lambda a, b: ((a - b).abs().max() / scale).item()  # noqa: E731
    pick_o, pick_h = ours_bf16.argmax(-1), hf_bf16.argmax(-1)
    top = ref.max(-1).values - TIE_REL * scale
    near = lambda pick: ref.gather(-1, pick[..., None])[..., 0] >= top  # noqa: E731
    return {
        "positions": int(pick_o.numel()),
        "logit_scale": scale.item(),
        "fp32_rel_max_diff": rel(ours_fp32, ref),
        "bf16_rel_max_diff": rel(ours_bf16, hf_bf16),
        "top1_agreement": (pick_o == pick_h).float().mean().item(),
        "top1_agreement_up_to_ties": ((pick_o == pick_h) | (near(pick_o) & near(pick_h))).float().mean().item(),
        "ours_bf16_vs_fp32_rel_max_diff": rel(ours_bf16, ref),
        "hf_bf16_vs_fp32_rel_max_diff": rel(hf_bf16, ref),
        "hf_bf16_vs_fp32_top1": (pick_h == ref.argmax(-1)).float().mean().item(),
    }


def check_parity(device: torch.device, p: dict, fault: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    from tailtamer.model.io import load_model

    _hf_quiet()
    models = {}
    for name, config in parity_configs(p).items():
        with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
            random_hf_model(config, p["std"]).save_pretrained(tmp)
            ids = torch.randint(5, p["vocab"], (p["batch"], p["seq"]), generator=torch.Generator().manual_seed(1))
            ids = ids.to(device)
            logits = {}
            with torch.inference_mode():
                for dtype in (torch.float32, torch.bfloat16):
                    hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device).eval()
                    logits["hf", dtype] = hf(ids).logits.float()
                    del hf
                    ours = load_model(tmp, dtype, device)
                    if fault == "parity":
                        corrupt_(ours)
                    logits["ours", dtype] = ours(ids)[0].float()
                    del ours
            f = compare_logits(logits["ours", torch.bfloat16], logits["hf", torch.bfloat16],
                               logits["ours", torch.float32], logits["hf", torch.float32])
            f["ok"] = (f["fp32_rel_max_diff"] <= FP32_REL_TOL and f["bf16_rel_max_diff"] <= BF16_REL_TOL
                       and f["top1_agreement_up_to_ties"] >= TOP1_MIN)
            models[name] = f
            log(f"parity {name}: fp32 {f['fp32_rel_max_diff']:.2e}  bf16 {f['bf16_rel_max_diff']:.4f}  "
                f"top-1 {f['top1_agreement']:.4f} (up to ties {f['top1_agreement_up_to_ties']:.4f})")
    return {
        "ok": all(m["ok"] for m in models.values()),
        "thresholds": {"fp32_rel_max_diff": FP32_REL_TOL, "bf16_rel_max_diff": BF16_REL_TOL,
                       "top1_agreement_up_to_ties": TOP1_MIN, "tie_margin_rel": TIE_REL},
        "shape": {k: p[k] for k in ("hidden", "layers", "heads", "kv_heads", "vocab", "batch", "seq", "std")},
        "top1_agreement_min": min(m["top1_agreement"] for m in models.values()),
        "top1_agreement_up_to_ties_min": min(m["top1_agreement_up_to_ties"] for m in models.values()),
        "bf16_rel_max_diff_max": max(m["bf16_rel_max_diff"] for m in models.values()),
        "fp32_rel_max_diff_max": max(m["fp32_rel_max_diff"] for m in models.values()),
        "models": models,
    }


# --- 2. lossless speculative decoding ----------------------------------------------------------

def random_prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def random_target(s: dict, seed: int = 0):
    """tests/conftest.py's random_model recipe: large weights (peaked distributions) and random
    biases and norms, float32 on the CPU."""
    from tailtamer.model.config import ModelConfig
    from tailtamer.model.io import init_model

    cfg = ModelConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=512)
    return init_model(cfg, seed=seed, std=s["std"], perturb=0.1)


def token_match(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(positions equal, positions compared): position by position, a length difference counting as a mismatch."""
    same = total = 0
    for x, y in zip(a, b):
        same += sum(i == j for i, j in zip(x, y))
        total += max(len(x), len(y))
    return same, total


def check_lossless_sd(device: torch.device, s: dict, fault: str | None) -> dict:
    from tailtamer.drafter.train import DrafterTrainConfig, train_drafter
    from tailtamer.model.drafter import init_drafter, save_drafter
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams
    from tailtamer.rollout.speculator import SpecConfig, make_speculator

    base = random_target(s)
    target64 = copy.deepcopy(base).double().to(device)
    target32 = base.to(device)  # the same weights, in float32
    greedy = SamplingParams(temperature=0, max_new_tokens=s["new_tokens"])
    engine_cfg = EngineConfig(max_batch_size=s["batch"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-drafters-") as tmp:
        t0 = time.perf_counter()
        train = random_prompts(s["train_prompts"], s["vocab"], seed=9)
        # A random target is only predictable where the drafter has seen it: generating from
        # prompts it was warmed up on makes it accept, so accepted paths are checked too.
        prompts = train[: s["prompts"]]
        outs, _ = Engine(target64, eos_ids=()).generate(train, SamplingParams(temperature=0,
                                                                              max_new_tokens=s["train_new_tokens"]))
        # init_drafter leaves the drafter on the CPU (it only casts to the target's dtype):
        # moved here, else train_drafter would mix devices on a GPU.
        warmed, _ = train_drafter(target64, [p + c.token_ids for p, c in zip(train, outs)],
                                  DrafterTrainConfig(steps=s["drafter_steps"], batch_size=16, lr=3e-3),
                                  drafter=init_drafter(target64).to(device), log=lambda _: None)
        drafter_train_s = time.perf_counter() - t0
        drafters = {"random": Path(tmp) / "random", "warmed": Path(tmp) / "warmed", "suffix": "suffix"}
        save_drafter(init_drafter(target64, std=0.2), drafters["random"])
        save_drafter(warmed, drafters["warmed"])
        report = {"drafter_warmup_s": drafter_train_s,
                  "shape": {k: s[k] for k in ("hidden", "layers", "vocab", "prompts", "batch", "new_tokens")}}
        for dtype, target in (("float64", target64), ("float32", target32)):
            plain, _ = Engine(target, config=engine_cfg, eos_ids=()).generate(prompts, greedy)
            expected = [c.token_ids for c in plain]
            runs = []
            for drafter, where in drafters.items():
                for strategy in SUFFIX_CHECKS if drafter == "suffix" else EAGLE_CHECKS:
                    spec = make_speculator(SpecConfig(mode="on", drafter=str(where), strategy=strategy), target)
                    planted = fault == "lossless_sd" and dtype == "float64" and drafter == "warmed"
                    if planted:  # SD runs another model than plain decoding did
                        corrupt_(target)
                    engine = Engine(target, config=engine_cfg, eos_ids=(), speculator=spec)
                    out, stats = engine.generate(prompts, greedy)
                    if planted:
                        corrupt_(target)  # undone: negated twice
                    got = [c.token_ids for c in out]
                    same, total = token_match(expected, got)
                    runs.append({"drafter": drafter, "strategy": strategy, "identical": got == expected,
                                 "token_match_rate": same / total, "accept_len": stats.accept_len_mean,
                                 "sd_steps": stats.sd_steps, "accepted_tokens": stats.accepted_tokens})
            same = sum(r["token_match_rate"] for r in runs) / len(runs)
            report[dtype] = {
                "identical": all(r["identical"] for r in runs),
                "token_match_rate": same,
                "sequence_match_rate": None,  # filled below
                "tokens_per_run": sum(len(t) for t in expected),
                "accepted_tokens": sum(r["accepted_tokens"] for r in runs),
                "runs": runs,
            }
            accepts = ", ".join(f"{r['drafter']} {r['strategy']} {r['accept_len']:.2f}" for r in runs)
            log(f"lossless_sd {dtype}: identical {report[dtype]['identical']}  token match {same:.4f}  "
                f"accept_len {accepts}")
    for dtype in ("float64", "float32"):
        runs = report[dtype]["runs"]
        report[dtype]["sequence_match_rate"] = sum(r["identical"] for r in runs) / len(runs)
    report["ok"] = (report["float64"]["identical"] and report["float64"]["accepted_tokens"] > 0
                    and all(r["sd_steps"] > 0 for r in report["float64"]["runs"])
                    and report["float32"]["token_match_rate"] >= FP32_SD_TOKEN_MATCH_MIN)
    report["thresholds"] = {"float64": "identical, accepted_tokens > 0",
                            "float32_token_match_rate": FP32_SD_TOKEN_MATCH_MIN}
    return report


# --- 3. decode speed ---------------------------------------------------------------------------------

def verify_cost(model, device: torch.device, batch: int, context: int, repeats: int, qs=(1, 8)) -> dict:
    """Median seconds of one forward over q new tokens per sequence against a `context`-row KV cache."""
    from tailtamer.model.transformer import KVCache

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = KVCache(model.config, batch, context + max(qs), device, model.dtype)
    slots = torch.arange(batch, device=device)
    times = {q: [] for q in qs}
    with torch.inference_mode():
        model.prefill(torch.randint(8, vocab, (batch, context), generator=g).to(device), cache, slots)
        starts = torch.full((batch,), context, device=device)
        inputs = {q: torch.randint(8, vocab, (batch, q), generator=g).to(device) for q in qs}
        for rep in range(repeats + 2):  # the first two are warm-up
            for q in qs:
                dt, _ = timed(lambda: model.decode(inputs[q], cache, slots, starts), device)
                if rep >= 2:
                    times[q].append(dt)
    return {f"t{q}_ms": 1000 * statistics.median(t) for q, t in times.items()}


def check_bench(device: torch.device, b: dict, fault: str | None) -> dict:
    from tailtamer.model.config import preset_config
    from tailtamer.model.drafter import init_drafter
    from tailtamer.model.io import init_model
    from tailtamer.rollout.eagle import EagleProposer
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.sampling import SamplingParams
    from tailtamer.rollout.speculator import Speculator

    cfg = preset_config(b["preset"], vocab_size=b["vocab"])
    t0 = time.perf_counter()
    base = init_model(cfg)
    report = {"preset": b["preset"], "vocab": b["vocab"], "parameters": cfg.num_parameters(),
              "prompt_len": b["prompt_len"], "new_tokens": b["new_tokens"], "repeats": b["repeats"],
              "sd_strategy": "4_2_8", "init_s": time.perf_counter() - t0,
              "plain": {}, "sd": {}, "verify_cost": {}}
    params = SamplingParams(temperature=0, max_new_tokens=b["new_tokens"])
    warm = SamplingParams(temperature=0, max_new_tokens=4)
    for dtype_name in b["dtypes"]:
        model = copy.deepcopy(base).to(device=device, dtype=getattr(torch, dtype_name))
        drafter = init_drafter(model).to(device)  # init_drafter only casts to the target's dtype
        plain_rows, sd_rows, verify_rows = {}, {}, {}
        for batch in b["batches"]:
            g = torch.Generator().manual_seed(batch)
            prompts = torch.randint(8, b["vocab"], (batch, b["prompt_len"]), generator=g).tolist()
            config = EngineConfig(max_batch_size=batch)
            engines = {"plain": Engine(model, config=config, eos_ids=()),
                       "sd": Engine(model, config=config, eos_ids=(),
                                    speculator=Speculator.fixed(EagleProposer(drafter), "4_2_8"))}
            for engine in engines.values():
                engine.generate(prompts, warm)
            walls = {k: [] for k in engines}
            step_ms = {k: [] for k in engines}
            accept = []
            for _ in range(b["repeats"]):  # plain and SD interleaved, repetition by repetition
                for name, engine in engines.items():
                    wall, (_, stats) = timed(lambda: engine.generate(prompts, params), device)
                    walls[name].append(wall)
                    if name == "plain":
                        step_ms[name].append(1000 * stats.plain_seconds / max(1, stats.decode_steps))
                    else:
                        step_ms[name].append(1000 * stats.sd_seconds / max(1, stats.sd_steps))
                        accept.append(stats.accept_len_mean)
            tokens = batch * b["new_tokens"]
            wall = {k: statistics.median(v) for k, v in walls.items()}
            step = {k: statistics.median(v) for k, v in step_ms.items()}
            plain = plain_rows[str(batch)] = {"tokens_per_s": tokens / wall["plain"], "step_ms": step["plain"]}
            sd = sd_rows[str(batch)] = {"tokens_per_s": tokens / wall["sd"], "step_ms": step["sd"],
                                        "accept_len": statistics.median(accept),
                                        "sd_step_over_plain_step": step["sd"] / step["plain"],
                                        "speedup_vs_plain": wall["plain"] / wall["sd"]}
            v = verify_cost(model, device, batch, b["verify_context"], b["verify_repeats"])
            v = verify_rows[str(batch)] = {**v, "t8_over_t1": v["t8_ms"] / v["t1_ms"], "context": b["verify_context"]}
            log(f"bench {dtype_name} batch {batch}: plain {plain['tokens_per_s']:.1f} tok/s "
                f"({plain['step_ms']:.2f} ms/step)  SD step/plain step {sd['sd_step_over_plain_step']:.2f} "
                f"(accept {sd['accept_len']:.2f})  t(8)/t(1) {v['t8_over_t1']:.2f}")
        report["plain"][dtype_name], report["sd"][dtype_name] = plain_rows, sd_rows
        report["verify_cost"][dtype_name] = verify_rows
        del model, drafter
    report["ok"] = True  # speed is reported, never asserted
    return report


# --- 4. three RL steps --------------------------------------------------------------------------

def builtin_cache_state() -> dict:
    """Whether the built-in base model and its drafter are cached (else `tailtamer train` trains
    them first, on the CPU). Mirrors tailtamer.sft.ensure_base_model's and
    tailtamer.drafter.train.ensure_builtin_drafter's paths."""
    from tailtamer.drafter.train import DrafterTrainConfig
    from tailtamer.sft import SFTConfig, cache_root

    cfg = SFTConfig()
    base = cache_root() / f"base-{cfg.preset}-{cfg.key()}"
    drafter = base.parent / f"{base.name}-drafter-{DrafterTrainConfig().key()}"
    return {"cache_root": str(cache_root()), "base_model_cached": (base / "sft.json").is_file(),
            "drafter_cached": (drafter / "train.json").is_file()}


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def judge_metrics(rows: list[dict], steps: int) -> tuple[bool, list[str]]:
    problems = []
    if len(rows) != steps:
        problems.append(f"{len(rows)} rows in metrics.jsonl, expected {steps}")
    for row in rows:
        if not _finite_number(row.get("loss")):
            problems.append(f"step {row.get('step')}: loss {row.get('loss')!r} is not finite")
        rewards = {k: v for k, v in row.items() if k == "reward_mean" or k.startswith("reward_fn/")}
        if "reward_mean" not in rewards:
            problems.append(f"step {row.get('step')}: no reward_mean")
        for k, v in rewards.items():
            if not (_finite_number(v) and 0 <= v <= 1):
                problems.append(f"step {row.get('step')}: {k} {v!r} is not in [0, 1]")
    return not problems, problems


def check_rl_steps(device: torch.device, r: dict, timeout_s: float, steps: int = 3) -> dict:
    report = {**builtin_cache_state(), "timeout_s": timeout_s, "overrides": list(r["overrides"])}
    with tempfile.TemporaryDirectory(prefix="gpu-check-rl-") as tmp:
        cmd = [sys.executable, "-m", "tailtamer", "train", f"run.steps={steps}", "run.eval_every=0",
               f"run.device={device}", f"run.out_dir={tmp}", "run.name=gpu-check", "run.workers=1",
               *r["overrides"]]
        report["command"] = " ".join(cmd[1:])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            return {**report, "ok": False, "error": f"timed out after {timeout_s:.0f} s"
                    + ("" if report["base_model_cached"] else " (the base model was not cached: it trains on "
                       "the CPU first; carry ~/.cache/tailtamer and set TAILTAMER_CACHE)"),
                    "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
        report["returncode"] = proc.returncode
        path = Path(tmp) / "gpu-check" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        ok, problems = judge_metrics(rows, steps)
        ok = ok and proc.returncode == 0
        if proc.returncode:
            problems.insert(0, f"exit code {proc.returncode}")
        report.update({
            "ok": ok,
            "rows": len(rows),
            "loss": [row.get("loss") for row in rows],
            "reward_mean": [row.get("reward_mean") for row in rows],
            "step_s": [row.get("step_s") for row in rows],
            "rollout_s": [row.get("rollout_s") for row in rows],
            "train_s": [row.get("train_s") for row in rows],
            "accept_len_mean": [row.get("accept_len_mean") for row in rows],
            "workers": rows[0].get("workers") if rows else None,
        })
        if problems:
            report["problems"] = problems
        if not ok:
            report["stdout_tail"], report["stderr_tail"] = proc.stdout[-2000:], proc.stderr[-3000:]
        return report


# --- the report ---------------------------------------------------------------------------------

def aggregate(checks: dict[str, dict]) -> bool:
    """True when at least one check ran and every one that ran passed (ok is exactly True)."""
    return bool(checks) and all(c.get("ok") is True for c in checks.values())


def run_check(name: str, fn) -> dict:
    log(f"{name} ...")
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as e:  # a crash is a failed check, and the other checks still run
        import traceback

        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = time.perf_counter() - t0
    log(f"{name}: {'ok' if result.get('ok') is True else 'FAILED'} in {result['seconds']:.1f} s")
    return result


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    ap.add_argument("--scale", choices=("auto", *SCALES), default="auto",
                    help="auto: full on a GPU, cpu-small on the CPU")
    ap.add_argument("--checks", default=",".join(CHECK_NAMES), help=f"comma-separated subset of {CHECK_NAMES}")
    ap.add_argument("--skip-train", action="store_true", help="leave out rl_steps")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole run's time budget; rl_steps gets what is left (at least 60 s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 at cpu-small scale, torch's default otherwise)")
    ap.add_argument("--inject-fault", choices=FAULTS, default=None,
                    help="plant a bug in tailtamer's model for that check (to see the check fail)")
    args = ap.parse_args(argv)
    chosen = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CHECK_NAMES]
    if unknown or not chosen:
        ap.error(f"--checks: unknown {unknown}; choose from {CHECK_NAMES}")
    args.checks = chosen
    return args


CHECKS = {
    "parity": lambda device, scale, args, left: check_parity(device, scale["parity"], args.inject_fault),
    "lossless_sd": lambda device, scale, args, left: check_lossless_sd(device, scale["lossless_sd"], args.inject_fault),
    "bench": lambda device, scale, args, left: check_bench(device, scale["bench"], args.inject_fault),
    "rl_steps": lambda device, scale, args, left: check_rl_steps(device, scale["rl_steps"], max(60.0, left)),
    "vllm": lambda device, scale, args, left: vllm_check.check_vllm(device, args.scale_name, left),
}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tailtamer.device import resolve_device
    from tailtamer.errors import ConfigError

    try:
        device = resolve_device(args.device)
    except ConfigError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    scale_name = args.scale if args.scale != "auto" else ("cpu-small" if device.type == "cpu" else "full")
    args.scale_name = scale_name
    threads = args.threads or (1 if scale_name == "cpu-small" else None)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    report = {"device": str(device), "torch": torch.__version__, "transformers": hf_version,
              "cuda": torch.version.cuda, "gpu_name": device_name(device), "scale": scale_name,
              "threads": torch.get_num_threads(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
              "inject_fault": args.inject_fault, "checks": {}, "skipped": {}}
    for name in CHECK_NAMES:
        if name not in args.checks:
            continue
        if name == "rl_steps" and args.skip_train:
            report["skipped"][name] = "--skip-train"
            continue
        if name == "vllm" and not vllm_installed():
            report["skipped"][name] = "vLLM is not installed in this Python (benchmarks/vllm_check.py)"
            continue
        left = args.budget_s - (time.perf_counter() - t0)
        report["checks"][name] = run_check(name, lambda: CHECKS[name](device, SCALES[scale_name], args, left))
    report["ok"] = aggregate(report["checks"])
    report["seconds"] = time.perf_counter() - t0
    report["budget_s"] = args.budget_s
    text = json.dumps(_round(report), indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

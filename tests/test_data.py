"""RL prompt datasets: JSONL and parquet, string or chat prompts, `answer` or verl's
`reward_model.ground_truth`, too-long prompts skipped and counted, and errors naming file and row."""

import pytest
from conftest import write_jsonl

from tailtamer.config import load_train_config
from tailtamer.errors import DataError
from tailtamer.model.tokenizer import char_tokenizer
from tailtamer.rl.data import load_task_rows
from tailtamer.rl.trainer import train

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]
ROWS = [
    {"prompt": "1+1=", "answer": "2"},
    {"messages": MESSAGES, "answer": 5},
    {"prompt": MESSAGES, "reward_model": {"style": "rule", "ground_truth": "5"}},  # verl's layout
]


def _expected(tok):
    chat = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))
    return [{"prompt_ids": tok.encode("1+1="), "answer": "2", "_row": 1},
            {"prompt_ids": chat, "answer": "5", "_row": 2},
            {"prompt_ids": chat, "answer": "5", "_row": 3}]


def test_string_and_chat_prompts_with_either_answer_field(tmp_path):
    tok = char_tokenizer()
    rows, skipped = load_task_rows(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, max_prompt_tokens=256)
    assert skipped == 0
    assert rows == _expected(tok)
    # the whole conversation, then the generation prompt (decode drops the special tokens)
    assert tok.decode(rows[1]["prompt_ids"]) == "system\nbe brief\nuser\n2+3?\nassistant\n"


def test_parquet_reads_like_jsonl(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    pd.DataFrame([{"prompt": MESSAGES, "reward_model": {"style": "rule", "ground_truth": "5"}},
                  {"prompt": MESSAGES, "reward_model": {"style": "rule", "ground_truth": "7"}}]).to_parquet(path)
    tok = char_tokenizer()
    rows, _ = load_task_rows(path, tok, max_prompt_tokens=256)
    chat = _expected(tok)[1]["prompt_ids"]
    assert rows == [{"prompt_ids": chat, "answer": "5", "_row": 1}, {"prompt_ids": chat, "answer": "7", "_row": 2}]


def test_long_prompts_are_skipped_and_counted_not_truncated(tmp_path):
    tok = char_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 40, "answer": "1"}, {"prompt": "short", "answer": "2"},
                                         {"prompt": "y" * 41, "answer": "3"}])
    rows, skipped = load_task_rows(path, tok, max_prompt_tokens=40)
    assert skipped == 1
    assert [r["answer"] for r in rows] == ["1", "2"] and len(rows[0]["prompt_ids"]) == 40
    with pytest.raises(DataError, match=r"d\.jsonl: every prompt is longer than 4 tokens"):
        load_task_rows(path, tok, max_prompt_tokens=4)


@pytest.mark.parametrize("lines, message", [
    ([], "d.jsonl: no rows (the file is empty)"),
    (['{"prompt": "a", "answer": "1"}', "{oops"], "d.jsonl:2: not valid JSON"),
    (['["a", "1"]'], "d.jsonl:1: expected a JSON object, got list"),
    (['{"prompt": "a", "answer": "1"}', '{"answer": "1"}'], "d.jsonl:2: row has neither 'prompt' nor 'messages' (nor a GSM8K 'question'); data.prompt_key names another column"),
    (['{"prompt": "a"}'], "d.jsonl:1: row has no 'answer' (or 'reward_model.ground_truth')"),
    (['{"prompt": "a", "reward_model": {"style": "rule"}}'], "d.jsonl:1: row has no 'answer'"),
    (['{"prompt": "", "answer": "1"}'], "d.jsonl:1: field 'prompt' is empty"),
    (['{"prompt": " \\n ", "answer": "1"}'], "d.jsonl:1: field 'prompt' is empty (only whitespace)"),
    (['{"prompt": 3, "answer": "1"}'], "d.jsonl:1: field 'prompt' must be a string or a list of messages"),
    (['{"messages": [{"role": "user"}], "answer": "1"}'], "d.jsonl:1: message 0 needs string fields"),
    (['{"messages": [], "answer": "1"}'], "d.jsonl:1: 'messages' must be a non-empty list"),
], ids=["empty", "bad-json", "not-object", "no-prompt", "no-answer", "no-ground-truth", "empty-prompt",
        "blank-prompt", "prompt-type", "message-fields", "no-messages"])
def test_bad_rows_name_the_file_and_row(tmp_path, lines, message):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(DataError) as e:
        load_task_rows(path, char_tokenizer(), max_prompt_tokens=256)
    assert message in str(e.value)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(DataError, match="none.jsonl: file not found"):
        load_task_rows(tmp_path / "none.jsonl", char_tokenizer(), 256)
    with pytest.raises(DataError, match="is a directory; give the JSONL or parquet file in it"):
        load_task_rows(tmp_path, char_tokenizer(), 256)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet: (cannot read parquet|reading parquet needs pandas)"):
        load_task_rows(bad, char_tokenizer(), 256)


def test_a_run_reports_skipped_prompts_and_a_bad_row_stops_it_before_any_work(toy, tmp_path):
    data = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": p, "answer": "0"} for p in ["ab", "cd", "ef", "gh"]]
                  + [{"prompt": "z" * 300, "answer": "0"}])
    lines = []
    cfg = load_train_config(None, toy + [f"data.train={data}", "data.max_prompt_tokens=64", "run.steps=1",
                                         "run.workers=1", "run.name=skips"])
    summary = train(cfg, log=lines.append, console=lambda _: None)
    assert summary["skipped_prompts"] == 1
    assert any("skipped 1 prompts longer than 64 tokens" in line for line in lines)
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "ab", "answer": "0"}, {"prompt": "cd"}])
    cfg = load_train_config(None, toy + [f"data.train={broken}", "run.workers=1", "run.name=broken"])
    with pytest.raises(DataError, match=r"broken\.jsonl:2: row has no 'answer'"):
        train(cfg, log=lambda _: None)
    assert not (tmp_path / "runs" / "broken").exists()


GSM8K_ROW = {"question": "Tom has 3 apples and buys 4. How many?",
             "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"}


GSM8K = {"data_source": "openai/gsm8k"}  # a raw GSM8K row is one, for rl.reward=auto


def test_a_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark: the first row still parses."""
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS[:2])
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    tok = char_tokenizer()
    assert load_task_rows(marked, tok, 256) == load_task_rows(plain, tok, 256)


def test_raw_gsm8k_rows_column_mapping_and_content_parts(tmp_path):
    tok = char_tokenizer()
    rows, _ = load_task_rows(write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K_ROW, {**GSM8K_ROW, "answer": "x\n#### 1,250"}]),
                             tok, 256)
    assert rows == [{"prompt_ids": tok.encode(GSM8K_ROW["question"]), "answer": "7", "_row": 1, "context": GSM8K},
                    {"prompt_ids": tok.encode(GSM8K_ROW["question"]), "answer": "1250", "_row": 2, "context": GSM8K}]
    mapped = write_jsonl(tmp_path / "mapped.jsonl", [{"problem": "1+1=", "solution": 2, "prompt": "not this"}])
    rows, _ = load_task_rows(mapped, tok, 256, prompt_key="problem", answer_key="solution")
    assert rows == [{"prompt_ids": tok.encode("1+1="), "answer": "2", "_row": 1}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3?"}]}]
    rows, _ = load_task_rows(write_jsonl(tmp_path / "parts.jsonl", [{"messages": parts, "answer": 5}]), tok, 256)
    plain = [{"role": "user", "content": "2+3?"}]
    assert rows[0]["prompt_ids"] == tok.encode(tok.apply_chat_template(plain, add_generation_prompt=True))


@pytest.mark.parametrize("row, keys, message", [
    ({"prompt": "a", "answer": "1"}, {"prompt_key": "question"}, "d.jsonl:1: no column 'question' (data.prompt_key)"),
    ({"prompt": "a", "answer": "1"}, {"answer_key": "label"}, "d.jsonl:1: no column 'label' (data.answer_key)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "answer": "1"}, {},
     "d.jsonl:1: message 0 has a content part of type 'image_url'"),
    ({"q": "a", "a": float("nan")}, {"prompt_key": "q", "answer_key": "a"}, "d.jsonl:1: field 'a' is nan"),
    ({"q": "", "answer": "1"}, {"prompt_key": "q"}, "d.jsonl:1: field 'q' is empty"),
])
def test_bad_columns_and_parts_name_the_file_row_and_key(tmp_path, row, keys, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_task_rows(write_jsonl(tmp_path / "d.jsonl", [row]), char_tokenizer(), 256, **keys)


def test_a_raw_gsm8k_file_trains_with_math_rewards(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K_ROW] * 4)
    cfg = load_train_config(None, [f"run.model={model_dir}", f"data.train={data}", "rl.reward=math",
                                   f"run.out_dir={tmp_path}", "run.steps=2", "run.eval_every=0", "spec.mode=off",
                                   "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4"])
    summary = train(cfg, log=lambda _: None, console=lambda _: None)
    assert summary["steps"] == 2 and summary["reward_errors"] == 0 and summary["reward_timeouts"] == 0


def test_a_file_without_eval_prompts_holds_some_out_and_says_so(model_dir, tmp_path):
    from tailtamer.rl.run_state import prepare, setup

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)])
    base = [f"run.model={model_dir}", f"data.train={data}", f"run.out_dir={tmp_path}", "spec.mode=off", "data.n_eval=8"]
    logs = []
    s = setup(prepare(load_train_config(None, base + ["run.eval_every=5", "run.name=a"])), log=logs.append)
    assert len(s.eval_rows) == 4 and len(s.train_rows) == 36  # at most a tenth of the file
    train_ids = {tuple(r["prompt_ids"]) for r in s.train_rows}
    assert not train_ids & {tuple(r["prompt_ids"]) for r in s.eval_rows}
    assert any("holding out 4 of the 40 prompts" in line and "data.eval" in line for line in logs)
    s = setup(prepare(load_train_config(None, base + ["run.eval_every=0", "run.name=b"])), log=lambda _: None)
    assert len(s.train_rows) == 40 and not s.eval_rows  # no evaluation: every prompt trains
    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(9)])
    logs = []
    s = setup(prepare(load_train_config(None, base + [f"data.train={small}", "run.eval_every=5", "run.name=c"])),
              log=logs.append)
    assert len(s.train_rows) == 9 and not s.eval_rows
    assert any("has 9 prompts, too few to hold a tenth out: no held-out evaluation" in line for line in logs)


def test_content_parts_read_from_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    tok = char_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3?"}]}]
    path = tmp_path / "d.parquet"
    pd.DataFrame([{"prompt": parts, "answer": "5"}]).to_parquet(path)  # nested lists come back as arrays
    rows, _ = load_task_rows(path, tok, 256)
    plain = [{"role": "user", "content": "2+3?"}]
    assert rows[0]["prompt_ids"] == tok.encode(tok.apply_chat_template(plain, add_generation_prompt=True))


@pytest.mark.parametrize("n,k", [(10, 4), (7, 7), (12, 5), (5, 16), (9, 1)])
def test_prompt_order_is_shuffled_passes_without_repeats(n, k):
    from tailtamer.rl.data import PromptOrder

    order = PromptOrder(n, k, seed=3)
    k = min(n, k)
    steps = [order.indices(s) for s in range(4 * n)]
    stream = [i for step in steps for i in step]
    for e in range(len(stream) // n):  # every pass is a permutation: no prompt twice before all once
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    assert all(len(set(step)) == len(step) == k for step in steps)  # a step never holds a prompt twice
    fresh = PromptOrder(n, k, seed=3)  # a resumed run asks for a later step first
    assert fresh.indices(3 * n - 1) == steps[3 * n - 1] and fresh.indices(0) == steps[0]
    if n > 2:
        assert len({tuple(stream[e * n:(e + 1) * n]) for e in range(4)}) > 1  # each pass shuffled anew
        assert [PromptOrder(n, k, seed=s).indices(0) for s in range(5)] != [steps[0]] * 5  # the seed shuffles
    assert order.epochs_done(len(steps)) == len(stream) / n


def test_a_row_with_both_prompt_and_messages_is_read_as_data_prompt_key_says(tmp_path):
    from tailtamer.model.tokenizer import char_tokenizer

    row = {"prompt": "ab", "messages": [{"role": "user", "content": "c"}], "answer": "1"}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match="d.jsonl:1: row has both 'prompt' and 'messages'; keep one or choose one with "
                                        "data.prompt_key"):
        load_task_rows(path, char_tokenizer(), 64)
    rows, _ = load_task_rows(path, char_tokenizer(), 64, prompt_key="prompt")
    assert rows[0]["prompt_ids"] == char_tokenizer().encode("ab")


def test_built_in_prompts_too_long_for_the_model_are_skipped_and_counted():
    """As a file's are: a model of tiny context crashed the first rollout with `prompt 1: prompt
    has 27 tokens; the context holds 8`."""
    from tailtamer.rl.data import datasets

    cfg = load_train_config(None, ["data.n_builtin=200", "data.n_eval=20"])
    tokenizer = char_tokenizer()
    everything, evals, skipped = datasets(cfg, tokenizer, 1000, print)
    assert (len(everything), len(evals), skipped) == (200, 20, 0)
    limit = sorted(len(r["prompt_ids"]) for r in everything)[50]
    train, evals, skipped = datasets(cfg, tokenizer, limit, print)
    assert 50 < len(train) < 200 and all(len(r["prompt_ids"]) <= limit for r in train + evals)
    assert skipped == 200 - len(train) + 20 - len(evals)
    assert train == [r for r in everything if len(r["prompt_ids"]) <= limit]  # the same problems, in order
    with pytest.raises(DataError, match=r"data.train=builtin: every prompt is longer than 2 tokens"):
        datasets(cfg, tokenizer, 2, print)


def test_data_eval_builtin_is_the_held_out_built_in_problems(tmp_path, monkeypatch):
    """data.eval=builtin was taken for a file of that name in the working directory."""
    from tailtamer.rl.data import datasets

    monkeypatch.chdir(tmp_path)
    tokenizer = char_tokenizer()
    _, default_evals, _ = datasets(load_train_config(None, ["data.n_eval=8"]), tokenizer, 1000, print)
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=?", "answer": str(i + 1)} for i in range(40)])
    cfg = load_train_config(None, [f"data.train={data}", "data.eval=builtin", "data.n_eval=8"])
    assert cfg.data.eval == "builtin"
    logs = []
    train_rows, evals, _ = datasets(cfg, tokenizer, 1000, logs.append)
    assert len(train_rows) == 40 and not logs  # nothing held out of the file
    assert evals == default_evals and len(evals) == 8


def test_a_held_out_file_no_evaluation_reads_is_said_and_not_loaded(tmp_path):
    """data.eval with run.eval_every=0 or data.n_eval=0 was loaded (its errors stopping the run)
    and dropped without a word."""
    from tailtamer.rl.data import datasets, unread_data

    missing = tmp_path / "missing.jsonl"
    for off, why in (("run.eval_every=0", "run.eval_every=0 evaluates never"),
                     ("data.n_eval=0", "data.n_eval=0 evaluates on no prompts")):
        cfg = load_train_config(None, [f"data.eval={missing}", off, "data.n_builtin=10"])
        assert unread_data(cfg) == [f"data.eval={missing} is not read: {why}"]
        assert datasets(cfg, char_tokenizer(), 1000, print)[1] == []  # the missing file is never opened
    assert unread_data(load_train_config(None, ["data.eval=builtin"])) == []

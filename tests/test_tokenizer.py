"""The built-in character tokenizer and chat templates, against transformers."""

import json

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tailtamer.errors import DataError
from tailtamer.model.tokenizer import Tokenizer, char_tokenizer, load_tokenizer, render_chat_template

TEXTS = ["12+3=15\nanswer: 15", "  spaces  and\ttabs?", "<|im_start|>user\nhi<|im_end|>", "<eos>"]


def test_char_tokenizer_round_trips_text():
    tok = char_tokenizer()
    for text in ["12+3=15\nanswer: 15", "  two  spaces ", "~!@#$%^&*()_+{}|:\"<>?"]:
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("model_type", [None, "qwen2", "qwen3", "llama"])
def test_char_tokenizer_loads_in_transformers_with_same_ids(tmp_path, model_type):
    """In a model directory too: transformers ≥ 5 rebuilds a Qwen2 directory's tokenizer as its
    byte-level Qwen2Tokenizer from the vocabulary (a character vocabulary lost its spaces and
    newlines there). Out of the alphabet (a tab) it drops what ours calls <unk>."""
    char_tokenizer().save(tmp_path)
    if model_type:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours = load_tokenizer(tmp_path)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS if model_type != "qwen2" else [t for t in TEXTS if "\t" not in t]:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False).input_ids == ids
        assert auto(text, add_special_tokens=False).input_ids == ids, (text, type(auto).__name__)
        assert auto.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert auto.eos_token_id == ours.eos_token_id == 1
    assert auto.pad_token_id == ours.pad_token_id == 0
    assert ours.encode("11-2=9\n9-1=8") == [23, 23, 19, 24, 35, 31, 5, 31, 19, 23, 35, 30]  # the ids of every model


def test_special_tokens_are_single_tokens_and_skipped_on_decode():
    tok = char_tokenizer()
    ids = tok.encode("a<eos>")
    assert ids == [tok.encode("a")[0], tok.eos_token_id]
    assert tok.decode(ids) == "a"
    assert tok.decode(ids, skip_special_tokens=False) == "a<eos>"


LLAMA3_LIKE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('bad role ' + message['role']) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- if loop.last and message['role'] == 'assistant' %}{% break %}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2=? "},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE], ids=["chatml", "llama3-like"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tmp_path, template, add_generation_prompt):
    tok = char_tokenizer()
    if template:
        tok = Tokenizer(tok.backend, {**tok.config, "chat_template": template, "bos_token": "<eos>"})
    tok.save(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert load_tokenizer(tmp_path).apply_chat_template(MESSAGES, add_generation_prompt) == expected


def test_template_raise_exception_is_a_data_error():
    with pytest.raises(DataError, match="bad role tool"):
        render_chat_template(LLAMA3_LIKE, [{"role": "tool", "content": "x"}], bos_token="")


def test_no_template_is_a_clear_error():
    tok = char_tokenizer()
    bare = Tokenizer(tok.backend, {"eos_token": "<eos>"})
    with pytest.raises(DataError, match="no chat_template"):
        bare.apply_chat_template(MESSAGES)


def test_missing_or_broken_tokenizer_file(tmp_path):
    from tailtamer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="cannot parse tokenizer"):
        load_tokenizer(tmp_path)

"""``verify --prompts FILE``: token ids or text (with a tokenizer present locally)."""

from __future__ import annotations

import pytest
from kvskill.core.errors import BadInputError
from kvskill.verify.prompts import read_prompts


def _read(path, tokenizer_dirs=(), vocab_size=100, max_len=16):
    return read_prompts(
        path, vocab_size=vocab_size, max_len=max_len, tokenizer_dirs=list(tokenizer_dirs)
    )


def test_token_ids_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("1,2,3\n\n  4 5  6 \n7, 8,\n")
    assert _read(path) == [[1, 2, 3], [4, 5, 6], [7, 8]]


def _write_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "paged": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(
        directory
    )


def test_text_uses_the_first_local_tokenizer(tmp_path):
    empty, source = tmp_path / "converted", tmp_path / "checkpoint"
    empty.mkdir()
    _write_tokenizer(source)
    path = tmp_path / "prompts.txt"
    path.write_text("hello paged world\n9,1\n")
    assert _read(path, [empty, source]) == [[1, 2, 3], [9, 1]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hello world\n", "no tokenizer is present"),
        ("1,2,100\n", "token id 100 is outside the vocabulary"),
        (",".join(["1"] * 17) + "\n", "17 tokens, longer than the 16"),
        ("\n  \n", "holds no prompt"),
    ],
)
def test_bad_prompts_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    with pytest.raises(BadInputError, match=message):
        _read(path, [tmp_path])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompts", "{text}"], "no tokenizer is present"),
        (["--drift-ratio", "nan"], "--drift-ratio nan is not a ratio"),
    ],
)
def test_bad_verify_options_exit_2_on_one_line(converted, tmp_path, capsys, args, message):
    from kvskill.cli import main

    text = tmp_path / "prompts.txt"
    text.write_text("a prompt in words\n")
    argv = ["verify", str(converted.directory("qwen3"))] + [a.format(text=text) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1

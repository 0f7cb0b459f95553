"""The prompts verify runs: generated ones of varied lengths, or ``--prompts FILE``.

Generated prompts are random token ids whose lengths cross block edges and the sliding
window (``choose_prompt_lengths``). A prompts file holds one prompt per line.

A line of integers (separated by commas and/or spaces) is a prompt of token ids; any other
line is text, tokenized with the checkpoint's own tokenizer when its files are present
locally (never downloaded). Blank lines are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from kvskill.analyzer.config import text_config
from kvskill.analyzer.config_keys import lookup
from kvskill.analyzer.plan import Plan
from kvskill.core.attn_types import AttnType
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import read_text
from kvskill.verify.options import VerifyOptions

_IDS = re.compile(r"\d+(?:[\s,]+\d+)*,?")
#: any one of these marks a directory holding a tokenizer transformers can load offline
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
MAX_PROMPTS = 256


def find_tokenizer_dir(candidates: list[Path]) -> Path | None:
    """The first directory among CANDIDATES that holds tokenizer files."""
    return next(
        (d for d in candidates if d.is_dir() and any((d / f).is_file() for f in TOKENIZER_FILES)),
        None,
    )


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # any failure of the tokenizer files is the input's
        raise BadInputError(
            f"cannot load the tokenizer in {directory}: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}"
        ) from exc


def read_prompts(
    path: Path, *, vocab_size: int, max_len: int, tokenizer_dirs: list[Path]
) -> list[list[int]]:
    """The prompts of PATH as token ids.

    Args:
        vocab_size: ids must be below it (the checked config's vocabulary).
        max_len: longest prompt the model takes with the tokens verify generates after it.
        tokenizer_dirs: where to look for a tokenizer, in order, for text lines.

    Raises:
        BadInputError: no prompt, an id outside the vocabulary, a prompt too long, or text
            without a local tokenizer.
    """
    text = read_text(path, what="prompts file")
    prompts: list[list[int]] = []
    tokenizer = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        where = f"{path} line {number}"
        if _IDS.fullmatch(stripped):
            ids = [int(t) for t in re.split(r"[\s,]+", stripped.rstrip(",")) if t]
        else:
            if tokenizer is None:
                found = find_tokenizer_dir(tokenizer_dirs)
                if found is None:
                    raise BadInputError(
                        f"{where} is text, but no tokenizer is present in "
                        f"{', '.join(map(str, tokenizer_dirs))} (kvskill never downloads one); "
                        "give token ids instead, e.g. 1,2,3"
                    )
                tokenizer = _tokenizer(found)
            ids = list(tokenizer(stripped)["input_ids"])
        if not ids:
            raise BadInputError(f"{where}: the prompt has no tokens")
        outside = [i for i in ids if i >= vocab_size]
        if outside:
            raise BadInputError(
                f"{where}: token id {outside[0]} is outside the vocabulary of the checked "
                f"config ({vocab_size} tokens; a shrunk twin has a small one)"
            )
        if len(ids) > max_len:
            raise BadInputError(
                f"{where}: {len(ids)} tokens, longer than the {max_len} the model takes "
                "before the tokens verify generates"
            )
        prompts.append(ids)
        if len(prompts) > MAX_PROMPTS:
            raise BadInputError(f"{path} holds more than {MAX_PROMPTS} prompts")
    if not prompts:
        raise BadInputError(f"{path} holds no prompt (one per line: token ids or text)")
    return prompts


def choose_prompt_lengths(
    num_prompts: int, block_size: int, window: int | None, limit: int
) -> list[int]:
    """Variable lengths: short, several blocks long, and past the window when there is one.

    Example (block 4, window 8): 3, 21, 19, 33 for four prompts.
    """
    span = max(window or 0, 2 * block_size)
    base = [3, span + 2 * block_size + 5, 4 * block_size + 3, 6 * block_size + 1 + (window or 0)]
    lengths = [base[i % len(base)] + (i // len(base)) * 2 for i in range(num_prompts)]
    return [max(1, min(n, limit)) for n in lengths]


def make_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def prompt_lengths_for(
    plan: Plan,
    config: dict[str, Any],
    options: VerifyOptions,
    block_size: int,
    names: dict[str, str] | None = None,
) -> list[int]:
    """Prompt lengths that cross block (and window) edges and leave room for the new tokens."""
    text = text_config(config)[0]  # a vision-language model's decoder keeps these
    window = text.get("sliding_window") if is_windowed(plan) else None
    positions = lookup(text, "max_positions", names)[0]  # seq_length (ChatGLM), n_positions
    limit = int(positions or 4096) - options.max_new_tokens
    return choose_prompt_lengths(options.num_prompts, block_size, window, limit)


def is_windowed(plan: Plan) -> bool:
    """Whether any layer of the plan attends over a sliding window."""
    return AttnType.SLIDING_WINDOW in plan.layer_attn_types()

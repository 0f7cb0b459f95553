"""What ``kvskill run`` generates: its prompts and sampling (``Workload``), and the KV pool
sized for them when no flag sizes it."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import MAX_JSON_BYTES, MAX_TEXT_BYTES, loads_json, read_text

if TYPE_CHECKING:
    from kvskill.runtime import SamplingParams
    from kvskill.runtime.engine_config import EngineConfig


#: ``run``'s flags that name the workload, in the order ``--help`` lists them
WORKLOAD_OPTIONS = (
    click.option(
        "--prompt-ids",
        default=None,
        help="Prompt token ids: a comma list ('1,2,3'; ';' separates prompts), or a .json/.jsonl "
        "file of id lists.",
    ),
    click.option(
        "--num-requests", type=click.IntRange(min=1), default=None, help="Synthetic load."
    ),
    click.option("--prompt-len", type=click.IntRange(min=1), default=32, show_default=True),
    click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True),
    click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True),
    click.option(
        "--top-k",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="0 disables top-k.",
    ),
    click.option(
        "--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True
    ),
    click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS."),
)


def workload_options(command):
    """Stack the workload flags onto COMMAND (``Workload.from_options`` reads them)."""
    for option in reversed(WORKLOAD_OPTIONS):
        command = option(command)
    return command


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The prompts of one run (given ids, or seeded synthetic ones) and how to sample them."""

    #: --prompt-ids as given: a comma list, ';' between prompts, or a .json/.jsonl file
    prompt_ids: str | None
    #: --num-requests synthetic prompts of --prompt-len tokens (not with prompt_ids)
    num_requests: int | None
    prompt_len: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    ignore_eos: bool
    #: seeds the synthetic prompts
    seed: int

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Workload:
        """The workload named by ``run``'s click options."""
        return cls(
            prompt_ids=options["prompt_ids"],
            num_requests=options["num_requests"],
            prompt_len=options["prompt_len"],
            max_tokens=options["max_tokens"],
            temperature=options["temperature"],
            top_k=options["top_k"],
            top_p=options["top_p"],
            ignore_eos=options["ignore_eos"],
            seed=options["seed"],
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 and not self.top_k and self.top_p >= 1.0

    def sampling_params(self) -> SamplingParams:
        from kvskill.runtime import SamplingParams

        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            ignore_eos=self.ignore_eos,
        )

    def prompts(self, *, vocab_size: int, max_model_len: int) -> list[list[int]]:
        """The prompts' token ids; synthetic ones are seeded and uniform over the vocabulary."""
        if self.prompt_ids is not None and self.num_requests is not None:
            raise BadInputError("give --prompt-ids or --num-requests, not both")
        if self.prompt_ids is not None:
            return parse_prompt_ids(self.prompt_ids)
        if self.num_requests is None:
            raise BadInputError(
                "nothing to generate: give --prompt-ids or --num-requests (synthetic prompts)"
            )
        length = self.prompt_len
        if length >= max_model_len:
            raise BadInputError(
                f"--prompt-len {length} leaves no room to generate under "
                f"max_model_len={max_model_len}"
            )
        rng = random.Random(self.seed)
        return [
            [rng.randrange(vocab_size) for _ in range(length)] for _ in range(self.num_requests)
        ]

    def prompt_lengths(self) -> list[int]:
        """The prompts' lengths, known before the model loads (synthetic prompts need the
        vocabulary only for their ids). Empty when the flags do not name prompts; the error
        for that comes from ``prompts``."""
        if self.prompt_ids is not None and self.num_requests is None:
            return [len(p) for p in parse_prompt_ids(self.prompt_ids)]
        if self.num_requests is not None and self.prompt_ids is None:
            return [self.prompt_len] * self.num_requests
        return []


def parse_prompt_ids(value: str) -> list[list[int]]:
    """Prompts from a comma list (';' between prompts) or a .json / .jsonl file of id lists."""
    path = Path(value)
    if path.suffix in (".json", ".jsonl"):
        text = read_text(path, what="--prompt-ids file", max_bytes=MAX_JSON_BYTES)
        if path.suffix == ".jsonl":
            prompts = [
                loads_json(line, what="--prompt-ids file", path=f"{path}:{number}")
                for number, line in enumerate(text.splitlines(), 1)
                if line.strip()
            ]
        else:
            prompts = loads_json(text, what="--prompt-ids file", path=path)
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]  # a single id list
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompts
        ):
            raise BadInputError(f"--prompt-ids file {path} must hold lists of integer token ids")
        return prompts
    if len(value) > MAX_TEXT_BYTES:
        raise BadInputError("--prompt-ids is too long; put the prompts in a .json/.jsonl file")
    try:
        return [[int(t) for t in part.split(",") if t.strip()] for part in value.split(";")]
    except ValueError as exc:
        raise BadInputError(
            f"--prompt-ids {value!r} is neither a comma list of ids nor a .json/.jsonl file"
        ) from exc


@dataclass(frozen=True)
class WorkloadSizing:
    """The engine settings a run uses for its pool's size, and the one line saying why."""

    config: EngineConfig
    #: None when the flags decided (an explicit budget or --max-model-len)
    note: str | None


def size_for_workload(config: EngineConfig, workload: Workload, directory: Path) -> WorkloadSizing:
    """With no --num-blocks, --kv-memory or --max-model-len, the pool holds what this run's
    prompts and --max-tokens need: max_model_len is the longest prompt plus --max-tokens and
    at most one request per prompt runs at once, instead of --max-num-seqs requests of the
    model's full context (a 4-layer Jamba: 128 x 262,144 tokens, 2.35 GiB zeroed to serve
    three short prompts)."""
    as_given = WorkloadSizing(config, None)
    if any(
        v is not None for v in (config.num_blocks, config.kv_memory_bytes, config.max_model_len)
    ):
        return as_given
    lengths = workload.prompt_lengths()
    if not lengths:
        return as_given
    longest = max(lengths)
    need = longest + workload.max_tokens
    limit = _position_limit(directory)
    # never past the model's positions: a prompt that leaves no room there stays an error
    max_model_len = need if limit is None else min(need, limit)
    max_num_seqs = min(config.max_num_seqs, len(lengths))
    capped = "" if max_model_len == need else f", capped at the model's {limit} positions"
    note = (
        f"sized for this run: {len(lengths)} prompt(s), the longest {longest} tokens + "
        f"--max-tokens {workload.max_tokens} = max_model_len {max_model_len}{capped} "
        "(--max-model-len, --kv-memory or --num-blocks size it otherwise)"
    )
    sized = replace(config, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    return WorkloadSizing(sized, note)


def _position_limit(directory: Path) -> int | None:
    """The decoder's position count from DIR's config.json (its text_config for a
    vision-language model), when it names one."""
    from kvskill.analyzer.config import text_config
    from kvskill.analyzer.config_keys import lookup
    from kvskill.core.inputs import read_config_json

    path = directory / "config.json"
    if not path.is_file():
        return None
    decoder, _ = text_config(read_config_json(path, root=directory))
    value, _ = lookup(decoder, "max_positions")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None

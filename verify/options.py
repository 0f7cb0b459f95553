"""What ``kvskill verify`` was asked: what to check, on which prompts, in which dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvskill.verify.verdict import DRIFT_RATIO


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    #: True: a shrunk random-weight twin; False: the full config (the directory's weights
    #: when it has some); None: the real weights when present and they fit, else the twin
    shrink: bool | None = None
    num_prompts: int = 4
    max_new_tokens: int = 8
    atol: float | None = None
    #: relative logit tolerance (of the largest reference logit); None: LOGIT_RTOL
    rtol: float | None = None
    block_size: int | None = None
    dtype: str = "float32"
    seed: int = 0
    trust_remote_code: bool = False
    #: the runtime's cache layout for the converted model: "contiguous" (one dense tensor per
    #: cache) or "page_pool" (one pool of pages, strided views; references/
    #: noncontiguous_kv_reference.md)
    kv_layout: str = "contiguous"
    #: prompts, one per line (token ids, or text with a local tokenizer); None: generated
    prompts_file: Path | None = None
    #: float16 / bfloat16: the conversion's drift may be this many times the original's
    drift_ratio: float = DRIFT_RATIO
    #: tensor-parallel ranks the converted model runs on (None: the size it was converted
    #: for); the reference is always one process
    tensor_parallel_size: int | None = None
    tp_backend: str = "auto"
    #: skip the NPU profile (tiny blocks; the report says the NPU limits were not checked);
    #: None: KVSKILL_CPU_ONLY_SHAPES decides (off unless it is set)
    cpu_only_shapes: bool | None = None
    #: run the converted model's decode steps as captured graphs (``LLM(graph=True)``)
    graph: bool = False

"""``EngineConfig``: every setting of an ``LLM``, in one frozen record with its defaults.

``LLM(model, config)`` reads only this record (plus the step hooks, which are callables, not
settings); ``kvskill run`` builds one from its flags and prints the fields that differ from
the defaults; the benchmarks build one per system they time. The defaults below are the only
ones: a flag of ``run`` that mirrors a field defaults to the field's value
(``tests/skill/test_run_config.py`` holds them equal).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from kvskill.core.errors import BadInputError
from kvskill.core.kv_blocks import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

if TYPE_CHECKING:
    import torch
    from kvskill.runtime.ops.reference.npu_profile import NpuProfile

#: the fast paths (``runtime/fast_paths.py``) and captured decode: each changes what one process computes, so
#: tensor-parallel ranks would combine results computed two different ways, and each sums in
#: another order than the model's own code, so none runs in an exact run
_ONE_PROCESS_ONLY = ("prepack_linear", "fuse_layers", "screen_output_head", "graph")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an ``LLM`` loads its model, sizes its KV pools, schedules and computes.

    Examples::

        LLM("converted/", EngineConfig(random_weights=True, num_blocks=64, block_size=128))
        LLM("converted/", random_weights=True, num_blocks=64)  # the same, field by field
    """

    # ---- the model ----------------------------------------------------------------------
    #: compute dtype of the weights and activations ("float32", "float16", "bfloat16" or a
    #: torch.dtype); default "float32". Ignored for an already-built module.
    dtype: str | torch.dtype = "float32"
    #: device to load onto ("cpu", "cuda:N", "npu:N"); default None = NPU, else CUDA, else CPU
    device: str | torch.device | None = None
    #: seed of random weights and of sampling; default 0
    seed: int = 0
    #: initialise random weights when the directory holds none; default False
    random_weights: bool = False
    #: allow importing the directory's own Python files; default False
    trust_remote_code: bool = False
    #: EOS token id(s) that end a request; default None = generation_config.json, then config
    eos_token_id: int | tuple[int, ...] | None = None

    # ---- the KV pools -------------------------------------------------------------------
    #: tokens per KV block; default None = what the model's cache entries declare
    block_size: int | None = None
    #: blocks of EACH cache group, null block included; default None = sized by budget
    num_blocks: int | None = None
    #: KV memory budget in bytes shared by the cache groups (not with num_blocks); default
    #: None = what max_num_seqs requests of max_model_len tokens need, capped
    kv_memory_bytes: int | None = None
    #: one page pool cut into strided views per layer instead of one dense tensor per cache
    #: entry (``--kv-layout page_pool``); default False
    use_hybrid_blocks: bool = False
    #: log every cache view built (``[non-contiguous-kv-cache]`` lines); default False
    log_layout: bool = False
    #: shuffle the free-block queue with this seed (tests addressing by block id); default
    #: None = ascending order
    free_block_order_seed: int | None = None
    #: reuse the KV of full prompt blocks already computed; default True (off by itself for
    #: models with state layers)
    enable_prefix_caching: bool = True

    # ---- the scheduler ------------------------------------------------------------------
    #: tokens per request at most; default None = the model's positions, capped by the pool
    max_model_len: int | None = None
    #: tokens computed per step at most; default 2048
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    #: requests running at once at most; default 128
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    #: split prompts longer than max_num_batched_tokens over several steps; default True
    enable_chunked_prefill: bool = True
    #: let a prefill step also feed decoding requests their next token; default True
    mix_decode_with_prefill: bool = True

    # ---- the process and its kernels ----------------------------------------------------
    #: tensor-parallel ranks (processes) the model is split over; default 1
    tensor_parallel_size: int = 1
    #: torch.distributed backend of the ranks ("auto", "gloo", "hccl", "nccl"); default "auto"
    tp_backend: str = "auto"
    #: the model's own code bit for bit, every fast path below off (``--exact``; verify's
    #: runs); default False
    exact: bool = False
    #: run fp32 CPU linear layers through oneDNN with prepacked weights; default None = on
    #: where this machine and model allow it (off in an exact run), False off, True required
    prepack_linear: bool | None = None
    #: run fp32 RMSNorm / gated MLP / rope through one-pass CPU kernels; default None, as
    #: prepack_linear
    fuse_layers: bool | None = None
    #: find greedy tokens from a bf16 pass over the output head first; default None, as
    #: prepack_linear (needs a CPU with native bf16)
    screen_output_head: bool | None = None
    #: run decode steps as a graph captured once per batch bucket (torch.compile); default False
    graph: bool = False
    #: move the pre-model heap out of the garbage collector's sight (once per process);
    #: default True
    freeze_startup_heap: bool = True

    # ---- the NPU limits checked on every step -------------------------------------------
    #: skip the NPU shape/dim/dtype limits; default None = KVSKILL_CPU_ONLY_SHAPES decides
    cpu_only_shapes: bool | None = None
    #: an exact profile instead of the one cpu_only_shapes and dtype give; default None
    npu_profile: NpuProfile | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in _ONE_PROCESS_ONLY:
            if getattr(self, name) is not True:
                continue
            if self.exact:
                raise BadInputError(
                    f"{name}=True is a fast path, not bit-exact; it cannot be combined with "
                    "exact=True (--exact)"
                )
            if self.tensor_parallel_size != 1:
                raise BadInputError(
                    f"{name} runs in one process; it cannot be combined with "
                    f"tensor_parallel_size={self.tensor_parallel_size}"
                )

    @property
    def dtype_name(self) -> str:
        """The dtype as its name without ``torch.`` ("float32")."""
        return str(self.dtype).removeprefix("torch.")

    def to_dict(self) -> dict[str, Any]:
        """Every field as a JSON value (dtypes and devices as their names)."""
        return {f.name: _json_value(getattr(self, f.name)) for f in fields(self)}


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value).removeprefix("torch.")

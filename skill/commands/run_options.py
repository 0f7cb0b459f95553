"""``kvskill run``'s flags that set ``EngineConfig`` fields (the KV pool, the scheduler, the
device and the CPU kernels), each defined once; ``run.engine_config_from_options`` reads them."""

from __future__ import annotations

import click
from kvskill.core.kv_blocks import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

num_blocks_option = click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=None,
    help="KV blocks of EACH cache group (null block included); instead of --kv-memory.",
)

kv_memory_option = click.option(
    "--kv-memory",
    default=None,
    help="KV memory budget shared by the cache groups, e.g. '512M' or '2GiB' (K/M/G and "
    "KiB/MiB/GiB are powers of 1024, KB/MB/GB powers of 1000). Default: what --max-num-seqs "
    "requests of --max-model-len tokens need, capped at 10% of the device's total memory and "
    "at 4 GiB (the same on every run).",
)

max_model_len_option = click.option(
    "--max-model-len", type=click.IntRange(min=2), default=None, help="Tokens per request at most."
)

max_num_batched_tokens_option = click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
    show_default=True,
    help="Tokens per step at most (longer prompts are chunked).",
)

max_num_seqs_option = click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=DEFAULT_MAX_NUM_SEQS, show_default=True
)

prefix_caching_option = click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV of full blocks of prompt prefixes already computed (shared by "
    "requests, evicted least recently used). Off by itself for models with state layers.",
)

exact_option = click.option(
    "--exact",
    is_flag=True,
    help="Run the model's own code bit for bit: every fast path below off (what verify runs). "
    "Without it, each fast path runs where this machine and model allow it and the report "
    "says why any did not.",
)

#: NOTE: the fast paths' flags default to None ("auto": on where they can run, off with the
#: reason where not, off with --exact or --tp); the flag requires one, --no-... turns it off
prepack_linear_option = click.option(
    "--prepack-linear/--no-prepack-linear",
    default=None,
    help="Run fp32 linear layers on the CPU through oneDNN with weights reordered once (q/k/v "
    "and gate/up as one weight each): about 2x faster than MKL on the CPUs measured, not "
    "bit-exact against it. Default: on where it can run, except with --exact or --tp.",
)

fuse_layers_option = click.option(
    "--fuse-layers/--no-fuse-layers",
    default=None,
    help="Run fp32 RMSNorm and gated-MLP (SiLU x up) modules and the rotary embedding on the "
    "CPU through one-pass compiled kernels, each only if it agrees with the model's own code "
    "on a probe input; within fp32 rounding, not bit-exact. Default: on where it can run, "
    "except with --exact or --tp.",
)

screen_output_head_option = click.option(
    "--screen-output-head/--no-screen-output-head",
    default=None,
    help="On greedy steps, read the fp32 output head in bf16 first (oneDNN, CPUs with "
    "AVX512-BF16 or AMX) and compute fp32 logits only for the tokens a proven rounding bound "
    "cannot rule out: each token is the exact argmax of fp32 dot products, in another "
    "summation order than the plain head, so not bit-exact. Default: on where the CPU has "
    "native bf16, except with --exact or --tp.",
)

graph_option = click.option(
    "--graph",
    is_flag=True,
    help="Run decode steps as a graph captured once per batch bucket (torch.compile, "
    "fullgraph; inductor on the CPU, torchair's backend with torch_npu), the batch padded to "
    "the bucket. The first step of each bucket compiles (tens of seconds on a CPU). The fast "
    "paths run inside the graph. One process only (not with --tp).",
)

speculative_tokens_option = click.option(
    "--speculative-tokens",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Speculative decoding: tokens the model's MTP layers draft per decode step, "
    "verified in one forward (0 off; drafts after the first reuse the one MTP layer). Exit 2 "
    "when the model has none.",
)

device_option = click.option(
    "--device", default="auto", show_default=True, help="auto, cpu, cuda[:N] or npu[:N]."
)

random_weights_option = click.option(
    "--random-weights", is_flag=True, help="Initialise random weights when DIR has none."
)

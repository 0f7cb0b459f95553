"""Split a converted model across tensor-parallel ranks by wrapping its modules in place.

The split is read from the model's structure, not from per-family code: the attention
modules are the ones that declare ``cache_entries`` (every converted attention does), their
projections are told apart by their ``nn.Linear`` shapes (per-head widths times the head
count), dense MLPs are modules whose Linear children map hidden -> I and I -> hidden, and
fused experts are 3-D parameters ``[E, k*I, hidden]`` / ``[E, hidden, I]``.

- attention: q/k/v column parallel by heads (rank r keeps heads ``[r*N/tp, (r+1)*N/tp)``),
  one fused q/k/v Linear by the row order its converted class declares (``fused_qkv.py``),
  the output projection row parallel, its output summed over ranks (all-reduce). When
  ``tp > num_kv_heads`` every rank keeps ONE KV head, ``r * num_kv_heads // tp`` (the KV
  heads are replicated ``tp // num_kv_heads`` times), so caches hold
  ``max(num_kv_heads // tp, 1)`` heads per rank (seed 003).
- MLA: query heads split (q_proj / q_b_proj, kv_b_proj, o_proj by heads), the latent and
  rope projections replicated, so each rank caches the whole latent (num_head 1).
- dense MLP: in-projections column parallel, out-projection row parallel + all-reduce.
- MoE: TENSOR parallel experts: every rank keeps every expert with 1/tp of its intermediate
  width; the router stays replicated, so routing is identical on every rank and the block's
  output is one all-reduce (shared experts included). Expert parallelism (E/tp whole experts
  per rank) would need a rewritten dispatch per expert implementation and balances badly at
  small batch; the tensor split keeps each family's own expert code untouched.
- embeddings, norms, router and LM head: replicated (exact logits on every rank, sampling
  stays on rank 0 with no gather).

Biases of row-parallel layers are kept on rank 0 only (zeroed elsewhere) so the sum adds
them once. Parameter names never change: a checkpoint maps 1:1 onto the sharded model and
``ShardPlan.slices`` says which part of each tensor a rank reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvskill.core.errors import BadInputError, UnsupportedModelError
from kvskill.runtime.distributed.fused_qkv import FusedQkvShape, fused_qkv_rows
from torch import Tensor, nn

#: cache entries of these attn types hold recurrent state, not per-head K/V
_STATE_TYPES = {"Mamba", "GatedDeltaNet", "LinearAttention"}


@dataclass(frozen=True, slots=True)
class Slice:
    """The part of one checkpoint tensor a rank keeps: index ranges along ``dim``
    (several ranges for a fused gate/up projection), or the whole tensor zeroed."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False

    def take(self, tensor: Tensor) -> Tensor:
        if self.zero:
            return torch.zeros_like(tensor)
        if not self.ranges:
            return tensor
        parts = [tensor.narrow(self.dim, start, stop - start) for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


@dataclass(slots=True)
class ShardPlan:
    """What this rank keeps: per parameter name its slice (absent = replicated whole)."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    #: parameter name -> slice
    slices: dict[str, Slice] = field(default_factory=dict)
    #: module names whose output is summed over ranks
    reduced: list[str] = field(default_factory=list)
    #: attention module names and the role each of their projections got
    attention_roles: dict[str, dict[str, str]] = field(default_factory=dict)
    #: dense MLPs (shared experts included) and fused expert modules split by width
    mlps: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    #: MoE blocks (modules with an ``experts`` child) summed over ranks as a whole
    moe_blocks: list[str] = field(default_factory=list)
    kv_heads_per_rank: int = 1
    mla: bool = False

    def summary(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "heads_per_rank": self.num_heads // self.world_size,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "kv_replicated": (not self.mla) and self.world_size > self.num_kv_heads,
            "mla_latent_replicated": self.mla,
            "sharded_tensors": len(self.slices),
            "mlps_split": len(self.mlps),
            "expert_modules_split": len(self.experts),
            "moe_blocks": len(self.moe_blocks),
            "all_reduces_per_forward": len(self.reduced),
        }


def check_tp_size(num_heads: int, num_kv_heads: int, tp: int, *, mla: bool) -> None:
    """The one-line refusals of a split that cannot be made (exit 2)."""
    if tp < 1:
        raise BadInputError(f"tensor parallel size must be >= 1, got {tp}")
    if num_heads % tp:
        raise BadInputError(
            f"{num_heads} attention heads do not divide by tensor parallel size {tp}; "
            f"use a size that divides {num_heads}"
        )
    if mla or tp == 1:
        return
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise BadInputError(
            f"{num_kv_heads} KV heads do not divide by tensor parallel size {tp}; use a size "
            f"that divides {num_kv_heads} or a multiple of it"
        )
    if tp > num_kv_heads and tp % num_kv_heads:
        raise BadInputError(
            f"tensor parallel size {tp} exceeds the {num_kv_heads} KV heads and is not a "
            f"multiple of them, so KV heads cannot be replicated evenly; use a divisor or a "
            f"multiple of {num_kv_heads}"
        )


def _head_ranges(rank: int, tp: int, heads: int, width: int) -> tuple[tuple[int, int], ...]:
    """Rows of a [heads * width, ...] projection kept by RANK (heads split, or replicated
    one per rank when tp > heads)."""
    if tp <= heads:
        per = heads // tp
        return ((rank * per * width, (rank + 1) * per * width),)
    head = rank * heads // tp
    return ((head * width, (head + 1) * width),)


def _even(rank: int, tp: int, size: int, what: str) -> tuple[int, int]:
    if size % tp:
        raise BadInputError(f"{what} of {size} does not divide by tensor parallel size {tp}")
    per = size // tp
    return rank * per, (rank + 1) * per


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def plan_shards(model: nn.Module, rank: int, tp: int) -> ShardPlan:
    """Decide, from the model's structure, what RANK of TP keeps. Changes nothing."""
    config = text_config(model.config)
    hidden = int(config.hidden_size)
    num_heads = int(config.num_attention_heads)
    num_kv = int(getattr(config, "num_key_value_heads", None) or num_heads)
    mla = getattr(config, "kv_lora_rank", None) is not None
    check_tp_size(num_heads, num_kv, tp, mla=mla)
    plan = ShardPlan(rank=rank, world_size=tp, num_heads=num_heads, num_kv_heads=num_kv, mla=mla)
    plan.kv_heads_per_rank = 1 if mla else max(num_kv // tp, 1)
    modules = dict(model.named_modules())
    attention = [name for name, m in modules.items() if hasattr(m, "cache_entries")]
    for name in attention:
        _check_attention_kind(name, modules[name])
        _plan_attention(plan, name, modules[name], config, hidden)
    inside_attention = tuple(f"{name}." for name in attention)
    moe_blocks = {name for name, m in modules.items() if "experts" in dict(m.named_children())}
    for name, module in modules.items():
        if name in attention or name.startswith(inside_attention):
            continue
        if _plan_mlp(plan, name, module, hidden):
            plan.mlps.append(name)
        elif _plan_fused_experts(plan, name, module, hidden):
            plan.experts.append(name)
        else:
            continue
        block = _enclosing(name, moe_blocks)
        target = block if block is not None else name
        if target not in plan.reduced:
            plan.reduced.append(target)
            if block is not None:
                plan.moe_blocks.append(block)
    for block in plan.moe_blocks:
        _check_experts_split(plan, block, modules)
    return plan


def _check_experts_split(plan: ShardPlan, block: str, modules: dict[str, nn.Module]) -> None:
    """A block summed over ranks must have ALL its experts split, or the replicated ones
    would be counted once per rank."""
    experts = f"{block}.experts"
    split = set(plan.mlps) | set(plan.experts)
    children = [f"{experts}.{n}" for n, _ in modules[experts].named_children()]
    if experts in split or (children and all(c in split for c in children)):
        return
    raise UnsupportedModelError(
        f"{experts}: the experts' layout ({type(modules[experts]).__name__}) is not one "
        "tensor parallelism recognises (3-D [E, k*I, hidden] / [E, hidden, I] tensors or one "
        "MLP per expert); run with --tp 1"
    )


def _check_attention_kind(name: str, module: nn.Module) -> None:
    for entry in module.cache_entries:
        if str(entry.attn_type) in _STATE_TYPES or type(entry).__name__ == "MambaCacheEntry":
            raise UnsupportedModelError(
                f"{name} keeps a recurrent state ({entry.attn_type}); tensor parallelism "
                "splits attention, MLP and MoE layers only, run state-layer models with --tp 1"
            )


def _enclosing(name: str, blocks: set[str]) -> str | None:
    """The nearest MoE block (a module with an ``experts`` child) containing NAME."""
    best = None
    for block in blocks:
        inside = name == block or name.startswith(f"{block}.")
        if inside and (best is None or len(block) > len(best)):
            best = block
    return best


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear)]


def _plan_attention(plan: ShardPlan, name: str, module: nn.Module, config, hidden: int) -> None:
    tp, rank = plan.world_size, plan.rank
    heads, kv = plan.num_heads, plan.num_kv_heads
    head_dim = int(
        getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or hidden // heads
    )
    widths = {head_dim}
    if plan.mla:
        nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        widths = {nope + rope, nope + int(config.v_head_dim)}
    linears = _linears(module)
    # the output projection: the last Linear back to the hidden size from a per-head input
    out_name = None
    for child, linear in linears:
        if linear.out_features == hidden and linear.in_features % heads == 0:
            out_name = child
    if out_name is None:
        raise UnsupportedModelError(
            f"{name}: no output projection (a Linear from heads * head_dim to the hidden "
            "size) found, so the attention cannot be split across ranks"
        )
    roles: dict[str, str] = {}
    for child, linear in linears:
        prefix = f"{name}.{child}"
        if child == out_name:
            per_head = linear.in_features // heads
            plan.slices[f"{prefix}.weight"] = Slice(1, _head_ranges(rank, tp, heads, per_head))
            if linear.bias is not None and rank != 0:
                plan.slices[f"{prefix}.bias"] = Slice(0, (), zero=True)
            plan.reduced.append(prefix)
            roles[child] = "row"
            continue
        out = linear.out_features
        fused_kv = _fused_kv_heads(out, heads=heads, head_dim=head_dim, config=config)
        if not plan.mla and fused_kv is not None:
            if fused_kv != kv:
                raise UnsupportedModelError(
                    f"{name}.{child}: the fused q/k/v rows hold {fused_kv} KV heads but the "
                    f"config gives {kv}; the per-rank caches would be sized wrong, run with --tp 1"
                )
            layout = (getattr(module, "fused_qkv_layout", None) or {}).get(child)
            shape = FusedQkvShape(heads=heads, kv_heads=fused_kv, head_dim=head_dim)
            ranges = fused_qkv_rows(layout, shape, rank=rank, tp=tp, name=f"{name}.{child}")
            plan.slices[f"{prefix}.weight"] = Slice(0, ranges)
            if linear.bias is not None:
                plan.slices[f"{prefix}.bias"] = Slice(0, ranges)
            roles[child] = f"column(fused qkv, {layout})"
            continue
        if out % heads == 0 and out // heads in widths:
            ranges, role = _head_ranges(rank, tp, heads, out // heads), "column(q heads)"
        elif not plan.mla and out == kv * head_dim:
            ranges, role = _head_ranges(rank, tp, kv, head_dim), "column(kv heads)"
        else:
            roles[child] = "replicated"
            continue
        plan.slices[f"{prefix}.weight"] = Slice(0, ranges)
        if linear.bias is not None:
            plan.slices[f"{prefix}.bias"] = Slice(0, ranges)
        roles[child] = role
    if plan.mla and "column(q heads)" not in roles.values():
        raise UnsupportedModelError(f"{name}: no per-head query projection found to split")
    plan.attention_roles[name] = roles


def _fused_kv_heads(rows: int, *, heads: int, head_dim: int, config) -> int | None:
    """K when ROWS is ``(heads + 2K) x head_dim``: a query/key/value projection in one
    Linear. K is the config's ``num_key_value_heads`` when it has one; without it (MHA
    configs, or a vendor key the config class does not map, ChatGLM's
    ``multi_query_group_num``) any 1 <= K <= heads, read from the rows."""
    named = getattr(config, "num_key_value_heads", None)
    if named:
        return int(named) if rows == (heads + 2 * int(named)) * head_dim else None
    extra = rows - heads * head_dim
    if extra <= 0 or extra % (2 * head_dim):
        return None
    kv = extra // (2 * head_dim)
    return kv if kv <= heads else None


def _plan_mlp(plan: ShardPlan, name: str, module: nn.Module, hidden: int) -> bool:
    """A module with one Linear I -> hidden and Linears hidden -> I (or 2I, fused gate/up)."""
    linears = _linears(module)
    outs = [
        (n, lin) for n, lin in linears if lin.out_features == hidden and lin.in_features != hidden
    ]
    if len(outs) != 1:
        return False
    out_name, out = outs[0]
    inter = out.in_features
    ins = [
        (n, lin)
        for n, lin in linears
        if lin.in_features == hidden and lin.out_features in (inter, 2 * inter)
    ]
    if not ins:
        return False
    tp, rank = plan.world_size, plan.rank
    start, stop = _even(rank, tp, inter, f"{name}: intermediate size")
    for child, linear in ins:
        halves = linear.out_features // inter
        ranges = tuple((h * inter + start, h * inter + stop) for h in range(halves))
        plan.slices[f"{name}.{child}.weight"] = Slice(0, ranges)
        if linear.bias is not None:
            plan.slices[f"{name}.{child}.bias"] = Slice(0, ranges)
    plan.slices[f"{name}.{out_name}.weight"] = Slice(1, ((start, stop),))
    if out.bias is not None and rank != 0:
        plan.slices[f"{name}.{out_name}.bias"] = Slice(0, (), zero=True)
    return True


def _plan_fused_experts(plan: ShardPlan, name: str, module: nn.Module, hidden: int) -> bool:
    """Experts stored as 3-D parameters: up [E, k*I, hidden] and down [E, hidden, I]."""
    params = dict(module.named_parameters(recurse=False))
    down, ups, inter = None, [], 0
    # the down projection [E, hidden, I] is the one some up projection [E, k*I, hidden] feeds
    # (shapes alone: with 2*I == hidden both 3-D tensors have hidden in dim 1)
    for candidate, p in params.items():
        if p.dim() != 3 or p.shape[1] != hidden:
            continue
        width = p.shape[2]
        found = [
            n
            for n, q in params.items()
            if q.dim() == 3
            and n != candidate
            and q.shape[2] == hidden
            and q.shape[1] in (width, 2 * width)
        ]
        if found:
            down, ups, inter = candidate, found, width
            break
    if down is None:
        return False
    tp, rank = plan.world_size, plan.rank
    start, stop = _even(rank, tp, inter, f"{name}: expert intermediate size")
    for up in ups:
        halves = params[up].shape[1] // inter
        ranges = tuple((h * inter + start, h * inter + stop) for h in range(halves))
        plan.slices[f"{name}.{up}"] = Slice(1, ranges)
        bias = params.get(f"{up}_bias")
        if bias is not None:
            plan.slices[f"{name}.{up}_bias"] = Slice(1, ranges)
    plan.slices[f"{name}.{down}"] = Slice(2, ((start, stop),))
    if params.get(f"{down}_bias") is not None and rank != 0:
        plan.slices[f"{name}.{down}_bias"] = Slice(0, (), zero=True)
    return True


def apply_shards(
    model: nn.Module,
    plan: ShardPlan,
    all_reduce: Callable[[Tensor], Tensor],
) -> None:
    """Cut every parameter to this rank's slice (its values, or its shape for weights read
    from a checkpoint afterwards), hook the all-reduces and set the attention's
    per-rank head counts and cache declarations."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, spec in plan.slices.items():
        owner_name, _, attr = name.rpartition(".")
        owner = modules[owner_name]
        old = params[name]
        with torch.no_grad():
            # own storage: a narrowed view would keep the whole tensor alive
            value = spec.take(old.detach()).clone()
        setattr(owner, attr, nn.Parameter(value.contiguous(), requires_grad=False))
        if isinstance(owner, nn.Linear):
            owner.out_features, owner.in_features = owner.weight.shape
    for experts_name in {n.rpartition(".")[0] for n in plan.slices}:
        experts = modules[experts_name]
        for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
            if isinstance(getattr(experts, attr, None), int) and not isinstance(experts, nn.Linear):
                setattr(experts, attr, getattr(experts, attr) // plan.world_size)
    for name in plan.reduced:
        modules[name].register_forward_hook(_reduce_hook(all_reduce))
    for name in plan.attention_roles:
        _set_attention_heads(modules[name], plan)


def _reduce_hook(all_reduce: Callable[[Tensor], Tensor]):
    def hook(module, args, output):
        if isinstance(output, Tensor):
            return all_reduce(output)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (all_reduce(output[0]), *output[1:])
        raise UnsupportedModelError(
            f"{type(module).__name__} returns {type(output).__name__}; expected a tensor to sum "
            "over tensor-parallel ranks"
        )

    return hook


def _set_attention_heads(module: nn.Module, plan: ShardPlan) -> None:
    """The converted attention's per-rank counts (read by its forward and its cache entries)."""
    tp = plan.world_size
    heads = plan.num_heads // tp
    kv = plan.kv_heads_per_rank
    module.attn_tp_size = tp
    module.num_heads_per_rank = heads
    module.num_key_value_heads_per_rank = kv
    if not plan.mla:
        for entry in module.cache_entries:  # K/V entries: this rank's heads only
            entry.num_head = kv
    # names the source forward may reshape by (transformers 4 code uses them in views)
    for attr, value in (
        ("num_heads", heads),
        ("num_attention_heads", heads),
        ("num_key_value_heads", None if plan.mla else kv),
        ("num_key_value_groups", None if plan.mla else heads // kv),
    ):
        if value is not None and isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)
    # transformers 4 vendor code reshapes the attention output by the attention's width
    # (``reshape(bsz, q_len, self.hidden_size)``) and GPT-2-style code splits a contiguous
    # fused projection by it (``c_attn(x).split(self.split_size)``): on a rank that width
    # is its own heads' only
    head_dim = getattr(module, "head_dim", None)
    if plan.mla or not isinstance(head_dim, int):
        return
    for attr in ("hidden_size", "split_size"):
        if getattr(module, attr, None) == plan.num_heads * head_dim:
            setattr(module, attr, heads * head_dim)

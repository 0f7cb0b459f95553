"""Render a Plan as a table, JSON, YAML or a Markdown section; update a progress file."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import yaml
from kvskill.analyzer.compressed_attention import entry_text
from kvskill.analyzer.plan import Plan
from kvskill.core.errors import BadInputError
from kvskill.core.inputs import read_text

PROGRESS_HEADING = "## KVCache selection"


def render(plan: Plan, output_format: str) -> str:
    renderers = {"json": to_json, "yaml": to_yaml, "md": to_markdown, "table": to_table}
    return renderers[output_format](plan)


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2)


def to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, allow_unicode=True)


def _human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return str(value)


def memory_line(memory: dict) -> str:
    """The budget's block counts as ``kvskill run`` allocates them, and what it pays for.

    Counts are usable blocks, as run's ``KV <group> blocks`` lines show them; each pool also
    holds the null block (the plan's ``num_blocks_by_group`` counts it, as ``--num-blocks``
    does).
    """
    by_group = memory.get("num_blocks_by_group", {})
    reserved = memory.get("reserved_groups", [])
    unit = " request rows" if "legacy_row_tokens" in memory else " blocks"
    growing = [
        f"{key} {_usable(n):,}{unit} + the null block"
        for key, n in by_group.items()
        if key not in reserved
    ]
    tokens = memory.get("max_tokens")
    line = (
        f"{_human_bytes(memory['kv_memory_bytes'])} for KV at {memory['dtype']}, block_size "
        f"{memory['block_size']}, {memory.get('layout', 'contiguous')} layout: "
        + (", ".join(growing) or "no growing group")
        + ", max tokens "
        + (f"{tokens:,}" if tokens is not None else "unbounded (window/state only)")
    )
    seqs = memory.get("max_num_seqs")
    paid = [_reserved_words(key, by_group[key], seqs) for key in reserved]
    if paid:
        line += f"; paid first: {'; '.join(paid)}"
    if not memory.get("budget_fits", True):
        line += " -- the budget does not cover that: run refuses it"
    if seqs is not None:
        line += (
            f"; sized with run's defaults max_num_seqs {seqs}, max_num_batched_tokens "
            f"{memory['max_num_batched_tokens']}"
        )
    flag = "" if memory["dtype"] == "float32" else f" --dtype {memory['dtype']}"
    return line + f"; `kvskill run{flag}` with this --kv-memory allocates these"


def _reserved_words(key: str, num_blocks: int, max_num_seqs: int) -> str:
    """``Mamba 128 blocks + the null block (128 requests x 1 state row)``."""
    per_request = _usable(num_blocks) // max(max_num_seqs, 1)
    what = "state row" if key == "Mamba" else "window blocks"
    return (
        f"{key} {_usable(num_blocks):,} blocks + the null block ({max_num_seqs} requests x "
        f"{per_request} {what})"
    )


def _usable(num_blocks: int) -> int:
    """Blocks a pool hands out: all but block 0, the null block (what run reports)."""
    return max(num_blocks - 1, 0)


def _layers_line(plan: Plan) -> str:
    counts: dict[str, int] = {}
    indexed: dict[str, int] = {}
    owners = set(plan.indexer.layers) if plan.indexer and plan.indexer.dense_layers else set()
    for layer in plan.layers:
        counts[layer.attn_type] = counts.get(layer.attn_type, 0) + 1
        if layer.index in owners:
            indexed[layer.attn_type] = indexed.get(layer.attn_type, 0) + 1
    # when only some layers run the DSA indexer, say how many of each attn_type do
    parts = ", ".join(
        f"{t} x{n}" + (f" ({indexed[t]} DSA-indexed)" if t in indexed else "")
        for t, n in counts.items()
    )
    window = next((layer.sliding_window for layer in plan.layers if layer.sliding_window), None)
    return parts + (f" (window {window})" if window else "")


def _entries_line(plan: Plan) -> list[str]:
    lines = []
    for attn_type, entries in plan.cache_entries.items():
        desc = ", ".join(f"{e.cache_name} {e.num_head}x{e.dim} {e.dtype}" for e in entries)
        lines.append(f"{attn_type}: {desc or '(state sizes unknown)'}")
    return lines


def summary_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, value) rows shared by the table and the Markdown section."""
    heads = (
        f"{plan.num_attention_heads} heads, {plan.num_key_value_heads} KV heads, "
        f"{plan.num_key_value_heads_per_rank} per rank at attn_tp_size={plan.attn_tp_size}"
    )
    modes = "; ".join(
        f"{t} prefill {m.prefill} / decode {m.decode}" for t, m in plan.sparse_mode.items()
    )
    windows = "; ".join(
        f"{t} pre_tokens {w.pre_tokens} next_tokens {w.next_tokens}"
        for t, w in plan.window_tokens.items()
    )
    kv_mode = plan.kv_mode + (f" (blocker: {plan.legacy_reason})" if plan.legacy_reason else "")
    rows = [
        ("deploy mode", plan.deploy_mode),
        ("KV mode", kv_mode),
        ("attention", f"{plan.attention.upper()}: {heads}"),
        ("layers", f"{len({layer.index for layer in plan.layers})}: {_layers_line(plan)}"),
        ("attn types", ", ".join(plan.attn_types) + (" (mixed)" if plan.mixed_attn_types else "")),
        ("FA version", f"{plan.fa_version}: {plan.fa_version_reason}"),
        ("input layout", f"{plan.input_layout}, MLA absorb {'on' if plan.mla_absorb else 'off'}"),
        ("sparse_mode", modes or "- (Legacy: SDPA)"),
        ("window tokens", windows or "-"),
        ("softmax scale", f"{plan.softmax_scale:.8g}"),
        ("cache entries", " | ".join(_entries_line(plan))),
        ("KV bytes/token", f"{plan.kv_bytes_per_token} ({_human_bytes(plan.kv_bytes_per_token)})"),
    ]
    if plan.indexer is not None:
        index = plan.indexer
        rows.insert(
            rows.index(("softmax scale", f"{plan.softmax_scale:.8g}")) + 1,
            (
                "DSA indexer",
                f"{index.n_heads} heads x {index.head_dim}, top-{index.topk}"
                + (
                    f" in pools of {index.pool_size} ({index.topk // index.pool_size} pools"
                    + (" + the open pool)" if index.select_tail else ")")
                    if index.pool_size > 1
                    else ""
                )
                + "; "
                f"{index.key_cache} {index.key_cache_bytes_per_token} B/token/layer"
                + (
                    f" on {len(index.layers)} layers, {len(index.shared_layers)} reuse their top-k"
                    if index.shared_layers
                    else ""
                )
                + f"; {' + '.join(index.operators)}",
            ),
        )
    if plan.compressed_attention is not None:
        at = (
            rows.index(("KV bytes/token", rows[-1][1]))
            if rows[-1][0] == "KV bytes/token"
            else len(rows)
        )
        rows[at:at] = [
            (f"{kind.name} layers", _compressed_kind_line(kind))
            for kind in plan.compressed_attention.kinds
        ]
        if plan.compressed_attention.sinks:
            rows.insert(
                at + len(plan.compressed_attention.kinds),
                (
                    "sinks",
                    f"{plan.num_attention_heads} learnable per-head logits, "
                    f"{plan.compressed_attention.sinks}, in every layer's softmax: FA v2 "
                    "learnable_sink (value d <= 128) or npu_sparse_flash_attention sinks "
                    "(Ascend 950 only)",
                ),
            )
        after = at + len(plan.compressed_attention.kinds) + bool(plan.compressed_attention.sinks)
        rows[after:after] = [
            (f"V4 {f.name}", f"{f.where}: needs {f.needs}; {f.missing or 'no operator limit'}")
            for f in plan.compressed_attention.sub_features
        ]
    if plan.mtp is not None:
        mtp = plan.mtp
        rows.append(
            (
                "MTP layers",
                f"{mtp.num_layers} ({mtp.config_key}) at layers {mtp.layer_indices}, "
                f"{mtp.bytes_per_token} B/token; speculative KV bytes/token "
                f"{mtp.kv_bytes_per_token_speculative}, next_n {mtp.next_n}"
                + (
                    f"; not speculative: {mtp.speculative_refusal}"
                    if mtp.speculative_refusal
                    else ""
                ),
            )
        )
    if "kv_memory_bytes" in plan.memory:
        rows.append(("memory", memory_line(plan.memory)))
    return rows


def _compressed_kind_line(kind) -> str:
    """``20 (3, 5, ...), window 128, ratio 4, indexer 64x128 top-512; win_kv 1x512 ... ; ops``"""
    shown = ", ".join(map(str, kind.layer_indices[:4])) + (
        ", ..." if len(kind.layer_indices) > 4 else ""
    )
    parts = [f"{len(kind.layer_indices)} ({shown}), window {kind.sliding_window}"]
    if kind.compress_ratio > 1:
        parts.append(f"ratio {kind.compress_ratio}")
    if kind.indexer:
        idx = kind.indexer
        parts.append(f"indexer {idx['n_heads']}x{idx['head_dim']} top-{idx['topk']}")
    caches = ", ".join(map(entry_text, kind.caches))
    missing = (
        f" (not in torch_npu 2.13.0: {', '.join(kind.operators_missing)})"
        if kind.operators_missing
        else ""
    )
    return (
        f"{', '.join(parts)}; {caches} = {kind.bytes_per_token} B/token/layer; "
        f"{' + '.join(kind.operators)}{missing}"
    )


def to_table(plan: Plan) -> str:
    source = plan.source
    title = f"{plan.model_type} ({plan.architecture}) from {source.kind}: " + os.path.basename(
        source.modeling_file or "-"
    )
    rows = summary_rows(plan)
    width = max(len(label) for label, _ in rows)
    lines = [title, ""] + [f"  {label:<{width}}  {value}" for label, value in rows]
    if plan.implementer_blockers:
        lines += ["", "not converted by apply yet:"] + [
            f"  - {b}" for b in plan.implementer_blockers
        ]
    lines += ["", "evidence:"]
    lines += [f"  {e.decision}: {e.reason}  [{e.source}]" for e in plan.evidence]
    lines += ["", f"warnings ({len(plan.warnings)}):"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines)


def _model_line(plan: Plan) -> str:
    """The line that identifies which model a progress section is about."""
    where = f" `{plan.source.path}`" if plan.source.path else ""
    return f"Model: `{plan.model_type}` (`{plan.architecture}`), source {plan.source.kind}{where}"


def _checkpoint_name(plan: Plan) -> str:
    """A section's title: the checkpoint's folder when there is one (two checkpoints of one
    model type get two titles), else the model type."""
    if plan.source.kind != "transformers" and plan.source.path:
        name = os.path.basename(os.path.normpath(plan.source.path))
        if name and name != plan.model_type:
            return f"{name} ({plan.model_type})"
    return plan.model_type


def per_layer_line(plan: Plan) -> str:
    """attn_type per layer, consecutive layers of one type as a range: ``0-2 FullAttention;
    3 SlidingWindow(64)``. Layers with several kinds (a hybrid's attention and mixer) list
    each."""
    kinds: dict[int, list[str]] = {}
    for layer in plan.layers:
        kind = layer.attn_type + (f"({layer.sliding_window})" if layer.sliding_window else "")
        kinds.setdefault(layer.index, []).append(kind)
    runs: list[tuple[int, int, str]] = []
    for index in sorted(kinds):
        label = " + ".join(kinds[index])
        if runs and runs[-1][2] == label and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index, label)
        else:
            runs.append((index, index, label))
    return "; ".join(f"{a}-{b} {label}" if a != b else f"{a} {label}" for a, b, label in runs)


#: the progress section's slots for what the agent records after analyze; analyze writes
#: their placeholder once and keeps whatever was written there when it rewrites the section
VERIFY_SLOT = "### Verify evidence"
BY_HAND_SLOT = "### By hand"
_SLOT_PLACEHOLDERS = {
    VERIFY_SLOT: "- not run yet: paste the verdict line of `kvskill verify <converted dir>`",
    BY_HAND_SLOT: "- nothing yet: list each change made by hand (file, what, why)",
}


def to_markdown(plan: Plan, slots: dict[str, str] | None = None) -> str:
    """A self-contained ``## KVCache selection: <checkpoint>`` section for a progress file;
    SLOTS carries the verify and by-hand notes over from an earlier version of it."""
    lines = [f"{PROGRESS_HEADING}: {_checkpoint_name(plan)}", ""]
    lines.append(_model_line(plan))
    lines.append("")
    lines.append("| decision | value |")
    lines.append("|---|---|")
    for label, value in summary_rows(plan):
        lines.append(f"| {label} | {value.replace('|', '/')} |")
    lines.append(f"| attn_type per layer | {per_layer_line(plan)} |")
    lines += ["", "Evidence:", ""]
    lines += [f"- **{e.decision}**: {e.reason} (`{e.source}`)" for e in plan.evidence]
    if plan.implementer_blockers:
        lines += ["", "Not converted by apply yet:", ""]
        lines += [f"- {b}" for b in plan.implementer_blockers]
    lines += ["", "Watch for:", ""] + [f"- {w}" for w in plan.warnings]
    for slot, placeholder in _SLOT_PLACEHOLDERS.items():
        kept = (slots or {}).get(slot)
        lines += ["", slot, "", kept if kept else placeholder]
    return "\n".join(lines) + "\n"


def _slots_of(section: str) -> dict[str, str]:
    """What an existing section holds under its slot headings (up to the next heading)."""
    found = {}
    for slot in _SLOT_PLACEHOLDERS:
        match = re.search(
            rf"^{re.escape(slot)}[ \t]*\n(.*?)(?=^#{{1,3}} |\Z)", section, re.M | re.S
        )
        if match and match.group(1).strip():
            found[slot] = match.group(1).strip()
    return found


#: one section: its heading (plain, as older versions wrote it, or naming the model) through
#: the next heading of level 1 or 2
_SECTION = re.compile(
    rf"^{re.escape(PROGRESS_HEADING)}(?::[^\n]*)?[ \t]*\n.*?(?=^#{{1,2}} |\Z)",
    re.MULTILINE | re.DOTALL,
)


def update_progress(path: Path, plan: Plan) -> bool:
    """Add or replace this model's KVCache selection section; the rest of the file, the
    sections of other models included, is untouched.

    A section belongs to the model its ``Model:`` line names (type, architecture, source and
    directory), so a progress file shared by several models keeps one section per model.
    Returns True when the file changed. Running twice with the same plan changes nothing.

    Raises:
        BadInputError: the file cannot be read as UTF-8 text, or is too large.
    """
    old = read_text(path, what="progress file") if path.exists() else ""
    model_line = _model_line(plan)
    match = next(
        (s for s in _SECTION.finditer(old) if f"\n{model_line}\n" in s.group(0)),
        None,
    )
    section = to_markdown(plan, _slots_of(match.group(0)) if match else None)
    if match:
        tail = old[match.end() :]
        new = old[: match.start()] + section + ("\n" + tail if tail else "")
    else:
        separator = "" if not old else ("\n" if old.endswith("\n") else "\n\n")
        new = old + separator + section
    if new == old:
        return False
    _atomic_write(path, new)
    return True


def _atomic_write(path: Path, text: str) -> None:
    """Write TEXT to PATH through a temporary file and a rename: a reader never sees half a
    file. A folder the OS will not create or write is bad input, on one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise BadInputError(
            f"{path}: cannot write the progress file here ({exc.strerror or exc})"
        ) from exc
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise

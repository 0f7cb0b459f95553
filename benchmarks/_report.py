"""Turn cell records into result rows (cross-checked, with ratios), targets and a Markdown table."""

from __future__ import annotations

import hashlib
import json

SYSTEM_ORDER = ("kvskill", "hf_padded", "hf_cb", "hf_sequential")
#: Greedy tokens of this system define "correct" (transformers, unpadded, one request at a time).
REFERENCE_SYSTEM = "hf_sequential"
#: Where the reference did not run (or a cell skips it), the next transformers path stands in,
#: so kvskill is always checked against transformers when one of its paths ran.
REFERENCE_FALLBACK = (REFERENCE_SYSTEM, "hf_padded", "hf_cb", "kvskill")
#: The models the issue's targets are stated for; rows of other models (e.g. the MLA model)
#: are measured against the same bars but shown as informational.
TARGET_MODEL_PREFIX = "qwen3"
_MB = 1024 * 1024


def _digest(tokens) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


def _mismatches(tokens, ref) -> int:
    return sum(a != b for a, b in zip(tokens, ref, strict=False)) + abs(len(tokens) - len(ref))


def _pick_reference(group: dict[str, dict]) -> str | None:
    ok = [s for s in REFERENCE_FALLBACK if s in group and "error" not in group[s]]
    return ok[0] if ok else None


def _mb(value) -> float | None:
    return None if value is None else round(value / _MB, 3)


def build_rows(records: list[dict]) -> list[dict]:
    """One row per record; `valid` says its greedy tokens equal the reference system's."""
    groups: dict[tuple, dict[str, dict]] = {}
    for rec in records:
        key = (rec["workload"], rec["model"], rec["threads"])
        groups.setdefault(key, {})[rec["system"]] = rec
    rows = []
    for (workload, model, threads), group in groups.items():
        ref_name = _pick_reference(group)
        ref_tokens = group[ref_name]["tokens"] if ref_name else None
        kv_rate = group.get("kvskill", {}).get("tokens_per_s")
        for system in sorted(group, key=SYSTEM_ORDER.index):
            rec = group[system]
            row = {"workload": workload, "model": model, "system": system, "threads": threads}
            if "error" in rec:
                rows.append(
                    {
                        **row,
                        "tokens_per_s": None,
                        "ttft_s": None,
                        "wall_s": None,
                        "peak_rss_mb": None,
                        "kv_utilization": None,
                        "valid": False,
                        "error": rec["error"],
                        "not_runnable": bool(rec.get("not_runnable")),
                        "budget_cut": bool(rec.get("budget_cut")),
                    }
                )
                continue
            mism = _mismatches(rec["tokens"], ref_tokens)
            if system == ref_name:
                others = [
                    o for s, o in group.items() if s != system and "error" not in o
                ]  # the reference is confirmed by any other system that agrees with it
                agrees = not others or any(o["tokens"] == rec["tokens"] for o in others)
            else:
                agrees = mism == 0
            kv = rec.get("kv") or {}
            extra = rec.get("extra") or {}
            rows.append(
                {
                    **row,
                    "tokens_per_s": round(rec["tokens_per_s"], 2),
                    "ttft_s": round(rec["ttft_s"], 4),
                    "wall_s": round(rec["wall_s"], 4),
                    "peak_rss_mb": round(rec["peak_rss_mb"], 1),
                    "kv_utilization": None
                    if kv.get("utilization") is None
                    else round(kv["utilization"], 4),
                    "valid": bool(agrees and rec["deterministic"] and rec["lengths_ok"]),
                    "ratio_to_kvskill": None
                    if not kv_rate
                    else round(rec["tokens_per_s"] / kv_rate, 3),
                    "mismatched_requests": mism,
                    "reference_system": ref_name,
                    "deterministic": rec["deterministic"],
                    "repeats": rec["repeats"],
                    "wall_s_runs": [round(w, 4) for w in rec["wall_s_runs"]],
                    "cpu_per_wall": round(rec["cpu_per_wall"], 3),
                    "num_requests": rec["num_requests"],
                    "useful_tokens": rec["useful_tokens"],
                    "prompt_tokens": rec["prompt_tokens"],
                    "rss_after_load_mb": round(rec["rss_after_load_mb"], 1),
                    "kv_held_mb": _mb(kv.get("held_bytes")),
                    "kv_live_mb": _mb(kv.get("live_bytes")),
                    "kv_pool_mb": _mb(kv.get("pool_bytes")),
                    # Live KV at the peak over the whole preallocated pool (paged systems).
                    "kv_pool_utilization": round(kv["live_bytes"] / kv["pool_bytes"], 4)
                    if kv.get("pool_bytes")
                    else None,
                    "kv_capacity_tokens": rec["kv_capacity_tokens"],
                    "tokens_sha1": _digest(rec["tokens"]),
                    **{k: v for k, v in extra.items() if not isinstance(v, (list, dict))},
                    **({"engine_stats": extra["engine_stats"]} if "engine_stats" in extra else {}),
                }
            )
    return rows


def _find(rows, **match) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _rate(rows, **match) -> float | None:
    r = _find(rows, **match)
    return r["tokens_per_s"] if r and r["tokens_per_s"] and r["valid"] else None


def _target(model, threads, name, value, bar, op=">=") -> dict:
    met = None if value is None else (value >= bar if op == ">=" else value <= bar)
    return {
        "model": model,
        "threads": threads,
        "target": name,
        "value": None if value is None else round(value, 3),
        "bar": f"{op} {bar}",
        "met": met,
        # The bars are set for the Qwen3 models; the same ratios for others are for reading.
        "informational": not model.startswith(TARGET_MODEL_PREFIX),
    }


def targets(rows: list[dict]) -> list[dict]:
    """The bar for the runtime, per model at each thread count, from this run's rows."""
    out = []
    # Target models first, informational ones after.
    cells = {(r["model"], r["threads"]) for r in rows}
    for model, threads in sorted(
        cells, key=lambda c: (not c[0].startswith(TARGET_MODEL_PREFIX), c)
    ):
        cell = {"model": model, "threads": threads}
        for workload, bar_padded in (("W1", 1.5), ("W2", 1.0)):
            kv = _rate(rows, workload=workload, system="kvskill", **cell)
            for system, bar in (("hf_padded", bar_padded), ("hf_cb", 2.0)):
                if _find(rows, workload=workload, system=system, **cell) is None:
                    continue  # not in this cell's plan (e.g. 2-thread cells without hf_cb)
                other = _rate(rows, workload=workload, system=system, **cell)
                value = kv / other if kv and other else None
                name = f"{workload} kvskill / {system} tok/s"
                out.append(_target(model, threads, name, value, bar))
        w1 = _find(rows, workload="W1", system="kvskill", **cell)
        if w1 and w1.get("host_overhead_full_batch") is not None:
            name = f"W1 host overhead, decode at batch {w1['full_batch']}"
            out.append(_target(model, threads, name, w1["host_overhead_full_batch"], 0.10, "<="))
        for workload in ("W1", "W2", "W3", "W4"):
            r = _find(rows, workload=workload, system="kvskill", **cell)
            if r and r.get("kv_utilization") is not None:
                name = f"{workload} KV utilisation at peak"
                out.append(_target(model, threads, name, r["kv_utilization"], 0.90))
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _model_lines(models: dict) -> list[str]:
    """One bullet per model that has a description, then a blank line."""
    lines = [f"- `{name}`: {m['note']}" for name, m in models.items() if m.get("note")]
    return [*lines, ""] if lines else []


def _kernel_line(kernel: dict | None) -> list[str]:
    if kernel is None:
        return []
    if kernel["available"]:
        return ["kvskill's paged decode attention ran in the compiled CPU kernel."]
    return [f"kvskill's paged decode attention ran in PyTorch: {kernel['reason']}."]


def markdown_report(result: dict) -> str:
    rows = result["rows"]
    env = result["machine"]
    ver = result["versions"]
    lines = [
        f"Serving benchmark, {result['date']} — {env['cores']} cores ({env['cpu']}), "
        f"torch {ver['torch']}, transformers {ver['transformers']}, kvskill {ver['kvskill_commit']}"
        f"{' (uncommitted changes)' if ver.get('kvskill_dirty') else ''}; "
        f"load average before/after {result['load_average_before']} / "
        f"{result['load_average_after']}; median of {result['settings']['repeats']} timed runs "
        f"after a warm-up (hf_sequential: {result['settings']['repeats_hf_sequential']}).",
        *_kernel_line(result.get("cpu_kernels")),
        "",
        *_model_lines(result["settings"].get("models") or {}),
        "| workload | model | thr | system | useful tok/s | vs kvskill | mean TTFT s | wall s "
        "| peak RSS MB | KV util | CPU/wall | valid |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("not_runnable"):
            valid = "not runnable"
        elif r.get("budget_cut"):
            valid = "cut (time budget)"
        else:
            valid = "yes" if r["valid"] else ("ERROR" if r.get("error") else "NO")
        lines.append(
            f"| {r['workload']} | {r['model']} | {r['threads']} | {r['system']} "
            f"| {_fmt(r['tokens_per_s'], '.0f')} | {_fmt(r.get('ratio_to_kvskill'), '.2f')} "
            f"| {_fmt(r['ttft_s'], '.3f')} | {_fmt(r['wall_s'], '.2f')} "
            f"| {_fmt(r['peak_rss_mb'], '.0f')} | {_fmt(r['kv_utilization'], '.2f')} "
            f"| {_fmt(r.get('cpu_per_wall'), '.2f')} | {valid} |"
        )
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Errors and systems that cannot run a model:"]
        lines += [
            f"- {r['workload']} {r['model']} t={r['threads']} {r['system']}: "
            f"{'not runnable: ' if r.get('not_runnable') else ''}{r['error']}"
            for r in errors
        ]
    tgt = result.get("targets") or []
    if tgt:
        lines += [
            "",
            "| model | thr | target | measured | bar | met |",
            "|---|---|---|---:|---|---|",
        ]
        for t in tgt:
            met = {True: "yes", False: "NO", None: "n/a"}[t["met"]]
            if t.get("informational"):
                met = f"({met}; informational)"
            lines.append(
                f"| {t['model']} | {t['threads']} | {t['target']} | {_fmt(t['value'], '.3f')} "
                f"| {t['bar']} | {met} |"
            )
    if any(r["threads"] > 1 for r in rows):
        lines += [
            "",
            "Thread counts above 1 share the machine's cores with everything else running; "
            "on 2 cores the 2-thread figures are noisy.",
        ]
    return "\n".join(lines) + "\n"

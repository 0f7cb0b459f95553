"""The human-readable verify report: one table of prompts, one of chains, a verdict."""

from __future__ import annotations

from kvskill.runtime.ops.reference.npu_profile import profile_line
from kvskill.verify.report import VerifyReport


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _compared_columns(report: VerifyReport) -> list[str]:
    """What each prompt row compares: in float32 the converted model against the original;
    in a low precision against the float32 original (the anchor), which both runs drift from."""
    against = "float32 original" if report.low_precision is not None else "original"
    return [f"greedy tokens vs {against}", f"max |logit diff| vs {against}"]


def format_table(report: VerifyReport) -> str:
    """Prompts (length, tokens, logit difference), chains, failures and the verdict."""
    tolerance = (
        f"{report.dtype} judged against the float32 original"
        if report.low_precision is not None
        else f"atol {report.atol:g} + rtol {report.rtol:.2g} x largest logit"
    )
    lines = [
        report.checked_line,
        f"verify {report.model_type} ({report.directory})",
        f"config: {'shrunk' if report.shrunk else 'as converted'}"
        + (f" ({', '.join(sorted(report.config_changes))})" if report.config_changes else "")
        + f"; dtype {report.dtype}; block size {report.block_size}; kv layout {report.kv_layout}"
        + ("; decode captured as graphs" if report.graph else "")
        + f"; {tolerance}; runtime exact (no fast paths)",
    ]
    if report.npu_limits is not None:
        lines.append(profile_line(report.npu_limits))
        limits = report.npu_limits.get("model_limits")
        if limits is not None:
            lines.append(f"model_limits (the real config, from the Plan): {len(limits)} hit")
            lines += [f"  - {w}" for w in limits]
    lines.append("")
    rows = [
        [
            str(p.index),
            str(p.prompt_len),
            "identical"
            if p.reference_tokens == p.runtime_tokens
            else f"near tie at step {p.first_mismatch}"
            if p.near_tie and report.low_precision is None
            else f"differ at step {p.first_mismatch}",
            f"{p.max_logit_diff:.2e}",
        ]
        for p in report.prompts
    ]
    if rows:
        lines += _table(["prompt", "length", *_compared_columns(report)], rows)
        if report.low_precision is not None:
            lines.append(
                f"(rows: the converted model in {report.dtype} against the float32 original; "
                f"rounding alone moves them, so the verdict below weighs this drift against the "
                f"original's own in {report.dtype})"
            )
        lines.append("")
    if report.chains:
        chain_rows = [
            [c["name"], "ok" if c["passed"] else "FAILED", c["summary"]] for c in report.chains
        ]
        lines += _table(["chain", "result", "checked"], chain_rows)
        lines.append("")
    lines += [f"  - {line}" for line in report.failures()]
    lines += [f"note: {note}" for note in report.notes]
    verdict = "PASSED" if report.passed else "FAILED"
    chains_ok = bool(report.chains) and all(c["passed"] for c in report.chains)
    if report.low_precision is not None:
        lines.append(
            f"{verdict}: {report.low_precision.summary()}; chains {'ok' if chains_ok else 'not ok'}"
        )
        return "\n".join(lines)
    ties = sum(1 for p in report.prompts if p.near_tie)
    lines.append(
        f"{verdict}: tokens {'identical' if report.tokens_identical else 'differ'}"
        + (f" ({ties} near tie(s))" if ties else "")
        + ", max logit "
        f"diff {report.max_logit_diff:.2e} (atol {report.atol:g} + rtol {report.rtol:.2g} x "
        f"largest logit {max((p.logit_scale for p in report.prompts), default=0.0):.3g}), chains "
        f"{'ok' if chains_ok else 'not ok'}"
    )
    return "\n".join(lines)

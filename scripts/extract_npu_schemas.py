"""Download the torch_npu wheel and record the schemas of the operators kvskill calls.

Writes ``tests/fixtures/npu_schemas.json``: for each operator the ``func:`` line of
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml`` (with its line number) and the
line of its block in ``torch_npu/_op_plugin_docs.py`` (for citations in the checks). The
conformance tests read only that fixture, so they run offline.

    python scripts/extract_npu_schemas.py              # torch_npu 2.13.0, cached wheel
    python scripts/extract_npu_schemas.py --version 2.13.0 --out tests/fixtures/npu_schemas.json

The wheel is cached in ``${KVSKILL_CACHE_DIR:-~/.cache/kvskill}/wheels`` and never copied into
the repository; only the schema lines (facts about the interface) are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
DOCS_PY = "torch_npu/_op_plugin_docs.py"

#: every operator kvskill emits into converted code or implements in runtime/ops/reference,
#: plus the NPU operators the FLA entry points map to (runtime/ops/fla.py)
OPERATORS = (
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "scatter_update",
    "scatter_update_",
    "npu_kv_rmsnorm_rope_cache",
    "npu_interleave_rope",
    "npu_format_cast",
    "npu_format_cast_",
    "get_npu_format",
    "npu_recurrent_gated_delta_rule",
    "npu_recurrent_gated_delta_rule_functional",
    "npu_chunk_gated_delta_rule",
    "npu_fused_causal_conv1d",
    # what cann-recipes-infer's models and its module/ package call (runtime/ops/reference)
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_apply_rotary_pos_emb",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing_v2",
    "npu_moe_finalize_routing",
    "npu_moe_re_routing",
    "npu_grouped_matmul",
    # DeepSeek sparse attention (DSA): the indexer's top-k and the attention over it
    "npu_lightning_indexer",
    "npu_sparse_flash_attention",
    # the expert-parallel pair qwen3_5 decodes through (modelled at one rank)
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2",
    # what the wheel offers near DeepSeek-V4's compressed attention (analyzer/compressed_attention)
    "npu_quant_lightning_indexer",
    "npu_nsa_compress",  # its paged form is the overload npu_nsa_compress_infer.cache
)
#: operators cann-recipes-infer's deepseek_v4 calls through torch.ops.custom, recorded as
#: absent from the wheel (no func: entry, no docs block); the extraction fails if one appears.
#: Their own schemas come from the framework checkout: scripts/extract_custom_schemas.py
ABSENT = (
    "npu_sparse_attn_sharedkv",
    "npu_sparse_attn_sharedkv_metadata",
    "compressor",
    "scatter_nd_update_asc",
    "inplace_partial_rotary_mul",
)

# NOTE: several platform tags are tried because PyPI publishes torch_npu 2.13.0 only as
# manylinux_2_28 wheels; the schema files are the same on every platform.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_28_aarch64", "manylinux2014_x86_64")

_FUNC = re.compile(r"^\s*-?\s*func:\s*(?P<name>[A-Za-z0-9_]+)(?P<overload>\.[A-Za-z0-9_]+)?\(")
_DOC = re.compile(r'^\s*"(?P<name>[A-Za-z0-9_]+)",\s*$')


def cache_dir() -> Path:
    root = os.environ.get("KVSKILL_CACHE_DIR") or str(Path.home() / ".cache" / "kvskill")
    return Path(root) / "wheels"


def download_wheel(version: str, python_version: str, dest: Path) -> Path:
    """The cached wheel for ``version``, downloading it with pip when it is missing."""
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"torch_npu-{version}-cp{python_version}-*.whl"
    found = sorted(dest.glob(pattern))
    if found:
        return found[0]
    errors = []
    for platform in PLATFORMS:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={version}",
            "--platform", platform, "--python-version", python_version,
            "--only-binary=:all:", "-d", str(dest),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(dest.glob(pattern))
        if done.returncode == 0 and found:
            return found[0]
        errors.append(f"{platform}: {done.stderr.strip().splitlines()[-1:]}")
    raise SystemExit(f"could not download torch-npu=={version}: " + "; ".join(errors))


def primary_schemas(yaml_text: str) -> dict[str, tuple[int, str]]:
    """name -> (line number, schema) of the first overload-free ``func:`` entry per name.

    The yaml lists some operators twice (a second section re-registers them); the first entry
    is the one the Python binding is generated from. Overloads (``name.Tensor``) are skipped:
    the Python name without a suffix binds the default overload.
    """
    out: dict[str, tuple[int, str]] = {}
    for number, line in enumerate(yaml_text.splitlines(), start=1):
        match = _FUNC.match(line)
        if not match or match["overload"] or match["name"] in out:
            continue
        out[match["name"]] = (number, line.split("func:", 1)[1].strip())
    return out


def doc_blocks(docs_text: str) -> dict[str, int]:
    """name -> line number of its ``_add_torch_npu_docstr("name", ...)`` block."""
    lines = docs_text.splitlines()
    out: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        match = _DOC.match(line)
        if match and number >= 2 and "_add_torch_npu_docstr(" in lines[number - 2]:
            out.setdefault(match["name"], number)
    return out


def extract(wheel: Path, version: str) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        yaml_text = archive.read(SCHEMA_YAML).decode()
        docs_text = archive.read(DOCS_PY).decode()
    schemas = primary_schemas(yaml_text)
    docs = doc_blocks(docs_text)
    missing = [name for name in OPERATORS if name not in schemas]
    if missing:
        raise SystemExit(f"{wheel.name}: no func: entry for {missing} in {SCHEMA_YAML}")
    present = sorted(name for name in ABSENT if name in schemas or name in docs)
    if present:
        raise SystemExit(f"{wheel.name}: {present} now in the wheel; move them to OPERATORS")
    ops = {}
    for name in OPERATORS:
        line, func = schemas[name]
        entry = {"yaml_line": line, "func": func}
        if name in docs:
            entry["doc_line"] = docs[name]
        ops[name] = entry
    return {
        "package": "torch-npu",
        "version": version,
        "wheel": wheel.name,
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "schema_file": SCHEMA_YAML,
        "docs_file": DOCS_PY,
        "operators": ops,
        "absent": list(ABSENT),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default="2.13.0")
    parser.add_argument("--python-version", default="311")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "npu_schemas.json",
    )
    args = parser.parse_args(argv)
    wheel = download_wheel(args.version, args.python_version, cache_dir())
    fixture = extract(wheel, args.version)
    args.out.write_text(json.dumps(fixture, indent=2, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(fixture['operators'])} operators from {wheel.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

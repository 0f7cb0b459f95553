"""Record the schemas of cann-recipes-infer's custom operators that DeepSeek-V4 calls.

Writes ``tests/fixtures/custom_schemas.json`` from a local checkout of hicann/cann-recipes-infer:
for each operator the schema string its extension defines (``m.def("...")`` in
``ops/ascendc/torch_ops_extension/custom_ops/csrc/ops_def_registration.cpp``, C++ string pieces
joined, with its line number) and the prototype line of its doc page (``ops/ascendc/docs``, the
code block that starts with ``custom.<name>(``). The conformance tests read only the fixture,
so they run without the checkout. Sibling of ``extract_npu_schemas.py`` (the wheel's).

    python scripts/extract_custom_schemas.py --checkout /path/to/cann-recipes-infer

Only the interface lines (facts) are recorded, never the operators' code.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REGISTRATION = "ops/ascendc/torch_ops_extension/custom_ops/csrc/ops_def_registration.cpp"
DOCS = "ops/ascendc/docs"

#: the custom operators the reference implements (runtime/ops/reference/custom)
IMPLEMENTED = ("npu_sparse_attn_sharedkv", "npu_sparse_attn_sharedkv_metadata", "compressor")
#: what DeepSeek-V4 also calls, recorded for the record (quantization-only, see
#: runtime/ops/reference/custom/__init__.py)
RECORDED = (
    "npu_quant_lightning_indexer",
    "npu_quant_lightning_indexer_metadata",
    "kv_compress_epilog",
    "indexer_compress_epilog",
    "quant_compressor",
    "npu_kv_quant_sparse_attn_sharedkv",
    "scatter_nd_update_asc",
)

_DEF = re.compile(r"\bm\.def\(")
_PIECE = re.compile(r'"((?:[^"\\]|\\.)*)"')
_NAME = re.compile(r"^\s*([A-Za-z0-9_]+)\(")


def registered_schemas(cpp_text: str) -> dict[str, tuple[int, str]]:
    """name -> (line of its ``m.def(``, schema with the string pieces joined)."""
    out: dict[str, tuple[int, str]] = {}
    for match in _DEF.finditer(cpp_text):
        line = cpp_text.count("\n", 0, match.start()) + 1
        end = cpp_text.index(");", match.end())
        schema = "".join(_PIECE.findall(cpp_text[match.end() : end]))
        schema = re.sub(r"\s+", " ", schema).strip()
        name = _NAME.match(schema)
        if name:
            out.setdefault(name[1], (line, schema))
    return out


def doc_prototypes(docs: dict[str, str]) -> dict[str, tuple[str, int, str]]:
    """name -> (doc file, line, prototype) for every ``custom.<name>(...)`` code line."""
    out: dict[str, tuple[str, int, str]] = {}
    for file, text in sorted(docs.items()):
        lines = text.splitlines()
        for number, line in enumerate(lines, start=1):
            if not line.startswith("custom."):
                continue
            # a prototype may wrap over a few lines until its "-> ..." result
            proto, extra = line, number
            while "->" not in proto and extra < len(lines):
                proto += " " + lines[extra].strip()
                extra += 1
            proto = re.sub(r"\s+", " ", proto.removeprefix("custom.")).strip()
            name = _NAME.match(proto)
            if name:
                out.setdefault(name[1], (file, number, proto))
    return out


def extract(checkout: Path, commit: str) -> dict:
    cpp = registered_schemas((checkout / REGISTRATION).read_text())
    docs = {p.name: p.read_text() for p in sorted((checkout / DOCS).glob("custom-*.md"))}
    protos = doc_prototypes(docs)
    missing = [n for n in IMPLEMENTED + RECORDED if n not in cpp]
    if missing:
        raise SystemExit(f"{REGISTRATION}: no m.def for {missing}")
    ops = {}
    for name in IMPLEMENTED + RECORDED:
        line, func = cpp[name]
        entry = {"registration_line": line, "func": func, "implemented": name in IMPLEMENTED}
        if name in protos:
            file, doc_line, proto = protos[name]
            entry.update(doc=f"{DOCS}/{file}", doc_line=doc_line, doc_prototype=proto)
        ops[name] = entry
    return {
        "repository": "hicann/cann-recipes-infer",
        "commit": commit,
        "registration_file": REGISTRATION,
        "operators": ops,
    }


def checkout_commit(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: not a git checkout ({done.stderr.strip()})")
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent
        / "tests"
        / "fixtures"
        / "custom_schemas.json",
    )
    args = parser.parse_args(argv)
    if not (args.checkout / REGISTRATION).is_file():
        print(f"error: {args.checkout} has no {REGISTRATION}", file=sys.stderr)
        return 2
    fixture = extract(args.checkout, checkout_commit(args.checkout))
    args.out.write_text(json.dumps(fixture, indent=2, ensure_ascii=False) + "\n")
    print(
        f"{args.out}: {len(fixture['operators'])} operators at {fixture['commit'][:7]}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

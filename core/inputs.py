"""The one input boundary: every file kvskill reads from a user goes through these readers.

Each reader resolves symlinks (a loop or an over-long path is bad input), can require the
resolved file to stay inside the folder it belongs to, caps the size before reading, decodes
UTF-8 strictly and, for JSON and Python, caps the nesting depth *before* a parser sees the
text: CPython's JSON and AST parsers recurse (a 100k-deep list is a ``RecursionError``) and
libcst's native parser overflows the C stack on a few thousand nested brackets (a segfault,
which no ``except`` can catch). Every failure is a ``BadInputError`` (exit 2) with one line
naming the file.
"""

from __future__ import annotations

import io
import json
import os
import tokenize
from pathlib import Path
from typing import Any

from kvskill.core.errors import BadInputError

#: JSON files (configs, plans, manifests, prompt files, safetensors indexes) at most
MAX_JSON_BYTES = 64 << 20
#: text files (Markdown progress files, prompt lists) at most
MAX_TEXT_BYTES = 16 << 20
#: Python source files (modeling code, linted files) at most; transformers' largest is 0.3 MB
MAX_SOURCE_BYTES = 4 << 20
#: nesting of JSON arrays/objects at most (configs nest a handful of levels)
MAX_JSON_DEPTH = 64
#: nesting of brackets, and of indented blocks, in Python source at most (real model code
#: stays below 20; CPython itself refuses 200 nested brackets and 100 indent levels)
MAX_SOURCE_DEPTH = 100
#: operators in one statement at most (brackets, commas, colons and ``=`` not counted):
#: libcst's parser backtracks on long chains (5000 ``+`` take half a minute) and recurses
#: on unary prefixes (20000 ``not`` overflow its stack)
MAX_STATEMENT_OPERATORS = 1000
_FREE_OPS = frozenset({",", ":", "=", "(", ")", "[", "]", "{", "}", ";"})


def resolve_inside(path: Path, *, what: str, root: Path | None = None) -> Path:
    """``path`` with every symlink resolved; it must exist (and lie inside ``root``).

    Raises:
        BadInputError: a symlink loop, a path the OS refuses (too long), a missing file,
            or a file whose real location is outside ``root``.
    """
    try:
        resolved = Path(path).resolve(strict=True)
    except FileNotFoundError:
        raise BadInputError(f"{what} {path} does not exist") from None
    except RuntimeError as exc:  # Python < 3.13: symlink loops
        raise BadInputError(f"{what} {path}: symlink loop ({exc})") from None
    except OSError as exc:
        raise BadInputError(f"{what} {path} cannot be opened: {exc.strerror or exc}") from None
    if root is not None:
        try:
            real_root = Path(root).resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise BadInputError(f"folder {root} cannot be opened: {exc}") from None
        if resolved != real_root and real_root not in resolved.parents:
            raise BadInputError(
                f"{what} {path} resolves to {resolved}, outside {real_root}; kvskill reads only "
                "files inside the folder they belong to"
            )
    return resolved


def read_bytes(
    path: Path, *, what: str, root: Path | None = None, max_bytes: int = MAX_TEXT_BYTES
) -> bytes:
    """The bytes of a regular file, at most ``max_bytes`` (checked before reading)."""
    resolved = resolve_inside(path, what=what, root=root)
    if not resolved.is_file():
        raise BadInputError(f"{what} {path} is not a regular file")
    try:
        size = resolved.stat().st_size
        if size > max_bytes:
            raise BadInputError(
                f"{what} {path} is {size} bytes; kvskill reads at most {max_bytes} bytes here"
            )
        with open(resolved, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise BadInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:  # grew while being read
        raise BadInputError(f"{what} {path} is larger than {max_bytes} bytes")
    return data


def decode_utf8(data: bytes, *, what: str, path: Path | str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInputError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r})"
        ) from None


def read_text(
    path: Path, *, what: str, root: Path | None = None, max_bytes: int = MAX_TEXT_BYTES
) -> str:
    """A UTF-8 text file, size-capped, symlinks resolved (and kept inside ``root``)."""
    data = read_bytes(path, what=what, root=root, max_bytes=max_bytes)
    return decode_utf8(data, what=what, path=path)


def json_depth_error(text: str, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``text`` nests deeper than ``max_depth`` (arrays/objects), or None. Linear scan,
    strings skipped, no recursion."""
    depth = 0
    in_string = escaped = False
    for index, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return f"nests deeper than {max_depth} levels (at character {index})"
        elif ch in "]}":
            depth -= 1
    return None


def loads_json(text: str, *, what: str, path: Path | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` behind a depth check; a syntax error is bad input on one line."""
    problem = json_depth_error(text, max_depth)
    if problem:
        raise BadInputError(f"{what} {path} {problem}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInputError(
            f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (RecursionError, ValueError) as exc:  # ValueError: e.g. an integer too long
        raise BadInputError(f"{what} {path} cannot be parsed: {exc}") from None


def read_json(
    path: Path,
    *,
    what: str,
    root: Path | None = None,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """A JSON file through the checked reader."""
    return loads_json(
        read_text(path, what=what, root=root, max_bytes=max_bytes),
        what=what,
        path=path,
        max_depth=max_depth,
    )


#: transformers 5's ``save_pretrained`` writes a float JSON cannot hold as ``{"__float__": tag}``
#: (``PreTrainedConfig._encode_special_floats``); ``from_pretrained`` decodes the same tags
SPECIAL_FLOAT_TAG = "__float__"
SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(data: Any) -> Any:
    """``data`` with every ``{"__float__": "Infinity"}`` (and ``-Infinity``, ``NaN``) object
    replaced by its float, as transformers reads a saved config. Example: a Mamba-2
    ``time_step_limit`` saved as ``[0.0, {"__float__": "Infinity"}]`` reads ``[0.0, inf]``.
    An object with other keys, or an unknown tag, stays as it is (transformers keeps it too).
    """
    if isinstance(data, dict):
        tag = data.get(SPECIAL_FLOAT_TAG)
        if len(data) == 1 and isinstance(tag, str) and tag in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[tag]
        return {key: decode_special_floats(value) for key, value in data.items()}
    if isinstance(data, list):
        return [decode_special_floats(value) for value in data]
    return data


def read_config_json(path: Path, *, root: Path | None = None) -> dict[str, Any]:
    """A model's ``config.json`` as transformers reads it: one object, special floats decoded."""
    return decode_special_floats(read_json_object(path, what="config", root=root))


def read_json_object(path: Path, *, what: str, root: Path | None = None) -> dict[str, Any]:
    """A JSON file that must hold one object."""
    data = read_json(path, what=what, root=root)
    if not isinstance(data, dict):
        raise BadInputError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


def source_depth_error(source: str, max_depth: int = MAX_SOURCE_DEPTH) -> str | None:
    """Why Python ``source`` nests too deep for a parser to take safely, or None.

    Counts open brackets, indented blocks, runs of prefix keywords (``not``, ``lambda``,
    ``await``) and operators per statement with the pure-Python tokenizer (no recursion); a
    source that does not tokenize is left for the parser to report as a syntax error.
    """
    depth = indent = operators = prefix_run = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            kind, text, line = token.type, token.string, token.start[0]
            if kind == tokenize.OP and text in "([{":
                depth += 1
                if depth > max_depth:
                    return f"line {line}: more than {max_depth} nested brackets"
            elif kind == tokenize.OP and text in ")]}":
                depth = max(depth - 1, 0)
            elif kind == tokenize.INDENT:
                indent += 1
                if indent > max_depth:
                    return f"line {line}: more than {max_depth} nested blocks"
            elif kind == tokenize.DEDENT:
                indent = max(indent - 1, 0)
            elif kind == tokenize.NEWLINE:
                operators = 0
            if kind == tokenize.OP and text not in _FREE_OPS:
                operators += 1
                if operators > MAX_STATEMENT_OPERATORS:
                    return f"line {line}: more than {MAX_STATEMENT_OPERATORS} operators in one statement"
            prefix = (kind == tokenize.OP and text in "-+~*") or text in ("not", "lambda", "await")
            prefix_run = prefix_run + 1 if prefix else 0
            if prefix_run > max_depth:
                return f"line {line}: more than {max_depth} nested prefix operators"
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return None


def check_source_depth(source: str, *, path: Path | str, max_depth: int = MAX_SOURCE_DEPTH) -> None:
    """Refuse Python source a parser could crash on (see ``source_depth_error``)."""
    problem = source_depth_error(source, max_depth)
    if problem:
        raise BadInputError(f"{path}: {problem}; kvskill does not parse code nested this deep")


def read_source(path: Path, *, what: str = "modeling file", root: Path | None = None) -> str:
    """A Python source file: checked reader, then the nesting check."""
    source = read_text(path, what=what, root=root, max_bytes=MAX_SOURCE_BYTES)
    check_source_depth(source, path=path)
    return source


def is_inside(path: Path, root: Path) -> bool:
    """True when ``path`` (resolved) is ``root`` (resolved) or below it."""
    try:
        real, real_root = Path(path).resolve(), Path(root).resolve()
    except (OSError, RuntimeError):
        return False
    return real == real_root or real_root in real.parents


def path_error(path: Path) -> str | None:
    """Why the OS cannot use ``path`` at all (too long, a loop), or None."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return None

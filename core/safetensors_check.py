"""Check a ``*.safetensors`` file's header against its size before anything loads it.

The format: 8 bytes little-endian header length N, N bytes of JSON header (tensor name ->
``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional ``__metadata__``),
then the data. A file cut short, a header that lies about offsets, or a shape that does not
fill its byte range is bad input here, with its name, instead of a crash or a silent pass
later.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from kvskill.core.errors import BadInputError
from kvskill.core.inputs import decode_utf8, loads_json, resolve_inside

#: bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20


def check_safetensors(path: Path, *, root: Path | None = None) -> int:
    """Validate ``path``'s header against the file; returns the number of tensors.

    Raises:
        BadInputError: truncated file, malformed header, offsets or shapes that do not fit.
    """
    resolved = resolve_inside(path, what="weights file", root=root)
    try:
        size = resolved.stat().st_size
        with open(resolved, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise BadInputError(f"weights file {path} is {size} bytes: no safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise BadInputError(
                    f"weights file {path}: header of {length} bytes does not fit in the "
                    f"{size}-byte file (truncated or not safetensors)"
                )
            raw = handle.read(length)
    except OSError as exc:
        raise BadInputError(f"cannot read weights file {path}: {exc.strerror or exc}") from None
    header = loads_json(
        decode_utf8(raw, what="weights header of", path=path), what="weights header of", path=path
    )
    if not isinstance(header, dict):
        raise BadInputError(f"weights file {path}: the header is not a JSON object")
    data_bytes = size - 8 - length
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ranges.append(_tensor_range(path, name, info, data_bytes))
    ranges.sort()
    end = 0
    for begin, stop, name in ranges:
        if begin != end:
            raise BadInputError(
                f"weights file {path}: tensor {name!r} starts at byte {begin}, expected {end} "
                "(overlapping or gapped data)"
            )
        end = stop
    if end != data_bytes:
        raise BadInputError(
            f"weights file {path}: the header describes {end} bytes of data but the file holds "
            f"{data_bytes} (truncated or padded)"
        )
    return len(ranges)


def _tensor_range(path: Path, name: str, info, data_bytes: int) -> tuple[int, int, str]:
    where = f"weights file {path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise BadInputError(f"{where} has no dtype/shape/data_offsets record")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise BadInputError(f"{where} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise BadInputError(f"{where} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise BadInputError(
            f"{where}: data_offsets {offsets!r} do not fit the {data_bytes} data bytes "
            "(truncated file?)"
        )
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if need != offsets[1] - offsets[0]:
        raise BadInputError(
            f"{where}: shape {shape} of {dtype} needs {need} bytes, the header gives "
            f"{offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1], name

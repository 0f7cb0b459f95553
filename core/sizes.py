"""Memory sizes on the command line (``--kv-memory 512M``): the one parser every verb uses.

Binary and decimal units are both accepted and mean what they say: ``KiB``/``MiB``/``GiB``/
``TiB`` are powers of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000. A bare letter
(``512M``, ``8G``) is binary, as in ``free -m`` or ``java -Xmx``. A plain number is bytes.
"""

from __future__ import annotations

import math
import re

from kvskill.core.errors import BadInputError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
#: a size beyond this is a typo, not a machine (1 PiB)
MAX_SIZE_BYTES = 1 << 50


def parse_size(text: str | None, *, option: str = "--kv-memory") -> int | None:
    """'512M' -> 536870912, '8GiB' -> 8589934592, '1.5GB' -> 1500000000, None -> None.

    Raises:
        BadInputError: not a size, zero, or absurdly large.
    """
    if text is None:
        return None
    match = _SIZE.match(str(text))
    if not match:
        raise BadInputError(
            f"{option} {text!r} is not a size; write e.g. 512M, 8GiB or 500MB "
            "(K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)"
        )
    number, prefix, binary, byte = match.groups()
    value = float(number)
    prefix = prefix.lower()
    if binary and not prefix:
        raise BadInputError(f"{option} {text!r} is not a size; write e.g. 512MiB")
    decimal = bool(prefix) and bool(byte) and not binary
    scale = (1000 if decimal else 1024) ** _POWER[prefix]
    size = value * scale
    if not math.isfinite(size) or size < 1:
        raise BadInputError(f"{option} {text!r} must be at least one byte")
    if size > MAX_SIZE_BYTES:
        raise BadInputError(f"{option} {text!r} is more than 1 PiB; check the unit")
    return int(size)

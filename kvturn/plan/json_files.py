"""The files `kvturn plan` reads (traces, workloads, calibrations, bench results), which anyone may have written:
read within bounds of size and nesting, each refusal one line. What the numbers in them may be (finite, within
bounds) is the business of the schema each is read by."""
import json
from pathlib import Path

MAX_FILE_BYTES = 256 * 2**20  # a bench results JSON of several legs with every worker's steps is tens of MB
MAX_LINE_BYTES = 2**16  # a trace line is ~150 bytes
MAX_DEPTH = 32  # the deepest of kvturn's own files nests 6


class Unreadable(ValueError):
    """A file, or a line of one, that is not JSON kvturn plan may read; the message says why."""


def _nesting(value) -> int:
    """How deep `value` nests (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def loads(text: str):
    """`text` as JSON nested at most MAX_DEPTH deep (Python's parser would overflow its stack on a deep one)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Unreadable(f"nested deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise Unreadable(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if _nesting(value) > MAX_DEPTH:
        raise Unreadable(f"nested deeper than {MAX_DEPTH} levels")
    return value


def read_text(path: Path) -> str:
    """The file's text, refused past MAX_FILE_BYTES before it is read."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_FILE_BYTES:
            raise Unreadable(f"{size / 2**20:.0f} MiB, over the {MAX_FILE_BYTES >> 20} MiB kvturn plan reads")
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Unreadable(f"cannot read it ({exc})") from None


def read_json(path: Path):
    return loads(read_text(path))

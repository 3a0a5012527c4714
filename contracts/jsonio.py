"""Reading and writing the project's JSON files with one-line errors that name the file.

Every file GPUMix reads from a user (cluster, plan, scenario, config.json, trace) goes through
`check_file_size` first (a file larger than `MAX_INPUT_FILE_BYTES` is refused by its size,
before a byte of it is read), and JSON files through `load_json_file`, so a missing, huge or
malformed file always gives the same clear message.

Every JSON GPUMix writes goes through `dumps`: NaN and ±inf (an undefined mean of no jobs, an
infinite time) become `null`, and `allow_nan=False` guarantees strict JSON (RFC 8259 has no NaN).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# The largest user file read: a cluster of 100,000 nodes or a trace of a million jobs is a few
# tens of MB; anything larger is a mistake (a wrong path, a log file), not an input.
MAX_INPUT_FILE_BYTES = 64 * 2**20


def check_file_size(path: str, what: str, limit_bytes: int = MAX_INPUT_FILE_BYTES) -> None:
    """ValueError naming `what` when `path` is missing, not a regular file, or over the limit."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"cannot read {what} {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    if os.path.isdir(path):
        raise ValueError(f"cannot read {what} {path}: it is a directory")
    if st.st_size > limit_bytes:
        raise ValueError(f"{what} {path} is {st.st_size / 2**20:.0f} MiB, over the limit of "
                         f"{limit_bytes / 2**20:.0f} MiB for an input file")


def read_text_file(path: str, what: str, limit_bytes: int = MAX_INPUT_FILE_BYTES) -> str:
    """The UTF-8 text of a user file, refused by size before it is read."""
    check_file_size(path, what, limit_bytes)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read(limit_bytes + 1)  # a file that grew since the stat is still bounded
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    if len(text) > limit_bytes:
        raise ValueError(f"{what} {path} is over the limit of {limit_bytes / 2**20:.0f} MiB for an input file")
    return text


def load_json_file(path: str, what: str, limit_bytes: int = MAX_INPUT_FILE_BYTES) -> Any:
    """The parsed JSON of `path` (refused by size first: `limit_bytes`); ValueError naming `what`
    and the problem otherwise."""
    text = read_text_file(path, what, limit_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ValueError(f"{what} {path} is nested too deeply to be a GPUMix file") from None


def finite_or_null(obj: Any) -> Any:
    """`obj` with every NaN/±inf float replaced by None (JSON null), containers rebuilt."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return finite_or_null(dataclasses.asdict(obj))
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (no NaN/Infinity tokens): non-finite floats are written as null."""
    return json.dumps(finite_or_null(obj), indent=2, allow_nan=False, default=str)


def save_json_file(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(dumps(obj) + "\n")

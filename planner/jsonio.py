"""Reading and writing the project's JSON files with one-line errors that name the file.

Every file GPUMix reads from a user (cluster, plan, scenario, config.json) goes through
`load_json_file`, so a missing or malformed file always gives the same clear message.
"""
from __future__ import annotations

import json
from typing import Any


def load_json_file(path: str, what: str) -> Any:
    """The parsed JSON of `path`; ValueError naming `what` and the problem otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"cannot read {what} {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2)


def save_json_file(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(dumps(obj) + "\n")

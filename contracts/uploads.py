"""Files a dashboard user uploads, read into specs: a cluster file, a Hugging Face config.json.

Bytes in, a frozen spec out, or ValueError with one line. The dashboard runs these in a child
process bounded in time and memory (ui/background.run_bounded), so they take plain bytes and
return picklable specs; they are module-level functions for the same reason.
"""
from __future__ import annotations

import json
import os

from contracts.cluster import ClusterSpec
from contracts.specs import ModelSpec, spec_from_hf_dict


def _text(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not a text file (expected UTF-8 JSON)") from None


def cluster_from_upload(data: bytes, name: str) -> ClusterSpec:
    try:
        return ClusterSpec.from_json(_text(data, name), source=name)
    except RecursionError:  # json's decoder on thousands of nested brackets
        raise ValueError(f"{name}: nested too deeply to be a cluster file") from None


def model_from_upload(data: bytes, name: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json, named after the file."""
    try:
        cfg = json.loads(_text(data, name))
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise ValueError(f"{name}: nested too deeply to be a config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: expected a JSON object")
    return spec_from_hf_dict(cfg, name=os.path.splitext(name)[0] or "uploaded", source=name)

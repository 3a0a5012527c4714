"""Where GPUMix keeps its data: profiles, runs, the job queue.

Default: `data/` inside the project; override with the environment variable
`GPUMIX_DATA_DIR` (tests point it at a temporary folder).
"""
from __future__ import annotations

import os

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_DATA_DIR = "GPUMIX_DATA_DIR"


def data_dir() -> str:
    path = os.environ.get(ENV_DATA_DIR) or os.path.join(PROJECT_ROOT, "data")
    os.makedirs(path, exist_ok=True)
    return path


def sub_dir(name: str) -> str:
    path = os.path.join(data_dir(), name)
    os.makedirs(path, exist_ok=True)
    return path


def profiles_dir() -> str:
    return sub_dir("profiles")


def runs_dir() -> str:
    return sub_dir("runs")


def clusters_dir() -> str:
    return sub_dir("clusters")


def queue_db_path() -> str:
    return os.path.join(data_dir(), "queue.sqlite")

"""The run configuration: every setting of a training run except the plan, in one typed value.

`RunConfig` is validated once, when it is made (a ValueError of one line naming the field), and
every launch path takes it: the CLI (`executor launch`), the dashboard and the orchestrator build
it at the door, the local and SLURM backends (executor/backend.py) read it. The launcher writes it
into the run folder as `run.json` (RUN_FILE) beside plan.json, so a run folder says how it was run.

`optim` holds the optimizer settings as OptimConfig.to_dict() writes them (models/optim.py checks
their values; None: the defaults for the run's length); `prefill` is the JSON object every rank
gets as `--prefill` (executor/prefill.py). Torch-free: the dashboard imports it.
See docs/DESIGN.md for the run folder's files.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from contracts.jsonio import load_json_file, save_json_file

RUN_FILE = "run.json"
VAL_EVERY = 50  # the default validation interval in steps (executor/worker.py's --val-every)


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True)
class RunConfig:
    steps: int
    run_dir: str | None = None  # None: a new folder under contracts.paths.runs_dir() when the run starts
    seed: int = 0
    resume: bool = False
    checkpoint_every: int = 0  # 0: never
    corpus_dir: str | None = None  # the training data (default: the Python standard library's sources)
    tokenizer: str | None = None  # a tokenizer.json (default: bytes)
    init_from: str | None = None  # a Hugging Face model folder to start from
    optim: dict[str, Any] | None = None  # OptimConfig.to_dict(); None: the defaults for `steps`
    emulate_wan: bool = False  # every plan node a datacenter emulated here (executor/wan.py)
    emulate_links_gbps: float | None = None  # every rank in its own namespace behind links of this rate (executor/links.py)
    prefill: dict[str, Any] | None = None  # the JSON object every rank gets as --prefill
    stall_timeout_s: float | None = None  # no progress this long fails the run; None: derived from the predicted step
    keep_checkpoints: int = 0  # keep the newest N checkpoints (0: keep every one)
    overwrite: bool = False  # a used run folder is emptied first (without it or resume, refused)
    val_every: int = VAL_EVERY  # the validation loss every K steps and at the last (0: at the last only)

    def __post_init__(self) -> None:
        _check_int("steps", self.steps, 1)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("seed", self.seed, 0)
        _check_int("keep_checkpoints", self.keep_checkpoints, 0)
        _check_int("val_every", self.val_every, 0)
        for name in ("resume", "emulate_wan", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("run_dir", "corpus_dir", "tokenizer", "init_from"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a path, got {v!r}")
        g = self.emulate_links_gbps
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 100):
            raise ValueError(f"emulate_links_gbps must be a link rate in Gbit/s in (0, 100], got {g!r}")
        if g is not None and self.emulate_wan:
            raise ValueError("emulate_links_gbps and emulate_wan exclude each other: emulated datacenters shape "
                             "the links between nodes, emulated links every rank's own")
        t = self.stall_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"stall_timeout_s must be a number of seconds > 0, got {t!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: resume continues the folder's run, "
                             "overwrite empties the folder")
        for name in ("optim", "prefill"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, dict):
                raise ValueError(f"{name} must be a JSON object, got {type(v).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str = "run config") -> RunConfig:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: must be a JSON object, not {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError:  # a required field is missing
            raise ValueError(f"{where}: missing field steps") from None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, run_dir: str | None = None) -> str:
        """Write run.json into `run_dir` (default: the config's own folder); its path."""
        folder = run_dir or self.run_dir
        if folder is None:
            raise ValueError("run_dir: no run folder to write run.json into")
        path = os.path.join(folder, RUN_FILE)
        save_json_file(path, self.to_dict())
        return path

    @classmethod
    def load(cls, run_dir: str) -> RunConfig:
        """The run.json of `run_dir`; its run_dir is the folder it was read from (a moved folder)."""
        path = os.path.join(run_dir, RUN_FILE)
        d = load_json_file(path, "run config")
        if isinstance(d, dict):
            d = dict(d, run_dir=os.path.abspath(run_dir))
        return cls.from_dict(d, path)

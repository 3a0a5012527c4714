"""Logical, reshardable checkpoints: `<run_dir>/checkpoints/step_NNNNNN/`.

A checkpoint holds the logical training state, not one plan's layout: for every unit
(contracts/units.py) the flat fp32 master parameter and its AdamW moments, stored as the slices the
saving ranks owned (`shard_<p>.bin`, raw fp32, and `meta_<p>.json`, written last). Loading fills
each rank's new slice from whichever old slices overlap it, so `--resume` works on another plan
(other devices, shard fractions or ZeRO stage); another model, sequence length or global batch is
refused. `latest.json` names a step only once every position's files are whole. Slices are written
and read in place (memory-mapped), never a whole file in memory. Before a save every rank checks the
folder's free space against the checkpoint's size (`check_free_space`); a full disk, found there or
while writing, raises DiskFull naming the folder, and the previous checkpoint stays the one to resume.
With `keep` N > 0 the newest N checkpoints are kept: older ones go once latest.json names a newer one.

The file format and the save/load protocol: docs/executor.md ("Checkpoints").
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np

from contracts.plan import Plan
from contracts.specs import get_model
from contracts.units import runtime_units

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
LATEST = "latest.json"
FORMAT = "gpumix-logical-1"  # latest.json's "format": DCP checkpoints of older versions have none
FIELDS = ("master", "exp_avg", "exp_avg_sq")  # per unit, in this order in shard_<p>.bin
DTYPE = np.dtype("<f4")  # fp32 masters and moments, little-endian on disk whatever the host
STEP_DIR = re.compile(r"step_(\d+)$")
# a save's bytes beyond the shards: every position's meta (a few kB per unit) and latest.json
META_MARGIN_BYTES = 4 * 2**20


class DiskFull(OSError):
    """No room for a checkpoint: found before the save, or ENOSPC while writing it."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:  # the message alone: it becomes the run's failure reason
        return self.strerror


class CheckpointIncomplete(RuntimeError):
    """Position 0 does not see every position's files: latest.json does not name the save."""


def checkpoint_bytes(plan: Plan) -> int:
    """The bytes one checkpoint of `plan` takes, every position's together: each unit's master and
    two AdamW moments once (the positions' slices tile the units), fp32, plus the metas."""
    return sum(plan_units(plan).values()) * len(FIELDS) * DTYPE.itemsize + META_MARGIN_BYTES


def check_free_space(run_dir: str, need_bytes: int, step: int) -> None:
    """DiskFull when the checkpoint folder's filesystem has less than `need_bytes` free."""
    folder = os.path.join(run_dir, CKPT_DIR)
    free = shutil.disk_usage(folder if os.path.isdir(folder) else run_dir).free
    if free < need_bytes:
        raise DiskFull(f"disk full: the checkpoint of step {step} needs {need_bytes / 2**20:.1f} MiB "
                       f"in {folder}, {free / 2**20:.1f} MiB free (the previous checkpoint is kept)")


def shard_path(ckpt_path: str, position: int) -> str:
    return os.path.join(ckpt_path, f"shard_{position}.bin")


def meta_path(ckpt_path: str, position: int) -> str:
    return os.path.join(ckpt_path, f"meta_{position}.json")


def plan_units(plan: Plan) -> dict[str, int]:
    """{unit name: numel} of the plan's model, in forward order."""
    return {u.name: u.numel for u in runtime_units(get_model(plan.model))}


def plan_fingerprint(plan: Plan) -> str:
    """A short hash of the layout a checkpoint was saved under (devices, fractions, stage): it
    tells a resharding resume from a same-plan one in the logs; it never refuses a resume."""
    layout = {"devices": [a.type for a in plan.used], "shard_fractions": [a.shard_fraction for a in plan.used],
              "zero": plan.zero, "dtype": plan.dtype}
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()[:16]


def checkpoint_meta(plan: Plan, step: int, path: str) -> dict[str, Any]:
    """What latest.json says about the checkpoint of `step` saved under `plan` at `path`."""
    return {"format": FORMAT, "step": step, "path": path, "model": plan.model, "global_batch": plan.global_batch,
            "seq": plan.seq, "num_positions": len(plan.used), "units": plan_units(plan),
            "shard_fractions": [a.shard_fraction for a in plan.used], "zero": plan.zero,
            "plan_fingerprint": plan_fingerprint(plan)}


def latest(run_dir: str) -> dict[str, Any] | None:
    """The newest complete checkpoint's metadata, or None."""
    try:
        with open(os.path.join(run_dir, CKPT_DIR, LATEST), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None


def _require_latest(run_dir: str) -> dict[str, Any]:
    meta = latest(run_dir)
    if meta is None:
        raise ValueError(f"cannot resume: no checkpoint in {os.path.join(run_dir, CKPT_DIR)}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"cannot resume: the checkpoint's format {meta.get('format')!r} is not {FORMAT!r} "
                         f"(written by an older GPUMix)")
    return meta


def _units_mismatch(saved: dict[str, int], want: dict[str, int]) -> str | None:
    """One phrase naming the first difference between two unit layouts, or None."""
    if list(saved) != list(want):
        extra, missing = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
        return f"units {len(saved)} vs {len(want)} (checkpoint only: {extra or '-'}, plan only: {missing or '-'})"
    for name, numel in saved.items():
        if numel != want[name]:
            return f"unit {name!r} has {numel} parameters in the checkpoint, {want[name]} in the plan"
    return None


def check_resumable(run_dir: str, plan: Plan) -> dict[str, Any]:
    """The checkpoint to resume `plan` from; ValueError (one line, naming the key and both values)
    when there is none or it cannot continue under this plan. Other devices, shard fractions or
    ZeRO stage are fine: load() reshards."""
    meta = _require_latest(run_dir)
    for key, want in (("global_batch", plan.global_batch), ("seq", plan.seq)):
        if meta.get(key) != want:
            raise ValueError(f"cannot resume: the checkpoint's {key} {meta.get(key)!r} differs from the plan's "
                             f"{want!r} (the data order depends on it)")
    diff = _units_mismatch(meta["units"], plan_units(plan))
    if diff is not None:
        raise ValueError(f"cannot resume: the checkpoint's model {meta.get('model')!r} differs from the plan's "
                         f"{plan.model!r}: {diff}")
    if meta.get("plan_fingerprint") != plan_fingerprint(plan):
        log.info("resuming step %d on another layout: %d positions %s -> %d positions %s (resharding)",
                 meta["step"], meta["num_positions"], meta.get("shard_fractions"), len(plan.used),
                 [a.shard_fraction for a in plan.used])
    return meta


# ---- save --------------------------------------------------------------------------------


def _write_atomic_json(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _host_array(t: Any) -> np.ndarray:
    """The tensor's values as a contiguous little-endian fp32 array (no copy for a CPU fp32 tensor)."""
    arr = t.detach().to("cpu").contiguous().numpy()
    return np.ascontiguousarray(arr, dtype=DTYPE)


def _write_shard(ckpt_path: str, runtime: Any, position: int) -> list[dict[str, Any]]:
    """shard_<p>.bin, fsynced; returns the per-unit bounds and byte offsets for the meta."""
    units, offset = [], 0
    tmp = f"{shard_path(ckpt_path, position)}.tmp"
    with open(tmp, "wb") as fh:
        for u in runtime.units:
            if not 0 <= u.start <= u.end <= u.numel:
                raise ValueError(f"unit {u.name!r}: slice [{u.start}, {u.end}) is not inside [0, {u.numel})")
            entry: dict[str, Any] = {"name": u.name, "numel": u.numel, "start": u.start, "end": u.end, "offsets": {}}
            for field in FIELDS:
                arr = _host_array(getattr(u, field))
                if arr.shape != (u.end - u.start,):
                    raise ValueError(f"unit {u.name!r}: {field} has shape {tuple(arr.shape)}, the slice "
                                     f"[{u.start}, {u.end}) needs ({u.end - u.start},)")
                entry["offsets"][field] = offset
                arr.tofile(fh)
                offset += arr.nbytes
            units.append(entry)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, shard_path(ckpt_path, position))
    return units


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        import torch.distributed as dist

        dist.barrier()


def _complete(ckpt_path: str, step: int, num_positions: int, fingerprint: str) -> list[int]:
    """Positions whose meta for this save is missing (empty: the checkpoint is whole)."""
    missing = []
    for q in range(num_positions):
        try:
            with open(meta_path(ckpt_path, q), encoding="utf-8") as fh:
                m = json.load(fh)
        except (OSError, json.JSONDecodeError):
            missing.append(q)
            continue
        if (m.get("step"), m.get("num_positions"), m.get("plan_fingerprint")) != (step, num_positions, fingerprint):
            missing.append(q)  # a stale file of another attempt at this step
    return missing


def _all_agree(ok: bool) -> bool:
    """Whether every rank says ok (a collective under torch.distributed; else `ok`): a save refused on
    one rank must be refused on all, or the others wait in its barriers forever."""
    if not _distributed():
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(run_dir: str, runtime: Any, position: int, step: int, plan: Plan, keep: int = 0) -> str:
    """Write this position's shard and meta for `step`; collective (every rank calls it). Position 0
    names the checkpoint in latest.json once every position's files are complete, then removes the
    checkpoints older than the newest `keep` (0: none). Without torch.distributed (one process saving
    for several positions, as tests do) whichever call completes the set writes latest.json.
    DiskFull (every rank alike) when the folder lacks the room: the save is not started. Returns the
    checkpoint folder."""
    run_dir = os.path.abspath(run_dir)
    os.makedirs(os.path.join(run_dir, CKPT_DIR), exist_ok=True)
    path = os.path.join(run_dir, CKPT_DIR, f"step_{step:06d}")
    try:
        check_free_space(run_dir, checkpoint_bytes(plan) - _bytes_in(path), step)
        room = None
    except DiskFull as e:
        room = e
    if not _all_agree(room is None):
        raise room or DiskFull(f"disk full: another rank has no room for the checkpoint of step {step}")
    meta = checkpoint_meta(plan, step, path)
    try:
        os.makedirs(path, exist_ok=True)
        units = _write_shard(path, runtime, position)
        _write_atomic_json(meta_path(path, position), {
            "step": step, "position": position, "num_positions": meta["num_positions"],
            "plan_fingerprint": meta["plan_fingerprint"], "dtype": DTYPE.str, "units": units,
            "scalar_state": runtime.scalar_state()})
    except OSError as e:
        # numpy's tofile reports a full disk as a short write, without errno
        if e.errno != errno.ENOSPC and shutil.disk_usage(path).free > META_MARGIN_BYTES:
            raise
        _remove_position(path, position)  # room for the store and the logs to say what happened
        raise DiskFull(f"disk full while writing the checkpoint of step {step} to {path}: "
                       f"{e.strerror or e} (the previous checkpoint is kept)") from None
    _barrier()  # every rank's meta is on disk before position 0 looks
    distributed = _distributed()
    incomplete = None
    if position == 0 or not distributed:
        missing = _complete(path, step, meta["num_positions"], meta["plan_fingerprint"])
        if not missing:
            _write_atomic_json(os.path.join(run_dir, CKPT_DIR, LATEST), meta)
            log.info("checkpoint of step %d saved to %s", step, path)
            if keep > 0:
                prune(run_dir, keep)
        elif distributed:
            incomplete = CheckpointIncomplete(f"checkpoint of step {step}: positions {missing} wrote no complete "
                                              f"meta in {path} (a run folder not shared by every node?)")
    _barrier()  # nobody goes on (and maybe dies) before latest.json names this checkpoint
    if incomplete is not None:  # raised past the barrier: the other ranks are not left waiting in it
        raise incomplete
    return path


def _bytes_in(folder: str) -> int:
    """Bytes of the files already in `folder` (a retried save overwrites them in place)."""
    if not os.path.isdir(folder):
        return 0
    with os.scandir(folder) as entries:
        return sum(e.stat().st_size for e in entries if e.is_file())


def _remove_position(path: str, position: int) -> None:
    for f in (shard_path(path, position), f"{shard_path(path, position)}.tmp", meta_path(path, position),
              f"{meta_path(path, position)}.tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)


def saved_steps(run_dir: str) -> list[int]:
    """The steps of the checkpoint folders in the run folder (whole or not), ascending."""
    try:
        names = os.listdir(os.path.join(run_dir, CKPT_DIR))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m)


def prune(run_dir: str, keep: int) -> list[int]:
    """Remove the checkpoints older than the newest `keep` up to the one latest.json names (never that
    one, never a newer folder: a save in progress); the steps removed."""
    meta = latest(run_dir)
    if meta is None or keep < 1:
        return []
    newest = int(meta["step"])
    older = [s for s in saved_steps(run_dir) if s <= newest]
    gone = older[:-keep] if len(older) > keep else []
    for s in gone:
        shutil.rmtree(os.path.join(run_dir, CKPT_DIR, f"step_{s:06d}"), ignore_errors=True)
    if gone:
        log.info("checkpoints of steps %s removed (keeping the newest %d)", gone, keep)
    return gone


# ---- load --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slice:
    unit: str
    position: int
    start: int
    end: int
    offsets: dict[str, int]


class _ShardReader:
    """The old shards, memory-mapped on first use: a position whose slices overlap none of this
    rank's is never opened. `read` returns a view of the mapped file (no bytes read yet)."""

    def __init__(self, ckpt_path: str) -> None:
        self.ckpt_path = ckpt_path
        self._maps: dict[int, np.memmap] = {}

    def read(self, s: _Slice, field: str, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of the unit (global indices, inside the old slice s) of `field`."""
        mm = self._maps.get(s.position)
        if mm is None:
            # mode "c" (copy-on-write): a writable view for torch.from_numpy; the file never changes
            mm = self._maps[s.position] = np.memmap(shard_path(self.ckpt_path, s.position), dtype=DTYPE, mode="c")
        first = s.offsets[field] // DTYPE.itemsize + (lo - s.start)
        return mm[first:first + (hi - lo)]


def _old_layout(ckpt_path: str, num_positions: int) -> tuple[dict[str, list[_Slice]], dict[str, Any]]:
    """{unit: old slices sorted by start}, checked to tile [0, numel); and old position 0's scalar state."""
    slices: dict[str, list[_Slice]] = {}
    numels: dict[str, int] = {}
    scalar: dict[str, Any] = {}
    for q in range(num_positions):
        with open(meta_path(ckpt_path, q), encoding="utf-8") as fh:
            m = json.load(fh)
        if q == 0:
            scalar = m["scalar_state"]
        for u in m["units"]:
            numels[u["name"]] = u["numel"]
            slices.setdefault(u["name"], []).append(_Slice(u["name"], q, u["start"], u["end"], u["offsets"]))
    for name, parts in slices.items():
        parts.sort(key=lambda s: s.start)
        edge = 0
        for s in parts:
            if s.start != edge:
                raise ValueError(f"checkpoint {ckpt_path}: unit {name!r} slices do not tile [0, {numels[name]}) "
                                 f"(position {s.position} starts at {s.start}, expected {edge})")
            edge = s.end
        if edge != numels[name]:
            raise ValueError(f"checkpoint {ckpt_path}: unit {name!r} slices end at {edge}, not {numels[name]}")
    return slices, scalar


def load(run_dir: str, runtime: Any, position: int) -> int:
    """Fill `runtime`'s slices (in place) from the newest checkpoint, whatever plan saved it; load
    its scalar state; call runtime.after_load() (collective); return the checkpoint's step."""
    import torch

    meta = _require_latest(run_dir)
    path = os.path.join(os.path.abspath(run_dir), CKPT_DIR, os.path.basename(meta["path"]))
    if not os.path.isdir(path):  # a run folder that was moved keeps its step folders beside latest.json
        path = meta["path"]
    diff = _units_mismatch(meta["units"], {u.name: u.numel for u in runtime.units})
    if diff is not None:
        raise ValueError(f"cannot load {path} into this model: {diff}")
    slices, scalar = _old_layout(path, int(meta["num_positions"]))
    reader = _ShardReader(path)
    for u in runtime.units:
        for s in slices[u.name]:
            lo, hi = max(s.start, u.start), min(s.end, u.end)
            if lo >= hi:
                continue
            for field in FIELDS:
                dest = getattr(u, field)
                src = torch.from_numpy(reader.read(s, field, lo, hi))
                with torch.no_grad():
                    dest[lo - u.start:hi - u.start].copy_(src)
    runtime.load_scalar_state(scalar)
    runtime.after_load()
    log.info("position %d loaded the checkpoint of step %d from %s (%d old positions)", position, meta["step"],
             path, meta["num_positions"])
    return int(meta["step"])

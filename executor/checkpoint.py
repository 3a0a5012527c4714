"""Logical, reshardable checkpoints: `<run_dir>/checkpoints/step_NNNNNN/`.

A checkpoint holds the logical training state, not one plan's layout: for every unit
(contracts/units.py) the flat fp32 master parameter and its AdamW moments, stored as the slices the
saving ranks owned (`shard_<p>.bin`, raw fp32, and `meta_<p>.json`, written last). Loading fills
each rank's new slice from whichever old slices overlap it, so `--resume` works on another plan
(other devices, shard fractions or ZeRO stage); another model, sequence length or global batch is
refused. Slices are read in place (memory-mapped), never a whole file in memory.

A save is written into `step_NNNNNN.tmp/`; once every position's files are there and fsynced,
position 0 renames the folder to `step_NNNNNN/` and then names it in `latest.json` (the commit):
`--resume` reads only the checkpoint latest.json names, so a save cut short (a rank killed, a full
disk) loses nothing committed before it; its leftovers are removed at the next start
(`remove_uncommitted`). `AsyncSaver` (the worker's) copies the rank's slices to host memory on the
calling thread, then writes and commits on a background thread while training goes on: one save in
flight per rank, so one host copy of the rank's shard at a time. `save` does the same in one call.

Before a save every rank checks the folder's free space against the checkpoint's size
(`check_free_space`); a full disk, found there or while writing, raises DiskFull naming the folder,
and the previous checkpoint stays the one to resume. With `keep` N > 0 the newest N checkpoints are
kept: older ones go once latest.json names a newer one.

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
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
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
STEP_DIR = re.compile(r"step_(\d+)$")  # a committed (or, newer than latest.json, uncommitted) checkpoint
TMP_SUFFIX = ".tmp"  # step_NNNNNN.tmp/: a save being written, never read by a resume
TMP_DIR = re.compile(r"step_(\d+)\.tmp$")
# tests only (tests/e2e/test_async_checkpoint.py): "<step>:<position>" makes that position's background
# writer of that step stop halfway through its shard, write `paused_<position>` (its pid) into the
# save's folder and sleep, so a test can kill the rank while the save is in flight. Unset: no effect.
ENV_TEST_PAUSE = "GPUMIX_TEST_CHECKPOINT_PAUSE"
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


def step_folder(run_dir: str, step: int) -> str:
    """The committed checkpoint of `step` (absolute): `<run_dir>/checkpoints/step_NNNNNN`."""
    return os.path.join(os.path.abspath(run_dir), CKPT_DIR, f"step_{step:06d}")


def _write_atomic_json(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    """Make a rename or a new file in `path` durable (POSIX: the directory entry is the folder's data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class HostShard:
    """One position's part of a checkpoint, copied off the runtime: the per-unit entries of its meta
    (bounds; offsets are filled as it is written) with their fp32 host arrays, and the scalar state."""

    step: int
    position: int
    units: list[tuple[dict[str, Any], tuple[np.ndarray, ...]]] = field(default_factory=list)
    scalar_state: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, arrays in self.units for a in arrays)


def _host_copy(t: Any) -> np.ndarray:
    """A private contiguous little-endian fp32 host copy of the tensor's values: training goes on
    changing the tensor in place while the copy is written."""
    arr = t.detach().to("cpu", copy=True).contiguous().numpy()
    return np.ascontiguousarray(arr, dtype=DTYPE)


def snapshot(runtime: Any, position: int, step: int) -> HostShard:
    """This position's slices and scalar state copied to host memory (the synchronous part of a save:
    a device-to-host copy of the rank's shard, 12 bytes per parameter it owns)."""
    shard = HostShard(step, position, scalar_state=runtime.scalar_state())
    for u in runtime.units:
        if not 0 <= u.start <= u.end <= u.numel:
            raise ValueError(f"unit {u.name!r}: slice [{u.start}, {u.end}) is not inside [0, {u.numel})")
        arrays = tuple(_host_copy(getattr(u, f)) for f in FIELDS)
        for f, arr in zip(FIELDS, arrays):
            if arr.shape != (u.end - u.start,):
                raise ValueError(f"unit {u.name!r}: {f} has shape {tuple(arr.shape)}, the slice "
                                 f"[{u.start}, {u.end}) needs ({u.end - u.start},)")
        shard.units.append(({"name": u.name, "numel": u.numel, "start": u.start, "end": u.end}, arrays))
    return shard


def _test_pause(folder: str, shard: HostShard) -> None:
    """ENV_TEST_PAUSE (tests only): stop this save halfway, say so in the folder, sleep until killed."""
    want = os.environ.get(ENV_TEST_PAUSE)
    if not want or want != f"{shard.step}:{shard.position}":
        return
    with open(os.path.join(folder, f"paused_{shard.position}"), "w", encoding="utf-8") as fh:
        fh.write(str(os.getpid()))
    log.warning("%s=%s: the checkpoint writer of step %d pauses mid-save", ENV_TEST_PAUSE, want, shard.step)
    time.sleep(3600)


def _write_shard(folder: str, shard: HostShard) -> list[dict[str, Any]]:
    """shard_<p>.bin, fsynced; returns the per-unit bounds and byte offsets for the meta."""
    units, offset = [], 0
    tmp = f"{shard_path(folder, shard.position)}.tmp"
    with open(tmp, "wb") as fh:
        for i, (bounds, arrays) in enumerate(shard.units):
            if i == len(shard.units) // 2:
                fh.flush()
                _test_pause(folder, shard)
            entry = dict(bounds, offsets={})
            for f, arr in zip(FIELDS, arrays):
                entry["offsets"][f] = offset
                arr.tofile(fh)
                offset += arr.nbytes
            units.append(entry)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, shard_path(folder, shard.position))
    return units


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _barrier(group: Any = None) -> None:
    if _distributed():
        import torch.distributed as dist

        dist.barrier(group=group)


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


def _all_agree(ok: bool, group: Any = None) -> bool:
    """Whether every rank says ok (a collective under torch.distributed; else `ok`): a save refused on
    one rank must be refused on all, or the others wait in its barriers forever."""
    if not _distributed():
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def prepare(run_dir: str, step: int, plan: Plan) -> None:
    """The free-space check before a save, agreed by every rank (collective): DiskFull on every rank
    alike when any lacks the room; nothing is written then."""
    os.makedirs(os.path.join(os.path.abspath(run_dir), CKPT_DIR), exist_ok=True)
    tmp = step_folder(run_dir, step) + TMP_SUFFIX
    try:
        check_free_space(run_dir, checkpoint_bytes(plan) - _bytes_in(tmp), step)
        room = None
    except DiskFull as e:
        room = e
    if not _all_agree(room is None):
        raise room or DiskFull(f"disk full: another rank has no room for the checkpoint of step {step}")


def _commit(run_dir: str, tmp: str, meta: dict[str, Any], keep: int) -> None:
    """Rename the whole save's folder to its step folder, then name it in latest.json (the commit)."""
    final = meta["path"]
    if os.path.isdir(final):  # an uncommitted leftover of an earlier attempt (renamed, latest.json not written)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    _write_atomic_json(os.path.join(os.path.abspath(run_dir), CKPT_DIR, LATEST), meta)
    _fsync_dir(os.path.dirname(final))
    log.info("checkpoint of step %d saved to %s", meta["step"], final)
    if keep > 0:
        prune(run_dir, keep)


def write_and_commit(run_dir: str, shard: HostShard, plan: Plan, keep: int = 0, group: Any = None) -> str:
    """Write this position's part of the save into `step_NNNNNN.tmp/` (fsynced), agree with every rank
    (collective on `group`) that all parts are written, and let position 0 commit. Without
    torch.distributed (one process saving for several positions, as tests do) whichever call completes
    the set commits. DiskFull on every rank when one ran out of room while writing; CheckpointIncomplete
    on position 0 when it does not see every position's files. The committed folder, or the .tmp one
    while the set is not complete (no torch.distributed)."""
    meta = checkpoint_meta(plan, shard.step, step_folder(run_dir, shard.step))
    tmp = meta["path"] + TMP_SUFFIX
    failed: BaseException | None = None
    try:
        os.makedirs(tmp, exist_ok=True)
        units = _write_shard(tmp, shard)
        _write_atomic_json(meta_path(tmp, shard.position), {
            "step": shard.step, "position": shard.position, "num_positions": meta["num_positions"],
            "plan_fingerprint": meta["plan_fingerprint"], "dtype": DTYPE.str, "units": units,
            "scalar_state": shard.scalar_state})
        _fsync_dir(tmp)
    except OSError as e:
        # numpy's tofile reports a full disk as a short write, without errno
        if e.errno != errno.ENOSPC and shutil.disk_usage(tmp if os.path.isdir(tmp) else run_dir).free > META_MARGIN_BYTES:
            failed = e
        else:
            _remove_position(tmp, shard.position)  # room for the store and the logs to say what happened
            failed = DiskFull(f"disk full while writing the checkpoint of step {shard.step} to {tmp}: "
                              f"{e.strerror or e} (the previous checkpoint is kept)")
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks first, raised below
        failed = e
    if not _all_agree(failed is None, group):  # every rank's part is on disk before position 0 looks
        raise failed or DiskFull(f"another rank could not write its part of the checkpoint of step {shard.step} "
                                 f"(the previous checkpoint is kept)")
    distributed = _distributed()
    refused: BaseException | None = None
    path = tmp
    if shard.position == 0 or not distributed:
        missing = _complete(tmp, shard.step, meta["num_positions"], meta["plan_fingerprint"])
        if not missing:
            try:
                _commit(run_dir, tmp, meta, keep)
                path = meta["path"]
            except OSError as e:
                refused = e
        elif distributed:
            refused = CheckpointIncomplete(f"checkpoint of step {shard.step}: positions {missing} wrote no "
                                           f"complete meta in {tmp} (a run folder not shared by every node?)")
    _barrier(group)  # nobody reports the save done before latest.json names it
    if refused is not None:  # raised past the barrier: the other ranks are not left waiting in it
        raise refused
    return meta["path"] if distributed else path


def save(run_dir: str, runtime: Any, position: int, step: int, plan: Plan, keep: int = 0) -> str:
    """Save `step` and return when it is committed (or, without torch.distributed, written): the
    free-space check, the host copy, the write and the commit in one call; collective (every rank
    calls it). AsyncSaver does the same with the write in the background. Returns the folder."""
    prepare(run_dir, step, plan)
    return write_and_commit(run_dir, snapshot(runtime, position, step), plan, keep)


class AsyncSaver:
    """One rank's checkpoints, written while training goes on. `start` (collective, every rank at the
    same step) waits for the previous save (one host copy of the shard at a time), checks the room,
    copies the slices to host memory and returns; a background thread writes them and joins the other
    ranks' threads on a process group of its own (gloo, made at the first save) to commit. `wait`
    blocks until the save in flight is committed and raises its failure (DiskFull,
    CheckpointIncomplete, ...) on the calling thread."""

    def __init__(self, run_dir: str, position: int, plan: Plan, keep: int = 0,
                 timeout: timedelta | None = None) -> None:
        self.run_dir, self.position, self.plan, self.keep, self.timeout = run_dir, position, plan, keep, timeout
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None  # the save in flight, or the last one waited for

    def start(self, runtime: Any, step: int) -> None:
        self.wait()
        prepare(self.run_dir, step, self.plan)
        shard = snapshot(runtime, self.position, step)
        if self._group is None and _distributed():
            import torch.distributed as dist

            # collective (every rank makes it at its first save); gloo: CPU barriers off the training's stream
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.step = step
        self._thread = threading.Thread(target=self._write, args=(shard,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _write(self, shard: HostShard) -> None:
        try:
            write_and_commit(self.run_dir, shard, self.plan, self.keep, self._group)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


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
    """The steps of the renamed (whole) checkpoint folders in the run folder, ascending; saves still
    being written (`step_NNNNNN.tmp/`) are not among them."""
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


def remove_uncommitted(run_dir: str) -> list[str]:
    """Remove what saves cut short left (a start's cleaning, before anything is saved): every
    `step_NNNNNN.tmp/`, and step folders newer than the one latest.json names (renamed, never
    committed). The names removed, logged."""
    root = os.path.join(run_dir, CKPT_DIR)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    meta = latest(run_dir)
    newest = int(meta["step"]) if meta is not None else -1
    gone = []
    for name in names:
        done = STEP_DIR.match(name)
        if TMP_DIR.match(name) or (done and int(done.group(1)) > newest):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    if gone:
        log.info("uncommitted checkpoint folders removed from %s: %s (a save cut short; the committed "
                 "checkpoint is %s)", root, gone, f"step {newest}" if meta is not None else "none")
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

"""Checks before a run starts: a plan and its RunConfig against this machine.

Every check raises a one-line ValueError saying what to change, before any rank starts and before
anything is written to the run folder's store: the plan's devices exist here (`check_devices`),
a plan on several nodes runs here only as emulated datacenters (`check_emulate_wan`), emulated
links need a one-node CPU plan of at least 2 ranks and root (`check_emulate_links`), the
`init_from` folder holds the plan's model (`check_init_from`), the run folder has no live run
(`check_not_running`) and no earlier run unless resumed or overwritten (`check_folder_reuse`), a
multi-node run keeps SQLite off a network filesystem (`check_store_safe`), a tensor-parallel plan asks
only for what the TP runtime runs (`check_tensor_parallel`). The plan's own fields
are checked when it is read (contracts/plan.py), the settings' (steps, seed, ...) by RunConfig
(contracts/run.py); `check_run` and `check_local` are what the backends call (executor/backend.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import replace

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import booking, links, netns, wan
from executor.rank_commands import plan_nodes
from executor.checkpoint import CKPT_DIR
from executor.store import has_run, read_metrics, read_run_row

# filesystems every node of a cluster may mount, where SQLite's locks and WAL index do not work
# (sqlite.org/wal.html: "WAL does not work over a network filesystem")
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
                       "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "9p", "afs", "panfs", "wekafs", "orangefs")


def runs_here(plan: Plan) -> bool:
    """A plan on one node (whatever it is called), or on nodes all of which are this machine."""
    nodes = plan_nodes(plan)
    return len(nodes) <= 1 or all(booking.is_local_node(n) for n in nodes)


def cuda_device_count() -> int:
    """CUDA devices visible here; torch is imported only when a plan asks for a GPU."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(plan: Plan) -> None:
    """Before any rank starts: the plan's node is this machine and its GPUs exist. CPU workers may
    outnumber the cores (oversubscribed ranks are slow, not wrong)."""
    nodes = plan_nodes(plan)
    if len(nodes) == 1 and not booking.is_local_node(nodes[0]):
        raise ValueError(f"plan runs on node {nodes[0]!r}, this machine is {socket.gethostname()!r}: run the "
                         "launch on that node (or plan for 'localhost')")
    gpus = [a for a in plan.used if a.type != "cpu"]
    if gpus:
        have = cuda_device_count()
        for local_rank, a in enumerate(gpus):
            if local_rank >= have:
                raise ValueError(f"plan device {a.device_index} ({a.type}) needs CUDA device {local_rank}, this "
                                 f"machine has {have} CUDA device(s)")


def check_emulate_wan(plan: Plan) -> None:
    """An emulated-datacenter run (executor/wan.py) can run here (ValueError saying why not)."""
    nodes = plan_nodes(plan)
    if len(nodes) < 2:
        raise ValueError(f"--emulate-wan: the plan's used devices sit on one node ({', '.join(nodes)}); emulated "
                         "datacenters need devices on at least 2 nodes (each node is one datacenter)")
    gpus = sorted({a.type for a in plan.used if a.type != "cpu"})
    if gpus:
        raise ValueError(f"--emulate-wan runs CPU ranks only (the plan uses {', '.join(gpus)}): NCCL between GPUs of "
                         "one machine takes shared memory or NVLink, past the emulated links")
    why = wan.unavailable_reason() or _store_unreachable_from_namespaces()
    if why is not None:
        raise ValueError(f"--emulate-wan: {why}")


def check_emulate_links(plan: Plan, gbps: float) -> None:
    """An emulated-links run (executor/links.py: a namespace per rank) can run here (ValueError
    saying why not)."""
    links.check_gbps(gbps)
    if not runs_here(plan):
        raise ValueError(f"--emulate-links runs every rank on this machine; the plan spans nodes "
                         f"{', '.join(plan_nodes(plan))} (emulate datacenters with --emulate-wan instead)")
    if len(plan.used) < 2:
        raise ValueError(f"--emulate-links: the plan uses {len(plan.used)} device; links join at least 2 ranks")
    gpus = sorted({a.type for a in plan.used if a.type != "cpu"})
    if gpus:
        raise ValueError(f"--emulate-links runs CPU ranks only (the plan uses {', '.join(gpus)}): NCCL between GPUs "
                         "of one machine takes shared memory or NVLink, past the emulated links")
    why = netns.unavailable_reason() or _store_unreachable_from_namespaces("emulated links")
    if why is not None:
        raise ValueError(f"--emulate-links: {why}")


def _store_unreachable_from_namespaces(where: str = "emulated datacenters") -> str | None:
    """Why the ranks inside emulated datacenters or links could not write the run store, or None. Their
    namespaces reach no network outside them; a file (SQLite) or a Unix socket is not networked."""
    import urllib.parse

    from executor import db

    url = db.configured()
    if url is None or url.dialect != "postgresql":
        return None
    u = urllib.parse.urlsplit(url.target)
    host = (urllib.parse.parse_qs(u.query).get("host") or [u.hostname or ""])[0]
    if not host or host.startswith("/"):
        return None
    return (f"the ranks inside the {where} reach no network outside them, so not the PostgreSQL "
            f"store at {host} ({db.ENV_DB}); use the embedded store (unset {db.ENV_DB}) or a Unix-socket URL "
            "(postgresql://user@/db?host=/var/run/postgresql)")


def check_init_from(plan: Plan, init_from: str | None) -> str | None:
    """The absolute Hugging Face folder to start from, refused (ValueError) when its config is not the
    plan's model: the weights must fill exactly the model the plan was made for."""
    if init_from is None:
        return None
    from contracts.specs import get_model

    folder = os.path.abspath(init_from)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"--init-from {init_from}: no config.json in that folder (a Hugging Face model folder)")
    want, got = get_model(plan.model), get_model(os.path.join(folder, "config.json"))
    if replace(want, name="") != replace(got, name=""):
        raise ValueError(f"--init-from {init_from}: its config describes another model than the plan's "
                         f"{plan.model!r} ({got.num_params:,} vs {want.num_params:,} parameters); plan with "
                         f"--model {os.path.join(folder, 'config.json')}")
    return folder


def check_tensor_parallel(plan: Plan, *, init_from: str | None = None, resume: bool = False,
                          checkpoint_every: int = 0) -> None:
    """A plan with tp > 1 (docs/executor.md "Tensor-parallel plans"): one TP degree for every group, zero 1,
    and none of what a TP runtime cannot do yet: start from Hugging Face weights, or write and read
    checkpoints (their logical format has no TP layout). One-line ValueError saying why; the worker
    asks the same of a multi-node run started without the launcher."""
    degrees = sorted({a.tp for a in plan.used})
    if degrees == [1]:
        return
    if len(degrees) > 1:
        raise ValueError(f"the plan's TP groups have degrees {', '.join(map(str, degrees))}: the runtime runs one TP "
                         "degree for every group; re-plan with one --max-tp")
    t = degrees[0]
    if plan.zero != 1:
        raise ValueError(f"a tensor-parallel plan (tp {t}) runs at zero 1 only, this one says zero {plan.zero}: the "
                         "zero 2/3 step scatters the embedding's gradient by token id into the full vocabulary, "
                         "which a vocabulary-parallel embedding does not hold; re-plan with --zero 1")
    if init_from is not None:
        raise ValueError(f"--init-from: a tensor-parallel plan (tp {t}) cannot start from Hugging Face weights yet "
                         "(the TP runtime has no load of them); start from random weights or plan with tp 1")
    if resume or checkpoint_every:
        flag = "--resume" if resume else "--checkpoint-every"
        raise ValueError(f"{flag}: a tensor-parallel plan (tp {t}) writes no checkpoints yet (their format has no "
                         "TP layout), so it can neither save nor resume one; run it without checkpoints")


def check_diloco(plan: Plan, *, resume: bool, checkpoint_every: int | None) -> None:
    """A DiLoCo plan's run cannot checkpoint or resume: ValueError naming the option."""
    if plan.diloco is None:
        return
    for flag, value in (("--resume", resume), ("--checkpoint-every", checkpoint_every)):
        if value:
            raise ValueError(f"{flag}: a DiLoCo plan's run writes no checkpoint (its outer state, the synced "
                             "parameters and outer momentum, has no place in the checkpoint format); run "
                             "without it")


def check_run(plan: Plan, config: RunConfig) -> RunConfig:
    """What every backend checks: the plan uses a device, `init_from` holds its model, the run folder
    holds no earlier run unless resumed or overwritten, a run on several machines keeps its SQLite
    store off a network filesystem. Returns the config with its
    paths absolute (the launcher's and the ranks' working folders differ)."""
    if not plan.used:
        raise ValueError("plan uses no device")
    check_tensor_parallel(plan, init_from=config.init_from, resume=config.resume,
                          checkpoint_every=config.checkpoint_every)
    check_diloco(plan, resume=config.resume, checkpoint_every=config.checkpoint_every)
    run_dir = None if config.run_dir is None else os.path.abspath(config.run_dir)
    if run_dir is not None:
        check_folder_reuse(replace(config, run_dir=run_dir))
        if not (config.emulate_wan or runs_here(plan)):
            check_store_safe(plan, run_dir)
    return replace(config, run_dir=run_dir, init_from=check_init_from(plan, config.init_from))


def check_local(plan: Plan, config: RunConfig) -> None:
    """A run on this machine: its devices are here, or its nodes are emulated datacenters here."""
    if config.emulate_links_gbps is not None:
        check_emulate_links(plan, config.emulate_links_gbps)
    if config.emulate_wan:
        check_emulate_wan(plan)  # every node is emulated here, whatever it is called
        return
    if not runs_here(plan):
        raise ValueError(f"plan spans nodes {', '.join(plan_nodes(plan))}: run `python -m executor launch` "
                         "to print the per-node torchrun commands, or emulate them here with --emulate-wan")
    check_devices(plan)


def check_not_running(run_dir: str) -> None:
    """ValueError when the run folder holds a run whose launcher (not ours, nor our parent) still runs."""
    if has_run(run_dir):
        with contextlib.suppress(ValueError):
            m = read_metrics(run_dir)
            # start_run (our parent) writes the row before we run: that one is ours
            if m["status"] == "running" and m["launcher_pid"] not in (os.getpid(), os.getppid()):
                raise ValueError(f"run folder {run_dir} has a running run (launcher pid {m['launcher_pid']})")


def _ours(run: dict) -> bool:
    """The run row is this launch's: written by start_run (our parent) or by us, still running."""
    return run.get("status") == "running" and run.get("launcher_pid") in (os.getpid(), os.getppid())


def folder_in_use(run_dir: str) -> str | None:
    """What makes `run_dir` hold an earlier run (its metrics, its checkpoints), or None."""
    ckpts = os.path.join(run_dir, CKPT_DIR)
    if os.path.isdir(ckpts) and os.listdir(ckpts):
        return "checkpoints"
    if has_run(run_dir):
        with contextlib.suppress(ValueError):
            if _ours(read_run_row(run_dir)):
                return None
        return "metrics"
    return None


def check_folder_reuse(config: RunConfig) -> None:
    """A run folder holding an earlier run is refused unless the run resumes it or overwrites it:
    a fresh run there would wipe its metrics and keep its checkpoints, which a later resume splices.
    A live run there is refused whatever the config says."""
    check_not_running(config.run_dir)
    if config.resume or config.overwrite:
        return
    what = folder_in_use(config.run_dir)
    if what is not None:
        raise ValueError(f"run folder {config.run_dir} holds an earlier run ({what}): pass --resume to continue "
                         "it, --overwrite to replace it, or choose another --run-dir")


def filesystem_type(path: str, mounts_file: str = "/proc/mounts") -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it), or None."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(mounts_file, encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


def check_store_safe(plan: Plan, run_dir: str) -> None:
    """A run on several machines writes its store from every node: the run folder's SQLite file is
    refused when it sits on a network filesystem (SQLite's locking and WAL need one host)."""
    from executor import db

    url = db.configured()
    if len(plan_nodes(plan)) < 2 or (url is not None and url.dialect != "sqlite"):
        return
    path = run_dir if url is None else url.target  # the run folder's own file, or GPUMIX_DB's SQLite file
    kind = filesystem_type(path)
    if kind in NETWORK_FILESYSTEMS:
        raise ValueError(f"{path} is on a network filesystem ({kind}): the nodes of a multi-node run cannot share "
                         f"a SQLite store there; set {db.ENV_DB}=postgresql://... (a PostgreSQL store) or keep "
                         "the run folder on a local disk")

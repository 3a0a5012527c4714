"""Dashboard state shared between pages, kept in `st.session_state`.

Keys: "cluster" (ClusterSpec), "model" (preset name or config path), "plan" (Plan),
"run_dir" (the run being monitored). Pages read and write through these helpers
so that the keys stay in one place.
"""
from __future__ import annotations

import json
import os

import streamlit as st

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Plan

DEFAULT_MODEL = "tiny"
# the first plan a new user gets: small enough that the tiny model's step takes well under
# a second on two CPU workers, large enough to split unevenly
DEFAULT_GLOBAL_BATCH = 8


def default_local_cluster() -> ClusterSpec:
    """This machine as a cluster: one CPU worker per core (at least 2, so a
    data-parallel run is possible), replaced by the profiler's inventory when it exists."""
    try:
        from profiler.inventory import build_local_cluster  # torch import: only when the page needs it

        return build_local_cluster()
    except ImportError:
        n = max(2, min(os.cpu_count() or 2, 4))
        return ClusterSpec("local", (NodeSpec("localhost", "local", (DeviceSpec("cpu"),) * n),))


def get_cluster() -> ClusterSpec:
    if "cluster" not in st.session_state:
        st.session_state["cluster"] = default_local_cluster()
    return st.session_state["cluster"]


def set_cluster(cluster: ClusterSpec) -> None:
    st.session_state["cluster"] = cluster
    st.session_state.pop("plan", None)  # a plan belongs to one cluster


def get_model() -> str:
    return st.session_state.setdefault("model", DEFAULT_MODEL)


def set_model(model: str) -> None:
    st.session_state["model"] = model


def get_training_inputs() -> dict[str, str | None]:
    """The run's inputs chosen on the Model & memory page: `corpus_dir` (data: a folder, JSON Lines or
    token files), `tokenizer` (tokenizer.json), `init_from` (a Hugging Face model folder); None =
    the defaults (the standard library, bytes, random initialisation)."""
    return st.session_state.setdefault("training_inputs", {"corpus_dir": None, "tokenizer": None, "init_from": None})


def set_training_inputs(corpus_dir: str | None, tokenizer: str | None, init_from: str | None) -> None:
    st.session_state["training_inputs"] = {"corpus_dir": corpus_dir or None, "tokenizer": tokenizer or None,
                                           "init_from": init_from or None}


def get_plan() -> Plan | None:
    return st.session_state.get("plan")


def set_plan(plan: Plan) -> None:
    st.session_state["plan"] = plan


def clear_plan() -> None:
    """No plan in the session (a failed Compute plan): Plan and Launch show none."""
    st.session_state.pop("plan", None)


@st.cache_data(show_spinner="Computing the default plan…", max_entries=16)
def _solve_default_plan(cluster_json: str, model: str, global_batch: int, profiles_version: int) -> Plan:
    from planner.entry import plan_job

    return plan_job(ClusterSpec.from_dict(json.loads(cluster_json)), model, global_batch).plan


def get_or_default_plan() -> Plan:
    """The session's plan, else the default one (this machine, the default model and global
    batch), so that Launch works for a user who never opened Plan. Raises ValueError."""
    plan = get_plan()
    if plan is None:
        from ui.common import profiles_version

        plan = _solve_default_plan(json.dumps(get_cluster().to_dict()), get_model(), DEFAULT_GLOBAL_BATCH,
                                   profiles_version())
        set_plan(plan)
    return plan


def get_run_dir() -> str | None:
    """The run this session launched or chose to watch (None after a browser reload)."""
    return st.session_state.get("run_dir")


def set_run_dir(run_dir: str | None) -> None:
    st.session_state["run_dir"] = run_dir


def find_live_run() -> str | None:
    """The newest run whose SQLite store says "running" (its launcher is alive): how a
    reloaded page or a restarted app finds the run that kept going without it. Read on every
    call, never cached: the sidebar and the pages show one status, the store's."""
    from executor import store  # the store reader is torch-free

    for run in store.list_runs():  # newest first
        if run["status"] == "running":
            return run["run_dir"]
    return None


def devices_in_use(plan: Plan, slurm: bool = False) -> list[str]:
    """One line per other live run holding some of the plan's devices (the booking ledger, repaired
    from the processes alive): why Launch is disabled. `slurm`: the plan's devices as SLURM nodes'."""
    from executor import booking  # torch-free

    if slurm:
        from executor.slurm_job import slurm_device_keys  # torch-free

        keys = slurm_device_keys(plan)
    else:
        keys = booking.plan_device_keys(plan)
    return [f"devices {', '.join(devices)} are in use by {b.describe()}" for b, devices in booking.Ledger().conflicts(keys)]


def current_run_dir() -> str | None:
    """The run to monitor: this session's, else the live one found in the store."""
    run_dir = get_run_dir()
    if run_dir is None:
        run_dir = find_live_run()
        if run_dir is not None:
            set_run_dir(run_dir)
    return run_dir

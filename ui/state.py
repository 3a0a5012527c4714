"""Dashboard state shared between pages, kept in `st.session_state`.

Keys: "cluster" (ClusterSpec), "model" (preset name or config path), "plan" (Plan),
"run_dir" (the run being monitored). Pages read and write through these helpers
so that the keys stay in one place.
"""
from __future__ import annotations

import streamlit as st

from planner.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.plan import Plan

DEFAULT_MODEL = "tiny"


def default_local_cluster() -> ClusterSpec:
    """This machine as a cluster: one CPU worker per core (at least 2, so a
    data-parallel run is possible), replaced by the profiler's inventory when it exists."""
    try:
        from profiler.inventory import build_local_cluster  # torch import: only when the page needs it

        return build_local_cluster()
    except ImportError:
        import os

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


def get_plan() -> Plan | None:
    return st.session_state.get("plan")


def set_plan(plan: Plan) -> None:
    st.session_state["plan"] = plan

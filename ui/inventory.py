"""Inventory (the landing page): this machine's devices and what was measured on them,
"Profile now", and the cluster GPUMix plans for: edit it, upload it, save and download it.

Widgets -> one library call -> render: detection is profiler.inventory, figures come from
the profile store (planner.core.profiles), profiling is profiler.microbench.profile_machine,
cluster edits are ClusterSpec methods; the chosen cluster goes to ui/state.set_cluster.
"""
from __future__ import annotations

import os
import re

import pandas as pd
import streamlit as st

from contracts import paths
from contracts.catalog import CATALOG, CPU_TYPE, GIB
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.core.profiles import get_device_bench, load_step_profiles
from contracts.specs import PRESETS
from contracts.uploads import cluster_from_upload
from profiler.inventory import LOCAL_DATACENTER, LOCAL_NODE, build_local_cluster, detect_devices
from ui.common import (MEASURED, call_or_error, emulated_marker, fmt_bytes, fmt_cell, metric, number_field,
                       page_header, page_link, parse_upload, show_emulated_note, show_errors, show_table, source_badge)
from ui.state import get_cluster, get_model, set_cluster

DEFAULT_PROFILE_SEQ = 128
MAX_PROFILE_SEQ = 8192
MAX_ADD_COUNT = 1024
MIXED_FAST_SHARE = 1.0  # of a core
MIXED_SLOW_SHARE = 0.333  # of a core: a device about 3x slower
MIXED_SLOW_MEMORY_GB = 2.0  # and smaller


@st.cache_data(show_spinner=False)
def _local_devices() -> list[dict]:
    return [d.to_dict() for d in detect_devices()]


def _render_local_devices() -> list[str]:
    st.subheader("This machine")
    devices = _local_devices()
    show_table(pd.DataFrame([{
        "device": f"{d['kind']}:{d['index']}", "name": d["name"], "catalog type": d["catalog_type"],
        "memory": fmt_bytes(d["memory_bytes"]), "compute capability": d["compute_capability"] or "",
        "SMs": str(d["num_sms"] or ""), "cores": str(d["num_cores"] or ""),
    } for d in devices]), key="inv_devices_table")
    return sorted({d["catalog_type"] for d in devices})


def _render_measured(device_type: str) -> None:
    bench = get_device_bench(device_type)
    profiles = [p for p in load_step_profiles() if p.measured and p.device_type == device_type]
    if bench is None and not profiles:
        st.info(f"{device_type}: not profiled yet. Press **Profile now** to measure it.")
        return
    st.markdown(f"**{device_type}** — figures {source_badge(MEASURED)}")
    if bench is not None:
        cols = st.columns(3)
        ar = bench.collectives.fit("all_reduce") if bench.collectives else None
        with cols[0]:
            metric("Matmul fp32", f"{bench.best_tflops('fp32') or 0:.3g} TFLOP/s", MEASURED,
                   help=f"best n×n matmul, {bench.num_threads} thread(s), {bench.created}")
        with cols[1]:
            metric("Memory copy", f"{bench.memory_gbps:.3g} GB/s", MEASURED, help="read + write bytes per second")
        with cols[2]:
            metric("All-reduce", f"{ar.bandwidth_bytes_per_s / 1e9:.3g} GB/s" if ar else "not measured", MEASURED,
                   help=(f"{bench.collectives.world_size} ranks, {bench.collectives.backend}, latency "
                         f"{ar.latency_s * 1e6:.0f} µs" if ar else "tick 'Collectives too' or run "
                         "`python -m profiler bench`"))
    if profiles:
        show_table(pd.DataFrame([{
            "model": p.model, "seq": str(p.seq), "dtype": p.dtype, "recompute": p.recompute,
            "α (ms, measured)": f"{p.alpha_s * 1e3:.4g}", "β (ms/sample, measured)": f"{p.beta_s * 1e3:.4g}",
            "R²": fmt_cell(p.r2, lambda x: f"{x:.4f}"), "optimizer (ns/param, measured)": f"{p.optimizer_s_per_param * 1e9:.4g}",
            "achieved TFLOP/s (measured)": fmt_cell(p.achieved_tflops, lambda x: f"{x:.3g}"), "measured at": p.created,
        } for p in profiles]), key=f"inv_profiles_{device_type}")


def _render_profile_now(has_cpu_only: bool) -> None:
    models = list(PRESETS)
    current = get_model()
    c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
    model = c1.selectbox("Model to profile", models, index=models.index(current) if current in models else 0,
                         key="inv_profile_model")
    seq = number_field("Sequence length", unit="tokens", min_value=8, max_value=MAX_PROFILE_SEQ,
                       value=DEFAULT_PROFILE_SEQ, step=8, key="inv_profile_seq", where=c2)
    # a CPU trains in fp32 (bf16 there is emulated and slow); a GPU in bf16
    dtypes = ["fp32", "bf16"] if has_cpu_only else ["bf16", "fp32", "fp16"]
    dtype = c3.selectbox("Precision", dtypes, key="inv_profile_dtype")
    collectives = c4.checkbox("Collectives too (spawns 2 ranks)", value=False, key="inv_profile_collectives")
    if st.button("Profile now", key="inv_profile_now", type="primary", disabled=seq is None):
        from profiler.microbench import profile_machine  # torch: only when asked

        bar = st.progress(0.0, text="starting")
        result = call_or_error(profile_machine, model, seq, dtype, collectives=collectives,
                               progress=lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m),
                               what="Profiling failed")
        if result is not None:
            from planner.schedule.options import clear_caches  # the scheduler's cached profile figures are stale now

            clear_caches()
            _, p = result
            st.success(f"Measured {p.model} on {p.device_type}: α = {p.alpha_s * 1e3:.2f} ms, "
                       f"β = {p.beta_s * 1e3:.2f} ms/sample, R² = {p.r2:.3f}")


def _cluster_table(cluster: ClusterSpec) -> pd.DataFrame:
    rows = []
    for g in cluster.groups():
        rows.append({"node": g.node, "datacenter": g.datacenter, "device": g.device.label, "count": g.count,
                     "memory per device": fmt_bytes(g.device.memory_bytes),
                     "emulated": emulated_marker(g.device.emulated)})
    return pd.DataFrame(rows)


def cpu_memory_note(cluster: ClusterSpec) -> str | None:
    """Why this machine's RAM (inventory) and the cluster's CPU workers' memory differ."""
    workers = [d for _, d in cluster.devices() if d.type == CPU_TYPE]
    ram = sum(d["memory_bytes"] or 0 for d in _local_devices() if d["kind"] == "cpu")
    if not workers or not ram:
        return None
    planned = sum(d.memory_bytes for d in workers)
    nominal = CATALOG[CPU_TYPE].memory_bytes
    text = (f"Memory: each cpu worker is planned with the catalog's nominal {fmt_bytes(nominal)} per rank "
            f"(contracts/catalog.py) unless it has an emulated limit; the {len(workers)} workers share this "
            f"machine's {fmt_bytes(ram)} of RAM (the table above), {fmt_bytes(planned)} planned in all")
    if planned > ram:
        return text + ": more than the machine has, so plan memory-heavy runs with emulated limits that add up."
    return text + "."


def _apply_upload() -> None:
    uploaded = st.file_uploader("Upload a cluster file (JSON)", type=["json"], key="inv_upload")
    if uploaded is None:
        return
    cluster = parse_upload(uploaded, cluster_from_upload, "Cannot use this cluster file")
    if cluster is None:
        return
    # apply a given upload once: later edits must not be overwritten on every rerun
    if st.session_state.get("inv_upload_applied") != uploaded.file_id:
        st.session_state["inv_upload_applied"] = uploaded.file_id
        set_cluster(cluster)
        st.success(f"Loaded cluster {cluster.name!r} from {uploaded.name} ({cluster.num_devices} devices)")


def _render_add_devices(cluster: ClusterSpec) -> None:
    st.markdown("**Add devices**")
    c1, c2, c3, c4 = st.columns(4)
    node = c1.text_input("Node name", value="n1", key="inv_node_name")
    dc = c2.text_input("Datacenter", value="dc0", key="inv_node_dc")
    types = sorted(CATALOG, key=lambda t: (t == CPU_TYPE, t))
    gpu_type = c3.selectbox("GPU type", types, key="inv_gpu_type",
                            format_func=lambda t: f"{t} ({CATALOG[t].memory_bytes / GIB:.0f} GiB)")
    count = number_field("Count", unit="devices", min_value=1, max_value=MAX_ADD_COUNT, value=1, key="inv_gpu_count",
                         where=c4)
    e1, e2 = st.columns(2)
    slowdown = number_field("Emulated slowdown", unit="× slower, 1 = real speed", min_value=1.0, max_value=100.0,
                            value=1.0, step=0.5, key="inv_slowdown", where=e1)
    own_gib = CATALOG[gpu_type].memory_bytes / GIB
    mem_gb: float | None = None
    if e2.checkbox(f"Emulate less memory than the {gpu_type}'s {own_gib:g} GiB", value=False,
                   key=f"inv_limit_memory:{gpu_type}"):
        mem_gb = number_field("Emulated memory limit", unit="GiB", min_value=0.1, max_value=round(own_gib, 1),
                              value=round(own_gib, 1), step=1.0, key=f"inv_memory_gb:{gpu_type}", where=e2)
        if mem_gb is None:
            return
    if st.button("Add to cluster", key="inv_add_node", disabled=count is None or slowdown is None):
        with show_errors("Cannot add these devices"):
            device = DeviceSpec(gpu_type, slowdown, mem_gb)
            set_cluster(cluster.with_devices(node.strip(), dc.strip(), device, count))
            st.rerun()


def _render_cluster_files(cluster: ClusterSpec) -> None:
    st.markdown("**Cluster files**")
    c1, c2 = st.columns(2)
    name = c1.text_input("Save as", value=cluster.name, key="inv_save_name")
    if c1.button("Save cluster file", key="inv_save"):
        with show_errors("Cannot save"):
            safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name.strip())
            if not safe:
                raise ValueError("give the cluster file a name")
            path = os.path.join(paths.clusters_dir(), f"{safe}.json")
            cluster.renamed(name.strip()).save(path)
            st.success(f"Saved {path}")
    c1.download_button("Download cluster file", cluster.to_json(), file_name=f"{cluster.name}.json",
                       mime="application/json", key="inv_download")
    saved = sorted(f for f in os.listdir(paths.clusters_dir()) if f.endswith(".json"))
    choice = c2.selectbox("Saved cluster files", saved or ["(none)"], key="inv_saved")
    if c2.button("Use this file", key="inv_load", disabled=not saved):
        loaded = call_or_error(ClusterSpec.load, os.path.join(paths.clusters_dir(), choice), what="Cannot load")
        if loaded is not None:
            set_cluster(loaded)
            st.rerun()
    if c2.button("Reset to this machine", key="inv_reset_local"):
        set_cluster(build_local_cluster())
        st.rerun()


def emulated_mixed_cluster() -> ClusterSpec:
    """A mixed cluster on any machine: one CPU worker with a full core, one with a third of a
    core and less memory, each held to it by the kernel (cgroups: profiler/cgroups.py)."""
    fast = DeviceSpec(CPU_TYPE, cpu_share=MIXED_FAST_SHARE)
    slow = DeviceSpec(CPU_TYPE, cpu_share=MIXED_SLOW_SHARE, memory_gb=MIXED_SLOW_MEMORY_GB)
    return ClusterSpec("emulated-mixed", (NodeSpec(LOCAL_NODE, LOCAL_DATACENTER, (fast, slow)),))


def _render_emulated_mixed(where) -> None:
    from profiler import cgroups  # torch-free

    reason = cgroups.unavailable_reason()
    if where.button(f"Emulated mixed cluster: 1 core + {MIXED_SLOW_SHARE:g} core ({MIXED_SLOW_MEMORY_GB:g} GiB)",
                    key="inv_emulated_mixed", disabled=reason is not None, icon=":material/science:",
                    help="two CPU workers held by the kernel to one full core and a third of one (CPU quota "
                         "and memory cgroups), labelled emulated everywhere: the Plan page splits unevenly"):
        set_cluster(emulated_mixed_cluster())
        st.rerun()
    if reason is not None:
        where.caption(f"Emulated mixed cluster unavailable here: {reason}")


def _render_cluster() -> None:
    st.subheader("Cluster")
    _apply_upload()
    cluster = get_cluster()
    st.markdown(f"**{cluster.name}**: {cluster.num_devices} device(s) on {len(cluster.nodes)} node(s), "
                f"network {cluster.network.intra_node_gbps:g} Gbit/s intra-node, "
                f"{cluster.network.inter_node_gbps:g} Gbit/s inter-node")
    show_table(_cluster_table(cluster), key="inv_cluster_table")
    note = cpu_memory_note(cluster)
    if note:
        st.caption(note)
    _render_emulated_mixed(st)
    show_emulated_note(cluster.emulated)
    page_link("ui/plan.py", "Next: plan a training run on this cluster", icon=":material/account_tree:")
    nodes = [n.name for n in cluster.nodes]
    r1, r2 = st.columns([3, 1])
    gone = r1.selectbox("Node", nodes, key="inv_remove_node", label_visibility="collapsed")
    if r2.button("Remove node", key="inv_remove", disabled=len(nodes) < 2):
        with show_errors("Cannot remove"):
            set_cluster(cluster.without_node(gone))
            st.rerun()
    _render_add_devices(cluster)
    _render_cluster_files(cluster)


page_header("Inventory", "This machine's devices, what was measured on them, and the cluster GPUMix plans for.")
local_types = _render_local_devices()
_render_profile_now(local_types == [CPU_TYPE])  # before the figures, so a profile just taken shows below at once
for device_type in local_types:
    _render_measured(device_type)
st.divider()
_render_cluster()

"""Pieces the benches of emulated devices share: clusters of cgroup CPU shares, their measured
profiles, emulated links between ranks, a bench model as a config.json the planner and profiler read.

Used by bench/hetero_speedup.py and bench/sharded_runtime.py (bench/ may import anything).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PROFILE_REPEATS = 5


# ---- clusters of emulated devices ------------------------------------------------------------


def hetero_cluster(shares: Sequence[float], memory_gb: Sequence[float | None] | None = None,
                   link_gbps: float | None = None, name: str | None = None) -> Any:
    """A cluster of CPU devices under cgroup quotas of `shares` (a memory limit of `memory_gb[i]`
    GiB over the baseline where given). Without `link_gbps` all on one node; with it, one node per
    device, joined by links of `link_gbps` Gbit/s (the inter-node network the planner prices)."""
    from contracts.cluster import ClusterSpec

    memory_gb = list(memory_gb) if memory_gb is not None else [None] * len(shares)
    devices = []
    for s, m in zip(shares, memory_gb):
        d: dict[str, Any] = {"type": "cpu", "cpu_share": s}
        if m is not None:
            d["memory_gb"] = m
        devices.append(d)
    name = name or "bench-cgroups-" + "-".join(f"{s:g}" for s in shares)
    if link_gbps is None:
        return ClusterSpec.from_dict({"name": name, "nodes": [{"name": "localhost", "gpus": devices}]})
    return ClusterSpec.from_dict({"name": name, "nodes": [{"name": f"n{i}", "gpus": [d]} for i, d in enumerate(devices)],
                                  "network": {"inter_node_gbps": link_gbps, "intra_node_gbps": link_gbps}})


def parse_shares(text: str, count: int | None = None) -> tuple[float, ...]:
    """`--shares` "1,0.333": one CPU share per device (argparse.ArgumentTypeError naming the problem);
    `count`: exactly that many, else at least two."""
    import argparse

    from contracts.cluster import DeviceSpec

    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if (count is not None and len(shares) != count) or len(shares) < 2:
        raise argparse.ArgumentTypeError(f"expected {count or 'at least two'} cpu shares (one per rank), got {text!r}")
    try:
        for x in shares:
            DeviceSpec.from_dict({"type": "cpu", "cpu_share": x}, "--shares")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return shares


# ---- profiles --------------------------------------------------------------------------------


def profile_devices(model: str, seq: int, shares: Sequence[float], micro_batches: Sequence[int], *,
                    recomputes: Sequence[str] = ("none", "full"), dtype: str = "fp32",
                    repeats: int = PROFILE_REPEATS, memory_gb: Sequence[float | None] | None = None,
                    collectives: bool = False, env: dict[str, str] | None = None) -> None:
    """Each emulated device's step profile under its own limits (`python -m profiler profile`), with
    a companion under the other device's share (the run's other rank), saved to the profile store of
    $GPUMIX_DATA_DIR; with `collectives`, the gloo collectives once (`profiler bench --quick`)."""
    env = dict(env or os.environ, PYTHONPATH=ROOT)
    base = ["-m", "profiler", "profile", "--model", model, "--seq", str(seq), "--dtype", dtype, "--micro-batches",
            ",".join(map(str, micro_batches)), "--repeats", str(repeats), "--workers", str(len(shares))]
    memory_gb = list(memory_gb) if memory_gb is not None else [None] * len(shares)
    cmds = []
    for rec in recomputes:
        for i, s in enumerate(shares):
            cmd = base + ["--cpu-share", f"{s!r}", "--companion-cpu-share", f"{shares[1 - i]!r}", "--recompute", rec]
            if memory_gb[i] is not None:
                cmd += ["--memory-gb", f"{memory_gb[i]!r}"]
            cmds.append(cmd)
    if collectives:
        cmds.append(["-m", "profiler", "bench", "--quick"])
    for cmd in cmds:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def profile_devices_together(model: str, seq: int, shares: Sequence[float], micro_batches: Sequence[int], *,
                             recomputes: Sequence[str] = ("none", "full"), dtype: str = "fp32",
                             repeats: int = PROFILE_REPEATS, warmup: int = 1) -> float:
    """Each emulated device's step profile, all devices timed at once, each in its own cgroup beside
    the others' real loops (profiler.step_profile.profile_together, what the Plan page's "Profile
    now" runs), saved to the profile store of $GPUMIX_DATA_DIR; per recompute mode. Returns the
    seconds it took."""
    import time

    from profiler.step_profile import profile_together

    t0 = time.monotonic()
    for rec in recomputes:
        profile_together(model, seq, dtype, devices=[(s, None) for s in shares], micro_batches=micro_batches,
                         recompute=rec, repeats=repeats, warmup=warmup)
    return time.monotonic() - t0


def profile_rows(cluster: Any, spec: Any, seq: int, dtype: str = "fp32",
                 recomputes: Sequence[str] = ("none", "full")) -> list[dict[str, Any]]:
    """The profile the planner reads for each device kind of `cluster` (measured under its limits, or not)."""
    from planner.core.profiles import get_step_profile

    rows = []
    for rec in recomputes:
        for d in sorted({d for _, d in cluster.devices()}, key=lambda d: d.profile_key):
            p = get_step_profile(d.profile_key, spec, seq, dtype, recompute=rec)
            rows.append({"kind": d.profile_key, "recompute": rec, "measured": p.measured, "alpha_s": p.alpha_s,
                         "beta_s": p.beta_s, "optimizer_s": p.optimizer_s_per_param * spec.num_params,
                         "source": p.source})
    return rows


# ---- a bench model the planner and profiler can read -------------------------------------------


def write_gpt2_config(spec: Any, folder: str) -> str:
    """`spec` (a GPT-2 family ModelSpec) as `<folder>/<spec.name>/config.json`; returns the folder's
    path, which contracts.specs.get_model reads back as the same spec (checked)."""
    from contracts.specs import get_model

    d = os.path.join(folder, spec.name)
    os.makedirs(d, exist_ok=True)
    cfg = {"model_type": "gpt2", "n_layer": spec.num_layers, "n_embd": spec.hidden, "n_head": spec.num_heads,
           "n_inner": spec.ffn_hidden, "vocab_size": spec.vocab_size, "n_positions": spec.max_seq,
           "tie_word_embeddings": spec.tied_embeddings}
    with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    back = get_model(d)
    if back.num_params != spec.num_params:
        raise AssertionError(f"{d}: config.json reads back as {back.num_params} parameters, not {spec.num_params}")
    return d


# ---- emulated links between ranks ------------------------------------------------------------


@dataclass(frozen=True)
class RankNetwork:
    """Where rank i runs: the argument list that enters its network namespace, its address, and
    the interface gloo must use (None: the root namespace, loopback)."""

    prefixes: tuple[tuple[str, ...], ...]
    addrs: tuple[str, ...]
    gloo_ifname: str | None
    describe: tuple[str, ...]

    def exec_prefix(self, i: int) -> list[str]:
        return list(self.prefixes[i])


@contextlib.contextmanager
def emulated_links(num_ranks: int, gbps: float | None, run_id: str) -> Iterator[RankNetwork]:
    """One network namespace per rank, each joined to a hub's bridge by a veth shaped with tc tbf
    to `gbps` Gbit/s of TCP payload each way (executor/links.py builds and removes them), for the
    block; every namespace and the processes in it are removed however the block ends. `gbps`
    None: no namespaces (loopback)."""
    if gbps is None:
        yield RankNetwork(tuple(() for _ in range(num_ranks)), ("127.0.0.1",) * num_ranks, None,
                          ("no emulated links: loopback",))
        return
    from executor import links

    setup = links.create(num_ranks, gbps, run_id)
    try:
        yield RankNetwork(tuple(tuple(setup.exec_prefix(i)) for i in range(num_ranks)),
                          tuple(setup.addr(i) for i in range(num_ranks)), links.RANK_IF, tuple(setup.describe()))
    finally:
        links.remove(setup)

"""GPUMix's joint planner against Sailor (SOSP'25) on Sailor's own heterogeneous scenario.

    python bench/vs_sailor.py [--sailor-dir DIR] [--max-tp T] [--network both|flows|sailor] [--sailor-structure]
                              [--json] [--check]

Sailor's data (../shared/sailor/, read in place, never copied: its README says what each file is):
OPT-350 (24 layers + embedding + head, untied), global batch 1024, seq 2048, fp32, Adam, on A100-40 and
V100-16 nodes of 4 GPUs in one zone at the three sizes of its "heterogeneous-imbalanced" trace. For
each size GPUMix's joint search (planner/geo/scale/) plans with Sailor's measured per-layer profiles
(profiler/importer.py → planner/core/layer_profiles.py) and its measured network curves
(planner/costmodel/netcurve.py), under GPUMix's exact memory model (every rank within 90 % of 40 / 16
GiB), and prices the plan with GPUMix's pipeline simulator (planner/geo/scale/price.py). Beside it:

* `sailor_it_s`: Sailor's throughput as RECORDED in Sailor's README table (measured with Sailor's own
  planner and simulator; constants below, labelled as recorded, not computed here);
* `gpumix_it_s_sailor_pricing`: GPUMix's plan priced the way Sailor's README describes its simulator
  (like-for-like), by independent code in this file that reads Sailor's files itself: per stage the
  slowest replica's Σ(forward + backward) at its rows and TP degree, per pipeline (m − 1)·max_s(compute
  + p2p) + Σ p2p + Σ compute + max update, the gradient sync a ring all-reduce of each stage's fp32
  weights (÷ TP) in 500 MB buckets over the stage's replicas at the bandwidth of the one-GPU
  inter-node fit, nothing overlapped, no ZeRO (each replica updates its whole slice).

By default both network readings are run and printed (`--network flows|sailor` runs one). `--check`
judges on the "sailor" reading (Sailor's own reading of its curves): it exits 1 unless GPUMix's
simulated throughput there is at least 1.1 × Sailor's recorded one at every size and every solve takes
at most 60 s here. `--sailor-structure` also prices Sailor's own plan where its README describes it
closely enough to rebuild (512 GPUs: `SAILOR_STRUCTURES`), by GPUMix's simulator and by the copy of
Sailor's pricing above, each stage order and micro-batch at GPUMix's best layer split, and prints
GPUMix's plan against the best (`sizes[i].sailor_structure` under `--json`; judged by nothing). The
models: docs/models/scale.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("GPUMIX_DATA_DIR", tempfile.mkdtemp(prefix="gpumix-bench-sailor-"))  # no store side effects

from contracts.catalog import get_gpu_type  # noqa: E402
from contracts.cluster import ClusterSpec  # noqa: E402
from planner.geo.scale.costs import ScaleCosts, tables_from_layer_profiles  # noqa: E402
from planner.geo.scale.search import solve_scale  # noqa: E402
from profiler.importer import SAILOR_GPU_TYPES, read_sailor_network, read_sailor_profiles  # noqa: E402

DEFAULT_SAILOR_DIR = os.path.join(os.path.dirname(ROOT), "shared", "sailor")
# RECORDED, not computed: Sailor's plan's throughput (iterations/s) from the table of
# ../shared/sailor/README.md ("Measured on 2026-12-04 with Sailor's own planners and simulator",
# github.com/eth-easl/sailor commit cf2c8e3), keyed by the scenario's total GPU count.
SAILOR_RECORDED_IT_S = {128: 0.170, 320: 0.361, 512: 0.523}
SAILOR_RECORDED_SOURCE = "../shared/sailor/README.md table (Sailor's planner and simulator, commit cf2c8e3)"
TARGET_RATIO = 1.1
TARGET_SOLVE_S = 60.0
MODEL = "OPT-350"
SAILOR_BUCKET_BYTES = 500e6  # Sailor's README: DeepSpeed's 500 MB all-reduce buckets


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_scenario(sailor_dir: str) -> dict:
    """The job and the three cluster sizes from Sailor's files (ValueError naming what is missing)."""
    for name in ("profiles_tmp.json", "llm_info.json", "training_config_opt_350.json", "multizone_bandwidths_het.json",
                 "intra_node_bandwidths.json", "basic_cluster_config.json", "gpu_trace_heterogeneous_imbalanced.csv"):
        if not os.path.isfile(os.path.join(sailor_dir, name)):
            raise ValueError(f"{sailor_dir}: missing {name} (point --sailor-dir at Sailor's data folder)")
    job = _load(os.path.join(sailor_dir, "training_config_opt_350.json"))
    config = _load(os.path.join(sailor_dir, "basic_cluster_config.json"))
    sizes = []
    with open(os.path.join(sailor_dir, "gpu_trace_heterogeneous_imbalanced.csv")) as f:
        for row in csv.DictReader(f):
            counts = {}
            for key, value in row.items():
                if key and "_" in key and key.split("_")[0] in SAILOR_GPU_TYPES:
                    counts[key.split("_")[0]] = int(value)
            sizes.append(counts)
    return {"job": job, "zone": config["zone"], "gpus_per_node": {g: config[g]["gpus_per_node"] for g in config
                                                                   if isinstance(config[g], dict)},
            "sizes": sizes}


def build_cluster(counts: dict[str, int], gpus_per_node: dict[str, int], name: str) -> ClusterSpec:
    nodes = []
    for sailor_type, n in sorted(counts.items()):
        per = gpus_per_node[sailor_type]
        if n % per:
            raise ValueError(f"{n} {sailor_type} GPUs are not whole nodes of {per}")
        for i in range(n // per):
            nodes.append({"name": f"{sailor_type.lower()}-{i}", "datacenter": "zone",
                          "gpus": {SAILOR_GPU_TYPES[sailor_type]: per}})
    return ClusterSpec.from_dict({"name": name, "nodes": nodes})


# ---- Sailor's pricing as its README describes it (independent of planner/geo/scale) ---------------------------


class SailorPricing:
    """Reads Sailor's profiles, model info and bandwidth fits itself and prices a plan as Sailor's
    simulator does (module docstring)."""

    def __init__(self, sailor_dir: str, zone: str):
        self.profiles = _load(os.path.join(sailor_dir, "profiles_tmp.json"))[MODEL]
        self.info = _load(os.path.join(sailor_dir, "llm_info.json"))[MODEL]
        self.net = _load(os.path.join(sailor_dir, "multizone_bandwidths_het.json"))
        self.zone = zone
        self.sailor_name = {v: k for k, v in SAILOR_GPU_TYPES.items()}

    def _coeffs(self, a: str, na: int, b: str, nb: int) -> list[float]:
        return self.net[self.zone][self.sailor_name[a]][str(na)][self.zone][self.sailor_name[b]][str(nb)][0]

    @staticmethod
    def _time(size_bytes: float, coeffs: list[float]) -> float:
        """Sailor's fit: bandwidth (GB/s) a polynomial in log2(size / 1e6), time = size / bandwidth."""
        if size_bytes <= 0:
            return 0.0
        x = math.log2(size_bytes / 1e6)
        bw = sum(c * x ** (len(coeffs) - 1 - i) for i, c in enumerate(coeffs))
        if bw <= 0:
            raise ValueError(f"Sailor's fit gives no bandwidth at {size_bytes:.3g} bytes")
        return size_bytes / 1e9 / bw

    def _layer(self, device: str, tp: int, rows: int, layer: int) -> tuple[float, float, float]:
        """(fwd, bwd, update) of one layer at `rows` rows: Sailor's measured value, linearly between two
        measured micro-batches where the rows fall between them (its simulator only ever asks measured ones)."""
        by_mb = self.profiles[self.sailor_name[device]]
        mbs = sorted(int(m) for m in by_mb if str(tp) in by_mb[m])
        if rows in mbs:
            return tuple(by_mb[str(rows)][str(tp)][str(layer)])
        lo = max(m for m in mbs if m < rows)
        hi = min(m for m in mbs if m > rows)
        a, b = by_mb[str(lo)][str(tp)][str(layer)], by_mb[str(hi)][str(tp)][str(layer)]
        w = (rows - lo) / (hi - lo)
        return tuple(x + w * (y - x) for x, y in zip(a, b))

    def iteration_s(self, plan) -> float:
        stages = plan.stages
        S, M = len(stages), plan.structure.num_microbatches
        comp, p2p, update, sync = [], [], [], []
        for s, st in enumerate(stages):
            layers = list(range(0 if s == 0 else 1 + st.first_layer,
                                len(self.info["1"]) if s == S - 1 else 1 + st.first_layer + st.num_layers))
            comp.append(max(sum(sum(self._layer(r.device_type, r.tp, r.rows, l)[:2]) for l in layers)
                            for r in st.replicas))
            update.append(max(sum(self._layer(r.device_type, r.tp, r.rows, l)[2] for l in layers) for r in st.replicas))
            sends = 0.0
            for direction, other, layer in ((1, s + 1, layers[-1]), (-1, s - 1, layers[0])):
                if not 0 <= other < S:
                    continue
                worst = 0.0
                for r in st.replicas:
                    size = self.info["1"][str(layer)]["act_output_floats"] * r.rows * 4
                    q = stages[other].replicas[0]
                    coeffs = self._coeffs(r.device_type, min(r.tp, 4), q.device_type, min(q.tp, 4))
                    worst = max(worst, self._time(size, coeffs))
                sends += worst
            p2p.append(sends)
            tp_min = min(r.tp for r in st.replicas)
            size = sum(self.info["1"][str(l)]["params_floats"] * 4 / tp_min for l in layers)
            dp = len(st.replicas)
            types = sorted({r.device_type for r in st.replicas})
            t = 0.0
            for a in types:
                for b in types:
                    t = max(t, _bucketed_all_reduce_s(size, dp, self._coeffs(a, 1, b, 1), self._time))
            sync.append(t)
        straggler = max(c + p for c, p in zip(comp, p2p))
        return (M - 1) * straggler + sum(p2p) + sum(comp) + max(update) + max(sync)


def _bucketed_all_reduce_s(size: float, workers: int, coeffs: list[float], time_fn) -> float:
    """A ring all-reduce of `size` bytes in 500 MB buckets: per bucket 2(D − 1) steps of bucket / D bytes."""
    if workers <= 1 or size <= 0:
        return 0.0
    total, left = 0.0, size
    while left > 0:
        bucket = min(left, SAILOR_BUCKET_BYTES)
        total += 2 * (workers - 1) * time_fn(bucket / workers, coeffs)
        left -= bucket
    return total


# ---- Sailor's structure, priced by both pricings ------------------------------------------------------

# Sailor's plan at 128 + 384 GPUs as its README describes it ("2 or 7 pipeline stages, tensor parallelism
# 4 on the V100s, data parallel 20-32 per stage"): 7 stages of data parallelism 32, so the 96 V100 nodes
# at TP 4 make 3 stages of 32 nodes and the 32 A100 nodes 4 stages of 8 nodes at TP 1. Its layer split,
# stage order and micro-batch are not given; those are tried (below). The other two sizes' structures
# are not described closely enough to rebuild.
SAILOR_STRUCTURES = {512: {"V100-16GB": (3, 4), "A100-40GB": (4, 1)}}  # type: (stages, TP)
SAILOR_STRUCTURE_SOURCE = "../shared/sailor/README.md: 7 stages, TP 4 on the V100s, DP 32 per stage"
SAILOR_STRUCTURE_STAGE_ROWS = (32, 64, 128, 256)  # rows per micro-batch of a stage (1 to 8 per TP group)


def price_sailor_structure(cluster: ClusterSpec, costs: ScaleCosts, global_batch: int, sailor: SailorPricing,
                           shape: dict[str, tuple[int, int]]) -> dict:
    """Sailor's structure (`shape`: per GPU type, its number of stages and TP degree, the type's nodes
    split evenly over its stages) priced by GPUMix's simulator and by the bench's copy of Sailor's
    pricing, for each stage order (one type's stages first) and micro-batch, every structure at
    GPUMix's best layer split for it; the best by GPUMix's simulator (and by Sailor's pricing) with all."""
    from planner.geo.scale.price import price_exactly
    from planner.geo.scale.structure import StageLayout, StagePart, Structure, StructurePricer

    pricer = StructurePricer(costs, global_batch)
    by_type: dict[str, list[StageLayout]] = {}
    for gpu_type, (stages, tp) in shape.items():
        nodes = [i for i, n in enumerate(cluster.nodes) if all(d.type == gpu_type for d in n.devices)]
        per = len(nodes) // stages
        gpus = len(cluster.nodes[nodes[0]].devices)
        by_type[gpu_type] = [StageLayout((StagePart(gpu_type, gpus, tp, tuple(nodes[k * per:(k + 1) * per])),))
                             for k in range(stages)]
    tried = []
    for order in (tuple(shape), tuple(reversed(tuple(shape)))):
        layouts = tuple(x for t in order for x in by_type[t])
        for rows in SAILOR_STRUCTURE_STAGE_ROWS:
            found = pricer.price(Structure(layouts, rows, global_batch // rows))
            plan = price_exactly(cluster, pricer, found) if found is not None else None
            if plan is None:
                continue
            tried.append({"order": list(order), "micro_batch": rows, "num_microbatches": global_batch // rows,
                          "gpumix_it_s": round(1.0 / plan.iteration_s, 4),
                          "sailor_pricing_it_s": round(1.0 / sailor.iteration_s(plan), 4),
                          "blocks": [st.num_layers for st in plan.stages]})
    if not tried:
        raise ValueError(f"Sailor's structure {shape} fits no micro-batch of {SAILOR_STRUCTURE_STAGE_ROWS}")
    return {"shape": {t: {"stages": s, "tp": tp} for t, (s, tp) in shape.items()}, "source": SAILOR_STRUCTURE_SOURCE,
            "best_gpumix": max(tried, key=lambda x: x["gpumix_it_s"]),
            "best_sailor_pricing": max(tried, key=lambda x: x["sailor_pricing_it_s"]), "tried": tried}


# ---- the bench ----------------------------------------------------------------------------------------


def structure_of(plan) -> dict:
    """The plan's structure: stages, layers per stage, TP degrees, per-stage splits, micro-batch, M."""
    return {
        "num_stages": len(plan.stages), "micro_batch": plan.structure.micro_batch,
        "num_microbatches": plan.structure.num_microbatches,
        "stages": [{"nodes": st.layout.label, "first_layer": st.first_layer, "num_layers": st.num_layers,
                    "tp": sorted({r.tp for r in st.replicas}), "dp": len(st.replicas),
                    "gpus": sum(r.tp for r in st.replicas),
                    "rows": _counts(r.rows for r in st.replicas),
                    "by_type": {t: {"tp_groups": sum(1 for r in st.replicas if r.device_type == t),
                                    "rows": _counts(r.rows for r in st.replicas if r.device_type == t),
                                    "shard_fraction_max": round(max(r.shard_fraction for r in st.replicas
                                                                    if r.device_type == t), 6),
                                    "memory_gib_max": round(max(r.memory_bytes for r in st.replicas
                                                                if r.device_type == t) / 2**30, 2),
                                    "capacity_gib": round(get_gpu_type(t).memory_bytes / 2**30, 2)}
                                for t in sorted({r.device_type for r in st.replicas})},
                    "forward_backward_s": round(st.forward_s + st.backward_s, 5), "hop_s": round(st.hop_s, 5),
                    "reduce_scatter_s": round(st.reduce_s, 5), "all_gather_s": round(st.gather_s, 5),
                    "update_s": round(st.update_s, 6)}
                   for st in plan.stages],
    }


def _counts(xs) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def run(sailor_dir: str, max_tp: int, time_limit_s: float, reading: str = "flows",
        with_sailor_structure: bool = False) -> dict:
    sc = read_scenario(sailor_dir)
    job = sc["job"]
    layers, spec = read_sailor_profiles(os.path.join(sailor_dir, "profiles_tmp.json"), job["model"],
                                        seq=job["sequence_length"])
    inter = read_sailor_network(os.path.join(sailor_dir, "multizone_bandwidths_het.json"))
    intra = read_sailor_network(os.path.join(sailor_dir, "intra_node_bandwidths.json"))
    tables = tables_from_layer_profiles(layers, spec)
    sailor = SailorPricing(sailor_dir, sc["zone"])
    rows = []
    for counts in sc["sizes"]:
        num_gpus = sum(counts.values())
        cluster = build_cluster(counts, sc["gpus_per_node"], f"sailor-{num_gpus}")
        costs = ScaleCosts.for_cluster(cluster, spec, job["sequence_length"], "fp32", tables, inter, intra,
                                       zone=sc["zone"], source=layers.source)
        costs.network_reading = reading
        t0 = time.perf_counter()
        result = solve_scale(cluster, costs, job["global_batch_size"], max_tp=max_tp, time_limit_s=time_limit_s)
        solve_s = time.perf_counter() - t0
        plan = result.plan
        recorded = SAILOR_RECORDED_IT_S.get(num_gpus)
        gpumix = 1.0 / plan.iteration_s
        like = 1.0 / sailor.iteration_s(plan)
        rows.append({
            "num_gpus": num_gpus, "gpus": {SAILOR_GPU_TYPES[k]: v for k, v in counts.items()},
            "gpumix_it_s": round(gpumix, 4), "sailor_it_s": recorded,
            "ratio": round(gpumix / recorded, 3) if recorded else None,
            "gpumix_it_s_sailor_pricing": round(like, 4),
            "ratio_sailor_pricing": round(like / recorded, 3) if recorded else None,
            "gpumix_flat_it_s": round(1.0 / result.flat.iteration_s, 4) if result.flat else None,
            "bound_it_s": round(1.0 / result.bound_s, 4) if result.bound_s > 0 else None,
            "gap_to_bound": round(result.gap, 4),
            "solve_s": round(solve_s, 2), "search": {"status": result.status, "structures_priced": result.num_structures,
                                                      "simulated": result.num_simulated},
            "structure": structure_of(plan),
        })
        if with_sailor_structure and num_gpus in SAILOR_STRUCTURES:
            ss = price_sailor_structure(cluster, costs, job["global_batch_size"], sailor, SAILOR_STRUCTURES[num_gpus])
            ss["gpumix_plan_over_it"] = round(gpumix / ss["best_gpumix"]["gpumix_it_s"], 3)
            ss["gpumix_plan_over_it_sailor_pricing"] = round(like / ss["best_sailor_pricing"]["sailor_pricing_it_s"], 3)
            rows[-1]["sailor_structure"] = ss
    return {"sizes": rows, "sailor_source": SAILOR_RECORDED_SOURCE, "profiles_source": layers.source,
            "max_tp": max_tp, "network": reading}


NETWORK_READINGS = {"flows": "GPUMix's: a node's traffic as one flow per GPU, at the curve of its GPUs per node",
                    "sailor": "Sailor's: a ring one flow at the one-GPU curve, each replica's point-to-point its own "
                              "flow at the one-GPU curve"}


def print_table(report: dict) -> None:
    print(f"GPUMix's joint plan vs Sailor (OPT-350, batch 1024, seq 2048, fp32, Adam; max tp {report['max_tp']})")
    print(f"network curves read as {NETWORK_READINGS[report['network']]}")
    print(f"Sailor's figures are RECORDED: {report['sailor_source']}")
    print(f"{'GPUs':>6} {'GPUMix it/s':>12} {'Sailor it/s':>12} {'ratio':>7} {'GPUMix@Sailor-pricing':>22} "
          f"{'flat it/s':>10} {'bound it/s':>11} {'solve s':>8}")
    for r in report["sizes"]:
        print(f"{r['num_gpus']:>6} {r['gpumix_it_s']:>12.4f} {r['sailor_it_s']:>12.3f} {r['ratio']:>7.3f} "
              f"{r['gpumix_it_s_sailor_pricing']:>22.4f} {r['gpumix_flat_it_s'] or 0:>10.4f} "
              f"{r['bound_it_s'] or 0:>11.4f} {r['solve_s']:>8.2f}")
    for r in report["sizes"]:
        st = r["structure"]
        print(f"\n{r['num_gpus']} GPUs: {st['num_stages']} stage(s), micro-batch {st['micro_batch']} rows × "
              f"{st['num_microbatches']} micro-batches (search: {r['search']['status']}, "
              f"{r['search']['structures_priced']} structures, gap to the fluid bound {r['gap_to_bound']:.1%})")
        for i, s in enumerate(st["stages"]):
            types = "; ".join(f"{t}: {v['tp_groups']} TP groups rows {v['rows']} max shard {v['shard_fraction_max']} "
                              f"mem {v['memory_gib_max']}/{v['capacity_gib']} GiB" for t, v in s["by_type"].items())
            print(f"  stage {i}: {s['nodes']}, blocks {s['first_layer']}-{s['first_layer'] + s['num_layers'] - 1}, "
                  f"tp {s['tp']}, dp {s['dp']}, f+b {s['forward_backward_s']} s, hop {s['hop_s']} s, "
                  f"rs {s['reduce_scatter_s']} s, ag {s['all_gather_s']} s; {types}")
    for r in report["sizes"]:
        ss = r.get("sailor_structure")
        if ss is None:
            continue
        shape = ", ".join(f"{v['stages']} {t} stage(s) at TP {v['tp']}" for t, v in ss["shape"].items())
        print(f"\nSailor's structure at {r['num_gpus']} GPUs ({ss['source']}): {shape}; the stage order and the "
              f"micro-batch tried, each at GPUMix's best layer split:")
        for x in ss["tried"]:
            print(f"  {' stages, then '.join(x['order'])} stages; micro-batch {x['micro_batch']} rows × "
                  f"{x['num_microbatches']}, blocks {x['blocks']}: GPUMix's simulator {x['gpumix_it_s']:.4f} it/s, "
                  f"Sailor's pricing {x['sailor_pricing_it_s']:.4f} it/s")
        b, bs = ss["best_gpumix"], ss["best_sailor_pricing"]
        print(f"  best: {b['gpumix_it_s']:.4f} it/s in GPUMix's simulator (Sailor records {r['sailor_it_s']}), "
              f"{bs['sailor_pricing_it_s']:.4f} in Sailor's pricing; GPUMix's plan against it: "
              f"{ss['gpumix_plan_over_it']:.3f}x (GPUMix's simulator), {ss['gpumix_plan_over_it_sailor_pricing']:.3f}x "
              f"(Sailor's pricing)")


JUDGED_READING = "sailor"


def check_failures(report: dict) -> list[str]:
    """The sizes whose ratio to Sailor's recorded throughput or whose solve time misses the target."""
    bad = [f"{r['num_gpus']} GPUs: ratio {r['ratio']} < {TARGET_RATIO}" for r in report["sizes"]
           if r["ratio"] is None or r["ratio"] < TARGET_RATIO]
    bad += [f"{r['num_gpus']} GPUs: solve {r['solve_s']} s > {TARGET_SOLVE_S:g} s" for r in report["sizes"]
            if r["solve_s"] > TARGET_SOLVE_S]
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sailor-dir", default=DEFAULT_SAILOR_DIR, help="Sailor's data folder (default ../shared/sailor)")
    p.add_argument("--max-tp", type=int, choices=(1, 2, 4, 8), default=8, help="the largest TP degree searched")
    p.add_argument("--time-limit", type=float, default=TARGET_SOLVE_S, help="the search's time limit per size (s)")
    p.add_argument("--network", choices=("both",) + tuple(NETWORK_READINGS), default="both",
                   help="how GPUMix plans and prices with the inter-node curves: flows (a node's traffic one flow "
                        "per GPU), sailor (as Sailor's simulator reads them) or both (default)")
    p.add_argument("--sailor-structure", action="store_true",
                   help="also price Sailor's own structure where its README describes it (512 GPUs) with both "
                        "pricings, and print GPUMix's plan against it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 unless, on the {JUDGED_READING} reading, every ratio >= {TARGET_RATIO} and every "
                        f"solve <= {TARGET_SOLVE_S:g} s")
    args = p.parse_args(argv)
    readings = tuple(NETWORK_READINGS) if args.network == "both" else (args.network,)
    if args.check and JUDGED_READING not in readings:
        readings += (JUDGED_READING,)
    try:
        reports = {r: run(args.sailor_dir, args.max_tp, args.time_limit, r, args.sailor_structure) for r in readings}
    except (ValueError, OSError) as e:
        print(f"vs_sailor: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"readings": reports, "judged_reading": JUDGED_READING}, indent=1))
    else:
        for i, r in enumerate(readings):
            if i:
                print()
            print_table(reports[r])
    if args.check:
        bad = check_failures(reports[JUDGED_READING])
        for b in bad:
            print(f"check failed ({JUDGED_READING} reading): {b}", file=sys.stderr)
        if not args.json:
            print(f"check on the {JUDGED_READING} reading: " + ("passed" if not bad else "FAILED"))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Job traces: the CSV format (DESIGN.md) and a seeded generator of realistic ones.

CSV header: `job_id,submit_s,model,global_batch,seq,steps,requested_type,requested_gpus`
(the last two may be empty together: no user request).

The generator draws what shared GPU clusters show (Philly / Helios / Acme traces:
most jobs small, a few large; durations spanning minutes to a day; arrivals in bursts
of hyper-parameter sweeps) and user requests the way people make them by hand: a
type in proportion to how many the pool has, the biggest-memory one twice as often;
the count a power of two, often twice to eight times what the job needs ("to be
safe", up to a whole 8-GPU node), sometimes half of it (the job would OOM). Each job's step count is chosen so that its run *on its
user's request* lasts the drawn duration; arrivals are scaled so the requested
GPU-seconds load the cluster to `load`.
"""
from __future__ import annotations

import csv
import heapq
import io
import math
import random
from dataclasses import dataclass
from typing import Sequence

from contracts.catalog import CATALOG, get_gpu_type
from contracts.jsonio import read_text_file
from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.schedule.options import Pool, candidate_counts, cluster_pools, estimate_option
from contracts.specs import get_model

COLUMNS = ("job_id", "submit_s", "model", "global_batch", "seq", "steps", "requested_type", "requested_gpus")


@dataclass(frozen=True)
class ModelMix:
    model: str
    weight: float  # share of jobs
    seqs: tuple[int, ...]
    global_batches: tuple[int, ...]


# 124M to 13B parameters; small models dominate job counts in published cluster traces.
MODEL_MIX = (
    ModelMix("gpt2", 0.26, (512, 1024), (32, 64, 128, 256)),
    ModelMix("gpt2-medium", 0.18, (512, 1024), (32, 64, 128, 256)),
    ModelMix("gpt2-large", 0.12, (1024,), (32, 64, 128)),
    ModelMix("gpt2-xl", 0.10, (1024,), (32, 64, 128)),
    ModelMix("tinyllama-1.1b", 0.09, (2048,), (64, 128, 256)),
    ModelMix("gpt-2.7b", 0.08, (2048,), (64, 128, 256)),
    ModelMix("llama2-7b", 0.07, (2048, 4096), (64, 128, 256)),
    ModelMix("mistral-7b", 0.05, (4096,), (64, 128)),
    ModelMix("llama2-13b", 0.05, (4096,), (64, 128, 256)),
)
MIN_DURATION_S = 5 * 60  # on the user's request: 5 minutes ...
MAX_DURATION_S = 24 * 3600  # ... to a day, log-uniform
SWEEP_PROBABILITY = 0.25  # a burst: one user submits a sweep of 3-8 copies at once
FAMOUS_TYPE_PREFERENCE = 2.0  # users pick a type in proportion to how many there are, the big one 2x as often ...
GPUS_PER_NODE = 8
OVERSIZE_FACTORS = ((0.5, 0.10), (1, 0.40), (2, 0.25), (4, 0.15), (8, 0.10))  # ... and this × the count it needs


# Mixed pools the bench and the dashboard simulate: 3, 4 and 5 GPU types, 8 GPUs a node.
DEMO_CLUSTERS: dict[int, dict[str, int]] = {
    64: {"A100-80GB": 16, "V100-32GB": 24, "T4": 24},
    256: {"H100-SXM": 32, "A100-80GB": 64, "V100-32GB": 64, "T4": 96},
    1024: {"H100-SXM": 128, "A100-80GB": 256, "A100-40GB": 128, "V100-32GB": 256, "T4": 256},
}


def mixed_cluster(types: dict[str, int], gpus_per_node: int = GPUS_PER_NODE) -> ClusterSpec:
    """One node per `gpus_per_node` GPUs of each type (a remainder makes a smaller node)."""
    nodes = []
    for t, n in types.items():
        for k in range(0, n, gpus_per_node):
            nodes.append({"name": f"{t.lower()}-{k // gpus_per_node}", "datacenter": "dc0",
                          "gpus": {t: min(gpus_per_node, n - k)}})
    return ClusterSpec.from_dict({"name": f"mixed-{sum(types.values())}", "nodes": nodes,
                                  "network": {"intra_node_gbps": 600, "inter_node_gbps": 200}})


def generate_trace(seed: int, num_jobs: int, cluster: ClusterSpec, load: float = 0.6,
                   dtype: str = "bf16") -> list[JobSpec]:
    """`num_jobs` jobs whose requests (types and counts) exist in `cluster`."""
    if num_jobs <= 0:
        raise ValueError(f"num_jobs must be positive, got {num_jobs}")
    if load <= 0:
        raise ValueError(f"load must be positive, got {load}")
    rng = random.Random(seed)
    pools = sorted(cluster_pools(cluster), key=lambda p: -p.count)
    famous = max(pools, key=lambda p: (p.device.memory_bytes, get_gpu_type(p.device.type).peak_tflops(dtype)))
    net = cluster.network.inter_node_gbps
    drafts: list[tuple[JobSpec, float, float]] = []  # (job, burst index + offset, GPU-seconds it occupies)
    burst = 0
    while len(drafts) < num_jobs:
        mix = rng.choices(MODEL_MIX, weights=[m.weight for m in MODEL_MIX])[0]
        seq, batch = rng.choice(mix.seqs), rng.choice(mix.global_batches)
        duration_s = math.exp(rng.uniform(math.log(MIN_DURATION_S), math.log(MAX_DURATION_S)))
        copies = rng.randint(3, 8) if rng.random() < SWEEP_PROBABILITY else 1
        request = _user_request(rng, mix.model, seq, batch, pools, famous, dtype, net)
        if request is None:
            continue  # fits nowhere in this cluster: nobody would submit it here
        pool, count, run_n, option_iteration_s = request
        steps = max(10, round(duration_s / option_iteration_s))
        for c in range(min(copies, num_jobs - len(drafts))):
            job = JobSpec(f"j{len(drafts):05d}", mix.model, batch, seq, steps, 0.0,
                          requested_type=pool.device.type, requested_gpus=count)
            drafts.append((job, burst + rng.uniform(0, 0.01) * c, run_n * duration_s))
        burst += 1
    # Bursts arrive as a Poisson process whose rate puts `load` × the cluster's device-seconds
    # of requested work into the trace's span.
    work = sum(w for _, _, w in drafts)
    mean_gap_s = work / (load * cluster.num_devices) / burst
    times, t = [], 0.0
    for _ in range(burst):
        times.append(t)
        t += rng.expovariate(1.0 / mean_gap_s)
    timed = sorted(((times[int(offset)] + (offset - int(offset)) * mean_gap_s, job) for job, offset, _ in drafts),
                   key=lambda tj: tj[0])
    return [JobSpec(f"j{i:05d}", job.model, job.global_batch, job.seq, job.steps, round(submit, 3),
                    requested_type=job.requested_type, requested_gpus=job.requested_gpus)
            for i, (submit, job) in enumerate(timed)]


def _user_request(rng: random.Random, model: str, seq: int, batch: int, pools: Sequence[Pool], famous: Pool,
                  dtype: str, net: float) -> tuple[Pool, int, int, float] | None:
    """(pool, count asked, count it runs on, iteration time of that run) — sized by hand."""
    job = JobSpec("draft", model, batch, seq, 1, 0.0)
    fits: dict[Pool, tuple[int, float]] = {}
    for p in pools:  # the smallest count of each type the job fits on (what the user *needs*)
        for n in candidate_counts(min(p.count, batch)):
            o = estimate_option(job, p, n, dtype, net)
            if o is not None:
                fits[p] = (n, o.iteration_s)
                break
    if not fits:
        return None
    choices = list(fits)
    weights = [p.count * (FAMOUS_TYPE_PREFERENCE if p == famous else 1.0) for p in choices]
    pool = rng.choices(choices, weights=weights)[0]
    need = fits[pool][0]
    factor = rng.choices([f for f, _ in OVERSIZE_FACTORS], weights=[w for _, w in OVERSIZE_FACTORS])[0]
    # oversizing stops at a whole node ("give me a node") unless the job needs more than one
    count = max(1, min(int(need * factor), max(need, GPUS_PER_NODE), pool.count, batch))
    run_n = count if count >= need else need  # an undersized request OOMs; the user reruns at `need`
    opt = estimate_option(job, pool, run_n, dtype, net)
    return pool, count, run_n, (opt.iteration_s if opt else fits[pool][1])


# --- CSV ---

def write_trace_csv(jobs: Sequence[JobSpec]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for j in jobs:
        w.writerow([j.job_id, f"{j.submit_s:.6f}".rstrip("0").rstrip("."), j.model, j.global_batch, j.seq, j.steps,
                    j.requested_type or "", "" if j.requested_gpus is None else j.requested_gpus])
    return buf.getvalue()


def save_trace(jobs: Sequence[JobSpec], path: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(write_trace_csv(jobs))


# The largest value each integer column takes: past these no job is real (a typo, a unit slip).
CELL_LIMITS = {"global_batch": 10**9, "seq": 10**7, "steps": 10**12, "requested_gpus": 10**6}
MAX_SUBMIT_S = 1e12
MAX_TRACE_JOBS = 20_000  # a replay is event by event: measured ~1.3 ms/job at 2,000 jobs


def _cell_int(row: dict, col: str, where: str) -> int:
    raw = (row.get(col) or "").strip()
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{where}, column {col!r}: expected a positive integer, got {raw[:40]!r}") from None
    if v <= 0:
        raise ValueError(f"{where}, column {col!r}: expected a positive integer, got {raw!r}")
    if v > CELL_LIMITS[col]:
        raise ValueError(f"{where}, column {col!r}: {v} is over the limit of {CELL_LIMITS[col]:g}")
    return v


def parse_trace_csv(text: str, source: str = "trace") -> list[JobSpec]:
    """Jobs from CSV text; any bad cell raises ValueError naming the line and the column."""
    try:
        return _parse_rows(csv.DictReader(io.StringIO(text)), source)
    except csv.Error as e:  # a NUL byte, a field past the csv module's size limit
        raise ValueError(f"{source}: malformed CSV: {e}") from None


def _parse_rows(reader: csv.DictReader, source: str) -> list[JobSpec]:
    header = tuple(h.strip() for h in (reader.fieldnames or ()))
    if header != COLUMNS:
        raise ValueError(f"{source}: bad header {','.join(header)[:80] or '(empty)'!r}; expected {','.join(COLUMNS)}")
    jobs: list[JobSpec] = []
    seen: set[str] = set()
    for row in reader:
        where = f"{source}: line {reader.line_num}"
        if len(jobs) >= MAX_TRACE_JOBS:
            raise ValueError(f"{source}: more than {MAX_TRACE_JOBS} jobs, over the replay's limit")
        if None in row or any(row.get(c) is None for c in COLUMNS):
            raise ValueError(f"{where}: expected {len(COLUMNS)} columns")
        job_id = row["job_id"].strip()
        if not job_id:
            raise ValueError(f"{where}, column 'job_id': empty")
        if job_id in seen:
            raise ValueError(f"{where}, column 'job_id': duplicate id {job_id!r}")
        seen.add(job_id)
        raw = row["submit_s"].strip()
        try:
            submit = float(raw)
        except ValueError:
            submit = math.nan
        if not math.isfinite(submit) or submit < 0 or submit > MAX_SUBMIT_S:
            raise ValueError(f"{where}, column 'submit_s': expected a number >= 0, got {raw!r}")
        model = row["model"].strip()
        try:
            get_model(model)
        except ValueError as e:
            raise ValueError(f"{where}, column 'model': {e}") from None
        batch, seq, steps = (_cell_int(row, c, where) for c in ("global_batch", "seq", "steps"))
        rtype, rgpus = row["requested_type"].strip(), row["requested_gpus"].strip()
        if rtype and rtype not in CATALOG:
            raise ValueError(f"{where}, column 'requested_type': unknown GPU type {rtype!r}")
        if bool(rtype) != bool(rgpus):
            col = "requested_gpus" if rtype else "requested_type"
            raise ValueError(f"{where}, column {col!r}: requested_type and requested_gpus go together")
        jobs.append(JobSpec(job_id, model, batch, seq, steps, submit, requested_type=rtype or None,
                            requested_gpus=_cell_int(row, "requested_gpus", where) if rgpus else None))
    if not jobs:
        raise ValueError(f"{source}: no jobs after the header")
    return jobs


def load_trace(path: str) -> list[JobSpec]:
    return parse_trace_csv(read_text_file(path, "trace file"), source=path)


# --- public traces (Microsoft ITP via ElasticFlow: job_id, submission_time, duration, num_gpu) ---

PUBLIC_COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")
# The public traces name no model. Models are drawn by the GPU count a job asked for: people ask
# for more GPUs for bigger models (MODEL_MIX's 124M-13B), each bucket its own weights.
MODELS_BY_GPUS: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = (
    (1, (("gpt2", 0.4), ("gpt2-medium", 0.35), ("gpt2-large", 0.25))),
    (4, (("gpt2-large", 0.3), ("gpt2-xl", 0.35), ("tinyllama-1.1b", 0.35))),
    (8, (("gpt2-xl", 0.2), ("tinyllama-1.1b", 0.2), ("gpt-2.7b", 0.3), ("llama2-7b", 0.3))),
    (10**6, (("gpt-2.7b", 0.2), ("llama2-7b", 0.35), ("mistral-7b", 0.2), ("llama2-13b", 0.25))),
)
MAX_PUBLIC_DURATION_S = 10**9


@dataclass(frozen=True)
class PublicJob:
    """One row of a public trace: what the cluster recorded."""

    job_id: str
    submit_s: float
    duration_s: float  # how long it ran, on what it asked for
    num_gpus: int


def parse_public_trace(text: str, source: str = "trace") -> list[PublicJob]:
    """Rows of a public trace CSV (`job_id,submission_time,duration,num_gpu`); any bad cell raises
    ValueError naming the line and the column."""
    try:
        reader = csv.DictReader(io.StringIO(text))
        header = tuple(h.strip() for h in (reader.fieldnames or ()))
        if header[:len(PUBLIC_COLUMNS)] != PUBLIC_COLUMNS:
            raise ValueError(f"{source}: bad header {','.join(header)[:80] or '(empty)'!r}; "
                             f"expected {','.join(PUBLIC_COLUMNS)}")
        rows: list[PublicJob] = []
        seen: set[str] = set()
        for row in reader:
            where = f"{source}: line {reader.line_num}"
            if None in row or any(row.get(c) is None for c in PUBLIC_COLUMNS):
                raise ValueError(f"{where}: expected {len(PUBLIC_COLUMNS)} columns")
            job_id = row["job_id"].strip()
            if not job_id or job_id in seen:
                raise ValueError(f"{where}, column 'job_id': {'duplicate id ' + repr(job_id) if job_id else 'empty'}")
            seen.add(job_id)
            vals = {}
            for col, low in (("submission_time", 0.0), ("duration", 0.0)):
                raw = row[col].strip()
                try:
                    v = float(raw)
                except ValueError:
                    v = math.nan
                if not math.isfinite(v) or v < low or v > MAX_PUBLIC_DURATION_S or (col == "duration" and v <= 0):
                    raise ValueError(f"{where}, column {col!r}: expected a number "
                                     f"{'> 0' if col == 'duration' else '>= 0'}, got {raw[:40]!r}")
                vals[col] = v
            raw = row["num_gpu"].strip()
            if not raw.isdigit() or int(raw) <= 0 or int(raw) > CELL_LIMITS["requested_gpus"]:
                raise ValueError(f"{where}, column 'num_gpu': expected a positive integer, got {raw[:40]!r}")
            rows.append(PublicJob(job_id, vals["submission_time"], vals["duration"], int(raw)))
    except csv.Error as e:
        raise ValueError(f"{source}: malformed CSV: {e}") from None
    if not rows:
        raise ValueError(f"{source}: no jobs after the header")
    return rows


def convert_public_trace(rows: Sequence[PublicJob], cluster: ClusterSpec, seed: int, start_s: float = 0.0,
                         end_s: float = math.inf, dtype: str = "bf16") -> list[JobSpec]:
    """GPUMix jobs from the public rows submitted in [start_s, end_s): arrivals (from start_s), GPU
    counts and durations the trace's; per job (seeded) a model drawn by its GPU count
    (MODELS_BY_GPUS), a sequence length and global batch from MODEL_MIX, a requested type in
    proportion to how many the cluster has (the biggest-memory type twice as often, as
    `generate_trace`) among those with enough devices where the model fits on the count asked;
    steps so that the job on its requested devices lasts its recorded duration. A count above every
    pool is capped at the largest pool; a model that fits on no type at the count is redrawn from
    the smaller buckets."""
    if end_s <= start_s:
        raise ValueError(f"empty window: start {start_s} >= end {end_s}")
    rng = random.Random(seed)
    pools = sorted(cluster_pools(cluster), key=lambda p: -p.count)
    famous = max(pools, key=lambda p: (p.device.memory_bytes, get_gpu_type(p.device.type).peak_tflops(dtype)))
    mixes = {m.model: m for m in MODEL_MIX}
    net = cluster.network.inter_node_gbps
    jobs: list[JobSpec] = []
    for row in sorted(rows, key=lambda r: (r.submit_s, r.job_id)):
        if not start_s <= row.submit_s < end_s:
            continue
        n = min(row.num_gpus, pools[0].count)
        buckets = [b for b in MODELS_BY_GPUS if b[0] >= n][:1] + [b for b in reversed(MODELS_BY_GPUS) if b[0] < n]
        drawn = None
        for _, models in buckets:
            names = [m for m, _ in models]
            order = []
            while names:  # a weighted draw without replacement: the first that fits wins
                pick = rng.choices(names, weights=[w for m, w in models if m in names])[0]
                order.append(pick)
                names.remove(pick)
            for model in order:
                mix = mixes[model]
                seq = rng.choice(mix.seqs)
                batch = rng.choice([b for b in mix.global_batches if b >= n] or [max(mix.global_batches[-1], n)])
                probe = JobSpec("draft", model, batch, seq, 1, 0.0)
                fits = [(p, o) for p in pools if p.count >= n
                        for o in [estimate_option(probe, p, n, dtype, net)] if o is not None]
                if fits:
                    drawn = (model, seq, batch, fits)
                    break
            if drawn:
                break
        if drawn is None:
            raise ValueError(f"job {row.job_id}: no model of MODEL_MIX fits on {n} GPUs of any type of {cluster.name}")
        model, seq, batch, fits = drawn
        weights = [p.count * (FAMOUS_TYPE_PREFERENCE if p == famous else 1.0) for p, _ in fits]
        pool, opt = rng.choices(fits, weights=weights)[0]
        steps = max(1, round(row.duration_s / opt.iteration_s))
        jobs.append(JobSpec(row.job_id, model, batch, seq, steps, round(row.submit_s - start_s, 3),
                            requested_type=pool.device.type, requested_gpus=n))
    if not jobs:
        raise ValueError(f"no job submitted in [{start_s:g}, {end_s:g}) s")
    return jobs


def load_public_trace(path: str, cluster: ClusterSpec, seed: int, start_s: float = 0.0, end_s: float = math.inf,
                      dtype: str = "bf16") -> list[JobSpec]:
    """`convert_public_trace` of a public trace file (read, never copied)."""
    return convert_public_trace(parse_public_trace(read_text_file(path, "trace file"), source=path), cluster, seed,
                                start_s, end_s, dtype)


def fragmentation_exposure(rows: Sequence[PublicJob], pool_counts: Sequence[int], start_s: float = 0.0,
                           end_s: float = math.inf) -> float:
    """How often a window's jobs would meet free devices fragmented across types, from the trace and
    the cluster's composition alone (no policy, no replay): the share of the window's requested
    GPU-seconds whose job, at its arrival, finds the devices of the trace's own concurrency free in
    all pools together but not in the largest one. The concurrency is every earlier job still
    running as recorded (started on arrival, its recorded duration); it is spread over the pools in
    proportion to their sizes, so the largest pool's free devices are its size × the free share.
    Counts are capped at the largest pool (as `convert_public_trace`). 0 for an empty window."""
    if not pool_counts or min(pool_counts) <= 0:
        raise ValueError(f"pool_counts must be positive device counts, got {list(pool_counts)}")
    total, largest = sum(pool_counts), max(pool_counts)
    ends: list[tuple[float, int]] = []  # (recorded end, GPUs) of the jobs running, a heap
    used = 0
    asked = exposed = 0.0
    for row in sorted(rows, key=lambda r: (r.submit_s, r.job_id)):
        if row.submit_s >= end_s:
            break
        while ends and ends[0][0] <= row.submit_s:
            used -= heapq.heappop(ends)[1]
        n = min(row.num_gpus, largest)
        heapq.heappush(ends, (row.submit_s + row.duration_s, n))
        if row.submit_s < start_s:  # before the window: only its concurrency counts
            used += n
            continue
        free = max(0, total - used)
        used += n
        asked += n * row.duration_s
        if largest * free / total < n <= free:
            exposed += n * row.duration_s
    return exposed / asked if asked else 0.0


def request_duration_s(job: JobSpec, cluster: ClusterSpec, dtype: str = "bf16") -> float:
    """The job's predicted duration on its user's request (inf where that fits nowhere)."""
    pools = [p for p in cluster_pools(cluster) if p.device.type == job.requested_type]
    if not pools or job.requested_gpus is None:
        return math.inf
    pool = max(pools, key=lambda p: p.count)
    o = estimate_option(job, pool, job.requested_gpus, dtype, cluster.network.inter_node_gbps)
    return math.inf if o is None else o.duration_s

"""Model & memory: will a training step fit on a GPU? (planner/core/memory.py, docs/models/memory.md)

Widgets -> one library call (`estimate_memory`) -> render: the predicted per-GPU breakdown as a
stacked bar beside the datasheet capacity of a catalog GPU type, and a fits / does-not-fit line.
"Trace now" traces one whole step of the same runtime for small models (measured).
"""
from __future__ import annotations

import os

import streamlit as st

from contracts.catalog import CATALOG
from contracts.constants import DTYPES, MODELLED_ZERO_STAGES, RECOMPUTE
from contracts.paths import confined_path
from planner.core.memory import MemoryBreakdown, MemoryConfig, estimate_memory
from contracts.specs import PRESETS, ModelSpec, get_model
from contracts.uploads import model_from_upload
from ui.charts import RULE_COLOR, bar_chart
from ui.common import (MEASURED, PREDICTED, error_message, fmt_bytes, fmt_percent, labelled, metric, number_field,
                       page_header, parse_upload, show_errors, show_figure)
from ui.state import get_model as get_session_model
from ui.state import get_training_inputs, set_model, set_training_inputs
from contracts.constants import GIB

UPLOAD = "Upload a config.json…"
FOLDER = "A Hugging Face model folder…"
DEFAULT_GPU = "A100-80GB"
COMPONENTS = ("params", "grads", "optimizer", "activations", "other")
TRACE_LIMIT_PARAMS = 200_000_000  # "Trace now" on this page: small models only (seconds, not minutes)
REAL_TRACE_LIMIT_PARAMS = 20_000_000  # above this the trace uses fake tensors (no real memory)


def choose_model() -> ModelSpec | None:
    names = list(PRESETS)
    current = get_session_model()
    index = names.index(current) if current in names else (len(names) + 1 if current.endswith(".json") else 0)
    choice = st.selectbox("Model", [*names, UPLOAD, FOLDER], index=index, key="mem_model")
    if choice == FOLDER:
        return choose_folder()
    if choice != UPLOAD:
        set_model(choice)
        return get_model(choice)
    up = st.file_uploader("Hugging Face config.json (GPT-2, Llama, Mistral, Qwen2)", type=["json"], key="mem_upload")
    if up is None:
        st.info("Upload a config.json to see its memory.")
        return None
    return parse_upload(up, model_from_upload, "Bad config file")


def choose_folder() -> ModelSpec | None:
    """A local Hugging Face folder (config.json, safetensors): planned by its config, and a run can
    start from its weights (`--init-from`)."""
    folder = st.text_input("Model folder (config.json and model.safetensors)", key="mem_folder",
                           placeholder="/path/to/model")
    if not folder:
        st.info("Give the path of a local model folder.")
        return None
    spec = None
    with show_errors("Cannot use this folder"):
        config = os.path.join(confined_path(folder, "Model folder"), "config.json")
        if not os.path.isfile(config):
            raise ValueError(f"no config.json in {folder}")
        spec = get_model(config)
        set_model(config)
        has_weights = any(n.endswith(".safetensors") for n in os.listdir(os.path.dirname(config)))
        inputs = get_training_inputs()
        start = st.checkbox("Start training from these weights (--init-from)", value=has_weights,
                            disabled=not has_weights, key="mem_init_from",
                            help="each rank reads only its own slices of the safetensors files")
        set_training_inputs(inputs["corpus_dir"], inputs["tokenizer"], os.path.dirname(config) if start else None)
    return spec


def _dataset_tokens(source: str | None, tokenizer: str | None, vocab_size: int) -> tuple[int, int]:
    """(train, validation) tokens of a dataset, tokenized once (in parallel, with a progress bar)
    and cached on disk by executor.corpus: a second call returns at once."""
    from executor.corpus import Corpus, build_corpus

    bar = st.progress(0.0, text="tokenizing…")
    corpus = Corpus.load(build_corpus(source, tokenizer, vocab_size=vocab_size,
                                      progress=lambda f, msg: bar.progress(min(max(f, 0.0), 1.0), text=msg)))
    bar.empty()
    return int(corpus.train.size), int(corpus.val.size)


def choose_data(spec: ModelSpec) -> None:
    """Tokenizer and dataset for the run (the Launch page uses them): shown with their token counts."""
    inputs = get_training_inputs()
    c1, c2 = st.columns(2)
    tokenizer = c1.text_input("Tokenizer (tokenizer.json; empty: bytes)", value=inputs["tokenizer"] or "",
                              key="mem_tokenizer")
    data = c2.text_input("Dataset (folder of text, JSON Lines with 'text', or token files; empty: the Python "
                         "standard library)", value=inputs["corpus_dir"] or "", key="mem_data")
    try:
        # symlinks resolved here, so the run reads what was checked
        tokenizer = confined_path(tokenizer, "Tokenizer") if tokenizer else None
        data = confined_path(data, "Dataset") if data else None
    except ValueError as e:  # nothing is read, kept or counted
        st.error(error_message(e), icon=":material/block:")
        return
    set_training_inputs(data, tokenizer, inputs["init_from"])
    if not st.button("Count the dataset's tokens", key="mem_count_tokens"):
        return
    with show_errors("Cannot read the dataset"):
        train, val = _dataset_tokens(data, tokenizer, spec.vocab_size)
        st.success(f"{train:,} training tokens and {val:,} validation tokens (measured)")


MAX_MICRO_BATCH_UI = 4096
MAX_WORLD_SIZE = 100_000


def choose_config(spec: ModelSpec) -> tuple[MemoryConfig | None, str]:
    c1, c2, c3, c4 = st.columns(4)
    micro_batch = number_field("Micro-batch", unit="samples", min_value=1, max_value=MAX_MICRO_BATCH_UI, value=1,
                               key="mem_micro_batch", where=c1)
    seq = number_field("Sequence", unit="tokens", min_value=1, max_value=spec.max_seq,
                       value=min(spec.max_seq, 1024), key=f"mem_seq:{spec.name}", where=c2,
                       help=f"at most the model's max_seq ({spec.max_seq:,})")
    dtype = c3.selectbox("Precision", DTYPES, key="mem_dtype",
                         help="bf16/fp16: autocast compute with fp32 master weights, grads and AdamW state")
    recompute = c4.selectbox("Recomputation", RECOMPUTE, key="mem_recompute",
                             help="full: keep only each block's input, recompute the block in backward")
    c5, c6, c7, c8 = st.columns(4)
    zero = c5.selectbox("ZeRO stage", MODELLED_ZERO_STAGES, index=1, key="mem_zero",
                        help="1: AdamW state sharded; 2: + gradients; 3: + parameters (gathered unit by unit); "
                             "0: one GPU holds everything")
    dp = number_field("World size", unit="data-parallel GPUs", min_value=1, max_value=MAX_WORLD_SIZE, value=1,
                      key="mem_dp", where=c6)
    even = 1.0 / (dp or 1)
    uneven = c7.checkbox(f"Uneven shard (even: 1/{dp or 1} = {even:.4g})", value=False, key="mem_uneven",
                         help="this GPU's share of the sharded state; Cephalo shards unevenly")
    fraction = even
    if uneven:
        fraction = number_field("Shard fraction", unit="of the state", min_value=0.0001, max_value=1.0,
                                value=round(even, 4), step=0.05, format="%.4f", key="mem_shard_fraction", where=c7)
    gpu_names = sorted(CATALOG)
    gpu = c8.selectbox("GPU type", gpu_names, index=gpu_names.index(default_gpu_type()), key="mem_gpu_type",
                       help="decides the attention kernel that runs (and so what it keeps for backward)")
    accum = number_field("Accumulation steps", unit="micro-batches per optimizer step", min_value=1,
                         max_value=MAX_MICRO_BATCH_UI, value=1, key="mem_accum_steps",
                         help="at ZeRO 2/3 every micro-batch's unit boundaries are held (layer-wise accumulation)")
    if None in (micro_batch, seq, dp, fraction, accum):
        return None, gpu  # the field's error is shown under it
    with show_errors("Invalid settings"):
        return MemoryConfig(micro_batch=micro_batch, accum_steps=accum, seq=seq, dtype=dtype,
                            recompute=recompute, dp=dp, zero=int(zero), shard_fraction=fraction if uneven else None,
                            device_type=gpu), gpu
    return None, gpu


def breakdown_figure(b: MemoryBreakdown, capacity_bytes: int, gpu: str):
    """The predicted peak as one stacked bar of its components, beside the GPU's capacity (a
    dashed rule)."""
    # A tiny model next to a big GPU would be an invisible sliver: switch to MiB and leave the
    # capacity line out (it is named in the title) when the peak is under 5 % of it.
    small = b.peak_bytes < 0.05 * capacity_bytes
    unit, scale = ("MiB", 2**20) if small else ("GiB", GIB)
    title = "Per-GPU memory at the step's peak (predicted)"
    hlines = {}
    if small:
        title += f": {b.peak_bytes / capacity_bytes:.2%} of the {gpu}'s {fmt_bytes(capacity_bytes)}"
    else:
        hlines = {f"{gpu} capacity": capacity_bytes / scale}
    return bar_chart([labelled("per-GPU peak", PREDICTED)],
                     {name: [getattr(b, f"{name}_bytes") / scale] for name in COMPONENTS},
                     "", f"memory ({unit})", title, stacked=True, hlines=hlines,
                     colors={f"{gpu} capacity": RULE_COLOR})


def default_gpu_type() -> str:
    """The first device type of the session's cluster (this machine by default), else DEFAULT_GPU."""
    from ui.state import get_cluster

    try:
        types = get_cluster().device_types()
    except Exception:  # the page must open even when the inventory cannot be read
        types = []
    return types[0] if types and types[0] in CATALOG else DEFAULT_GPU


def show_trace(spec: ModelSpec, cfg: MemoryConfig, predicted: MemoryBreakdown) -> None:
    """Trace one whole step of the same runtime (measured, profiler/tracing.py) on demand."""
    if spec.num_params > TRACE_LIMIT_PARAMS or cfg.tp > 1 or cfg.pp > 1:
        st.caption("Trace now: small models without tensor/pipeline parallelism here; use "
                   "`python -m profiler memory --fake` for large ones.")
        return
    if not st.button("Trace now (measured)", key="mem_trace"):
        return
    from profiler.tracing import trace_memory  # torch: only when asked

    fake = spec.num_params > REAL_TRACE_LIMIT_PARAMS
    with show_errors("Trace failed"), st.spinner("Tracing one training step…"):
        traced = trace_memory(spec, cfg, fake=fake)
        err = 100.0 * (predicted.peak_bytes - traced["peak_bytes"]) / traced["peak_bytes"]
        metric("Peak memory", fmt_bytes(traced["peak_bytes"]), MEASURED,
               help="live tensor bytes over one whole step of the sharded runtime"
                    + (" (fake tensors)" if fake else ""))
        st.caption(f"predicted − measured: {fmt_percent(err, 2, signed=True)} of the measured peak")


def main() -> None:
    page_header("Model & memory", "Will one training step fit? The per-GPU peak memory of this project's runtime, "
                "predicted by the memory model (planner/core/memory.py).")
    spec = choose_model()
    if spec is None:
        return
    st.caption(f"{spec.name}: {spec.family} family, {spec.num_params:,} parameters, {spec.num_layers} layers, "
               f"hidden {spec.hidden}, {spec.num_heads} heads ({spec.num_kv_heads} kv), vocab {spec.vocab_size}, "
               f"max seq {spec.max_seq}")
    choose_data(spec)
    cfg, gpu = choose_config(spec)
    if cfg is None:
        return
    b = None
    with show_errors("Cannot estimate memory"):
        b = estimate_memory(spec, cfg)
    if b is None:
        return
    capacity = CATALOG[gpu].memory_bytes
    c1, c2, c3 = st.columns(3)
    with c1:
        metric("Peak memory per GPU", fmt_bytes(b.peak_bytes), PREDICTED)
    with c2:
        metric("Model states (params + grads + AdamW)",
               fmt_bytes(b.params_bytes + b.grads_bytes + b.optimizer_bytes), PREDICTED)
    with c3:
        st.metric(f"{gpu} capacity (datasheet)", fmt_bytes(capacity))
    share = b.peak_bytes / capacity
    if share <= 1.0:
        st.success(f"Fits on {gpu}: predicted peak {fmt_bytes(b.peak_bytes)} is {share:.1%} of "
                   f"{fmt_bytes(capacity)} (CUDA context and allocator fragmentation not included).")
    else:
        st.error(f"Does not fit on {gpu}: predicted peak {fmt_bytes(b.peak_bytes)} is {share:.1%} of "
                 f"{fmt_bytes(capacity)}. Try recomputation, a smaller micro-batch, bf16 or a larger world size.")
    show_figure(breakdown_figure(b, capacity, gpu), key="mem_chart")
    # six fixed rows: a static table draws faster in a new tab than an interactive grid
    st.table([{"component": name, labelled("bytes", PREDICTED): f"{getattr(b, f'{name}_bytes'):,}",
               labelled("size", PREDICTED): fmt_bytes(getattr(b, f"{name}_bytes"))}
              for name in (*COMPONENTS, "peak")], hide_index=True)
    if cfg.tp == 1 and cfg.pp == 1:
        st.caption(f"ZeRO {cfg.zero} is what the runtime runs: this figure is checked against traces of the same "
                   "step (tests/unit/test_profiler_memory.py, within 3 %).")
    else:
        st.caption("Tensor/pipeline parallelism: analytic (the runtime runs sharded data parallelism).")
    show_trace(spec, cfg, b)


main()

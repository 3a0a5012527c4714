"""The training corpus: documents -> one packed token stream, cached; and the global sampler.

`build_corpus(source, tokenizer, progress, vocab_size)` -> the path of a cached corpus manifest
(`corpus.json`); `Corpus.load(path)` memory-maps its `.train` and `.val` streams. Sources: the
Python standard library's sources by default, a folder or file of text or JSON Lines, or
pre-tokenized `.npy` / `.bin` token files (used as given, memory-mapped). Text is tokenized in
parallel by executor.tokenizing, an end-of-document id after each document; the validation split
is by whole documents. The cache under `<data_dir>/corpus/<key>/` is keyed by the inputs' content
and built once under a lock, atomically; it is bounded (GPUMIX_CORPUS_CACHE_GB, default 20 GiB: least
recently used entries go first). `GlobalSampler`: (seed, step) -> the global batch's window
starts, the same for any plan, which a plan only cuts into rank / micro-batch pieces.

Sources, the split rule, the cache layout and its key: docs/executor.md ("The corpus").
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass

import numpy as np

from executor.tokenizing import COPY_TOKENS, Progress, TokenizerInfo, load_tokenizer, plan_units, write_text_corpus
from contracts.paths import sub_dir

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 1: byte arrays joined by blank lines (tokens-<key>.npy)
MANIFEST = "corpus.json"
VAL_EVERY = 20  # every 20th document held out: a 5 % validation split
VAL_FRACTION = 1.0 / VAL_EVERY
NUM_VAL_WINDOWS = 8  # fixed validation windows per evaluation (same every time)
MIN_VAL_TOKENS = 8192  # NUM_VAL_WINDOWS (8) disjoint windows of seq 1024
# 8 MiB of source is ~8M byte tokens: far more than a tiny model sees in a demo run,
# small enough to build in a second and to memory-map from every rank.
DEFAULT_MAX_BYTES = 8 * 2**20
# the corpus cache's bound: entries least recently used go once the cache holds more (GiB; a
# tokenized corpus is about 2-4 bytes per token, so 20 GiB keeps a few billion tokens)
ENV_CACHE_GB = "GPUMIX_CORPUS_CACHE_GB"
DEFAULT_CACHE_GB = 20.0
# an entry used this recently is never evicted: a launcher may have just handed it to its ranks
RECENT_USE_S = 600.0
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".ini", ".html", ".csv")
JSONL_SUFFIXES = (".jsonl",)
TOKEN_SUFFIXES = (".bin", ".npy")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


@dataclass(frozen=True)
class Source:
    """What `build_corpus` reads, classified: absolute paths in deterministic order."""
    root: str
    text_files: tuple[str, ...] = ()
    jsonl_files: tuple[str, ...] = ()
    token_files: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return self.text_files + self.jsonl_files + self.token_files


def _walk(root: str, suffixes: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes) and not f.startswith(".")]
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def resolve_source(source: str | None) -> Source:
    if source is None:
        root = default_corpus_dir()
        return Source(root, text_files=tuple(_walk(root, (".py",))))
    root = os.path.abspath(source)
    if not os.path.exists(root):
        raise ValueError(f"data not found: {source}")
    files = [root] if os.path.isfile(root) else _walk(root, TEXT_SUFFIXES + JSONL_SUFFIXES + TOKEN_SUFFIXES)
    tokens = tuple(f for f in files if f.endswith(TOKEN_SUFFIXES))
    jsonl = tuple(f for f in files if f.endswith(JSONL_SUFFIXES))
    # a file named on its own is text whatever its suffix; in a folder only TEXT_SUFFIXES are
    text = tuple(f for f in files if f not in tokens and f not in jsonl)
    if tokens and (text or jsonl):
        raise ValueError(f"data {source} mixes pre-tokenized token files with text; give one kind")
    if not files:
        raise ValueError(f"data folder {source} has no text, .jsonl, .bin or .npy files")
    return Source(root, text, jsonl, tokens)


def _fingerprint(path: str) -> str:
    """Size, mtime_ns and content (whole up to 8 KiB, else the first and last 4 KiB)."""
    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}\0{st.st_mtime_ns}".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(8192 if st.st_size <= 8192 else 4096))
        if st.st_size > 8192:
            fh.seek(-4096, os.SEEK_END)
            h.update(fh.read())
    return h.hexdigest()


def _cache_key(src: Source, files: list[str], tok: TokenizerInfo | None, max_bytes: int | None) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION}\0{src.root}\0{max_bytes}\0{VAL_EVERY}\0{MIN_VAL_TOKENS}".encode())
    h.update(f"\0tokenizer\0{tok.fingerprint if tok else 'as-given'}".encode())
    for path in files:
        h.update(f"\0{os.path.relpath(path, src.root)}\0{_fingerprint(path)}".encode())
    return h.hexdigest()[:16]


def build_corpus(source: str | None = None, tokenizer: str | None = None, progress: Progress | None = None,
                 vocab_size: int | None = None, *, max_bytes: int | None = None, cache_dir: str | None = None,
                 num_workers: int | None = None) -> str:
    """Tokenize `source` once (default: the stdlib's sources) and return the cached manifest's path.

    tokenizer: a local tokenizer.json (None: byte-level; for token files, None: ids as given).
    progress(fraction, message): called as the build goes (and once, (1.0, ...), on a cache hit).
    vocab_size: the model's vocabulary; ValueError when the corpus' ids do not fit it.
    max_bytes: read text inputs only up to this many bytes (default source: DEFAULT_MAX_BYTES).
    num_workers: tokenizer processes (None: one per core for a tokenizer.json, up to 8)."""
    src = resolve_source(source)
    if source is None and max_bytes is None:
        max_bytes = DEFAULT_MAX_BYTES
    tok = load_tokenizer(tokenizer) if (tokenizer is not None or not src.token_files) else None
    if tok is not None and vocab_size is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} ids, more than the model's "
                         f"vocabulary of {vocab_size}")
    units = plan_units(list(src.text_files), list(src.jsonl_files), max_bytes) if not src.token_files else []
    used = list(dict.fromkeys(p for u in units for p in u.paths)) if units else list(src.files)
    if not used:
        raise ValueError(f"data {source} has no input to read")
    cache_dir = cache_dir or sub_dir("corpus")
    os.makedirs(cache_dir, exist_ok=True)
    final = os.path.join(cache_dir, _cache_key(src, used, tok, max_bytes))
    manifest = os.path.join(final, MANIFEST)
    if not os.path.exists(manifest):
        with open(f"{final}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another rank building the same cache: wait for it
            if not os.path.exists(manifest):
                tmp = f"{final}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                try:
                    t0 = time.perf_counter()
                    if src.token_files:
                        meta = _write_token_corpus(tmp, list(src.token_files), tok, progress)
                    else:
                        meta = write_text_corpus(tmp, units, tok, num_workers, progress, VAL_EVERY, MIN_VAL_TOKENS)
                    meta.update(version=CACHE_VERSION, source=src.root, tokenizer=tok.path if tok else None,
                                build_s=time.perf_counter() - t0)
                    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
                        json.dump(meta, fh, indent=1)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                log.info("corpus: %d train + %d val tokens, %s + %s documents from %s (%s) in %.1f s -> %s",
                         meta["train"]["num_tokens"], meta["val"]["num_tokens"], meta["num_docs"]["train"],
                         meta["num_docs"]["val"], src.root, tok.name if tok else "ids as given",
                         meta["build_s"], final)
    else:
        _touch(manifest)  # the cache evicts least recently used entries first
        if progress is not None:
            progress(1.0, f"cached: {final}")
    evict_cache(cache_dir, keep=final)
    if vocab_size is not None:
        with open(manifest, encoding="utf-8") as fh:
            have = json.load(fh)["vocab_size"]
        if have > vocab_size:
            raise ValueError(f"data {source} uses token ids up to {have - 1}, outside the model's "
                             f"vocabulary of {vocab_size}")
    return manifest


# ---- the cache's bound -------------------------------------------------------------------------


def cache_limit_bytes() -> int:
    """The corpus cache's bound: GPUMIX_CORPUS_CACHE_GB (GiB, > 0), default DEFAULT_CACHE_GB."""
    raw = os.environ.get(ENV_CACHE_GB, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_CACHE_GB
    except ValueError:
        gb = -1.0
    if not 0 < gb < float("inf"):
        raise ValueError(f"{ENV_CACHE_GB}={raw!r}: expected the corpus cache's size in GiB, a number > 0")
    return int(gb * 2**30)


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:  # a cache on a read-only filesystem: nothing to record, nothing to evict
        pass


def _entry_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for f in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def evict_cache(cache_dir: str, keep: str | None = None, limit_bytes: int | None = None) -> list[str]:
    """Remove whole cache entries, least recently used first, until the cache holds at most
    `limit_bytes` (default: cache_limit_bytes()); never `keep` nor an entry used in the last
    RECENT_USE_S. The entries removed. Token files used in place are the user's: never counted."""
    limit = cache_limit_bytes() if limit_bytes is None else limit_bytes
    entries = []
    for name in os.listdir(cache_dir):
        folder = os.path.join(cache_dir, name)
        try:
            used_s = os.stat(os.path.join(folder, MANIFEST)).st_mtime
        except OSError:
            continue  # no manifest: a build in progress (its .tmp folder) or a lock file
        entries.append((used_s, folder, _entry_bytes(folder)))
    total = sum(e[2] for e in entries)
    removed: list[str] = []
    now = time.time()
    for used_s, folder, size in sorted(entries):
        if total <= limit:
            break
        if folder == keep or now - used_s < RECENT_USE_S:
            continue
        with open(f"{folder}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # not while a build of the same key holds it
            shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
        log.info("corpus cache over %.1f GiB: removed %s (%.1f MiB, least recently used)", limit / 2**30,
                 folder, size / 2**20)
    return removed


# ---- pre-tokenized token files ----------------------------------------------------------------
_TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32, np.int32)


def _open_token_file(path: str) -> np.memmap:
    """A token file as a 1-D memory map (nothing read yet); ValueError if it is not one."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"token file {path} is empty")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise ValueError(f"token file {path} is not a .npy array ({e})") from e
        if arr.dtype not in _TOKEN_DTYPES or not isinstance(arr, np.memmap) or not arr.flags.c_contiguous:
            raise ValueError(f"token file {path} holds {arr.dtype}; token ids are uint8/uint16/uint32/int32")
        return arr.reshape(-1)
    dtype = np.dtype(np.uint32 if path.endswith((".u32.bin", ".uint32.bin")) else np.uint16)
    if os.path.getsize(path) % dtype.itemsize:
        raise ValueError(f"token file {path}: {os.path.getsize(path)} bytes is not a whole number of {dtype} ids")
    return np.memmap(path, dtype=dtype, mode="r")


def _pieces(n: int):
    return ((i, min(i + COPY_TOKENS, n)) for i in range(0, n, COPY_TOKENS))


def _split_at_document(stream: np.ndarray, eod_id: int | None) -> int:
    """Where val starts: after the end-of-document id nearest before 95 % (else the first after)."""
    n = stream.size
    mark = min(n - 1, max(1, int(n * (1.0 - VAL_FRACTION))))
    if eod_id is None:
        return mark
    for hi in range(mark, 0, -COPY_TOKENS):  # backwards from the mark
        at = np.flatnonzero(stream[max(0, hi - COPY_TOKENS):hi] == eod_id)
        if at.size:
            return max(0, hi - COPY_TOKENS) + int(at[-1]) + 1
    for lo, hi in _pieces(n - 1):
        if hi > mark:
            at = np.flatnonzero(stream[max(lo, mark):hi] == eod_id)
            if at.size:
                return max(lo, mark) + int(at[0]) + 1
    return mark


def _write_token_corpus(tmp: str, files: list[str], tok: TokenizerInfo | None, progress: Progress | None) -> dict:
    maps = [_open_token_file(p) for p in files]
    n = sum(m.size for m in maps)
    if n < 2:
        raise ValueError(f"token files hold {n} token(s): too few for a train and a validation split")
    if len(maps) == 1:  # used in place: nothing copied
        stream, ref = maps[0], {"path": files[0], "dtype": maps[0].dtype.name, "offset_bytes": int(maps[0].offset)}
    else:  # joined into the cache piece by piece
        dtype = np.dtype(np.uint32) if any(m.dtype.itemsize == 4 for m in maps) else np.dtype(np.uint16)
        with open(os.path.join(tmp, "tokens.bin"), "wb") as fh:
            for m in maps:
                for lo, hi in _pieces(m.size):
                    np.asarray(m[lo:hi], dtype=dtype).tofile(fh)
        stream = np.memmap(os.path.join(tmp, "tokens.bin"), dtype=dtype, mode="r")
        ref = {"path": "tokens.bin", "dtype": dtype.name, "offset_bytes": 0}
    eod = tok.eod_id if tok else None
    lo_id, hi_id, docs = 0, 0, 0
    for lo, hi in _pieces(n):
        piece = stream[lo:hi]
        lo_id, hi_id = min(lo_id, int(piece.min())), max(hi_id, int(piece.max()))
        docs += int(np.count_nonzero(piece == eod)) if eod is not None else 0
        if progress is not None:
            progress(hi / n, f"checked {hi} of {n} token ids")
    if lo_id < 0:
        raise ValueError(f"token files hold a negative id ({lo_id})")
    if tok is not None and hi_id >= tok.vocab_size:
        raise ValueError(f"token files hold id {hi_id}, outside tokenizer {tok.path}'s {tok.vocab_size} ids")
    split = _split_at_document(stream, eod)
    val_docs = int(np.count_nonzero(stream[split:] == eod)) if eod is not None else None
    itemsize = stream.dtype.itemsize
    return {"kind": "tokens", "vocab_size": tok.vocab_size if tok else hi_id + 1, "eod_id": eod,
            "num_docs": {"train": docs - val_docs if eod is not None else None, "val": val_docs},
            "train": dict(ref, num_tokens=split),
            "val": dict(ref, offset_bytes=ref["offset_bytes"] + split * itemsize, num_tokens=n - split)}


# ---- reading a built corpus ---------------------------------------------------------------------
def _segment(folder: str, seg: dict) -> np.ndarray:
    path = os.path.join(folder, seg["path"])  # relative: a cache file; absolute: a source used in place
    if seg["num_tokens"] == 0:
        return np.empty(0, dtype=seg["dtype"])
    return np.memmap(path, dtype=seg["dtype"], mode="r", offset=seg["offset_bytes"], shape=(seg["num_tokens"],))


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # memory-mapped token ids
    val: np.ndarray
    eod_id: int | None  # None: pre-tokenized without a tokenizer (not known)
    vocab_size: int  # ids are < vocab_size
    train_doc_ends: np.ndarray | None = None  # exclusive end offset of each document (text corpora)
    val_doc_ends: np.ndarray | None = None
    path: str = ""

    @classmethod
    def load(cls, path: str) -> "Corpus":
        """The manifest `build_corpus` returned (or its folder)."""
        manifest = os.path.join(path, MANIFEST) if os.path.isdir(path) else path
        folder = os.path.dirname(manifest)
        try:
            with open(manifest, encoding="utf-8") as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"not a corpus manifest: {path} ({e})") from e
        docs = [os.path.join(folder, f"{s}_docs.npy") for s in ("train", "val")]
        ends = [np.load(p, mmap_mode="r") if os.path.exists(p) else None for p in docs]
        return cls(_segment(folder, meta["train"]), _segment(folder, meta["val"]), meta["eod_id"],
                   meta["vocab_size"], ends[0], ends[1], manifest)


# ---- sampling -----------------------------------------------------------------------------------
def windows(data: np.ndarray, starts: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, each (len(starts), seq) int64: one contiguous read per window."""
    w = np.empty((len(starts), seq + 1), dtype=np.int64)
    for i, s in enumerate(starts):
        w[i] = data[s:s + seq + 1]
    return w[:, :-1], w[:, 1:]


_ROUNDS = 6  # Feistel rounds: 4 already make a pseudorandom permutation (Luby-Rackoff)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (Steele et al. 2014): a strong 64-bit hash, uint64 -> uint64."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class GlobalSampler:
    """seed + step -> the start offsets of the global batch's `global_batch` windows.

    The training stream is cut into `num_windows` windows of seq + 1 tokens, window k starting at
    k·seq (consecutive windows share one token, so every token is a target once per epoch, as
    Megatron's GPT dataset does). Steps count from 1; step t takes positions (t-1)·B .. t·B-1 of
    the endless sequence epoch 0, epoch 1, ..., each epoch a different seeded permutation of
    all windows: every window exactly once per epoch, no sampling with replacement.

    The permutation is a keyed Feistel network over the next power of four ≥ num_windows with
    cycle walking (Black & Rogaway 2002): position -> window in O(1) memory, so a corpus of any
    size costs O(global_batch) per step and no epoch-sized array. Independent of the plan: any
    split of the same global batch trains on the same samples in the same order."""

    num_tokens: int
    seq: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < self.seq + 1:
            raise ValueError(f"corpus has {self.num_tokens} training tokens, fewer than one window of "
                             f"seq {self.seq} + 1")

    @property
    def num_windows(self) -> int:
        return (self.num_tokens - 1) // self.seq

    def epoch(self, step: int) -> int:
        """The epoch the first window of `step` is in."""
        return (step - 1) * self.global_batch // self.num_windows

    def _keys(self, epoch: int) -> np.ndarray:
        return np.random.PCG64([self.seed, epoch]).random_raw(_ROUNDS).astype(np.uint64)

    def _feistel(self, x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
        mask = np.uint64((1 << half_bits) - 1)
        left, right = x >> np.uint64(half_bits), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half_bits)) | right

    def permute(self, positions: np.ndarray, epoch: int) -> np.ndarray:
        """Window index at each position (0..num_windows-1) of `epoch`'s order."""
        n = self.num_windows
        half_bits = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 4^half_bits ≥ n
        keys = self._keys(epoch)
        out = self._feistel(positions.astype(np.uint64), keys, half_bits)
        outside = out >= n
        while outside.any():  # cycle walking: re-encrypt until inside [0, n); terminates (a permutation)
            out[outside] = self._feistel(out[outside], keys, half_bits)
            outside = out >= n
        return out.astype(np.int64)

    def starts(self, step: int) -> np.ndarray:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        flat = (step - 1) * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, positions = np.divmod(flat, self.num_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            m = epochs == e
            out[m] = self.permute(positions[m], int(e))
        return out * self.seq


def batch_slices(batches: list[int], position: int, micro_batch: int) -> list[slice]:
    """The micro-batch slices of the global batch that the `position`-th used device
    trains: the devices take consecutive pieces in plan order, each cut into
    `micro_batch`-sized micro-batches."""
    offset = sum(batches[:position])
    return [slice(offset + k, offset + k + micro_batch) for k in range(0, batches[position], micro_batch)]


def val_starts(num_val_tokens: int, seq: int, count: int) -> np.ndarray:
    """Fixed, evenly spaced validation windows (the same for every step and run)."""
    if num_val_tokens < seq + 2:
        raise ValueError(f"validation split has {num_val_tokens} tokens, fewer than seq {seq} + 2")
    return np.linspace(0, num_val_tokens - seq - 2, num=count).astype(np.int64)

"""The training corpus: text this machine already has, as byte-level tokens.

Default: the Python standard library's own `.py` sources
(`sysconfig.get_paths()["stdlib"]`, without `site-packages`), or any folder of text
files by choice. Files are read in sorted relative-path order and joined with a blank
line, so the token array is the same on every machine with the same files. Tokens are
bytes (vocab 256, the `tiny`/`small` presets' vocabulary), no tokenizer download.

The last `VAL_FRACTION` of the array is the held-out validation split. The array is
cached as `.npy` under `<data_dir>/corpus/`, named by a hash of the file list (paths,
sizes, mtimes) and the byte cap, so a changed folder builds a new cache.

`GlobalSampler` is the deterministic global sampler: (seed, step) -> the global batch's
window start offsets, identical for any plan; the plan only cuts that list into
rank / micro-batch pieces, in order (see `batch_slices`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

from planner.paths import sub_dir

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # byte-level tokens
VAL_FRACTION = 0.05  # tail of the corpus held out for validation loss
# 8 MiB of source is ~8M tokens: far more than a tiny model sees in a demo run,
# small enough to build in a second and to memory-map from every rank.
DEFAULT_MAX_BYTES = 8 * 2**20
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".toml", ".cfg", ".ini", ".html", ".csv")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def default_corpus_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _list_files(root: str) -> list[str]:
    """Relative paths of the text files under `root`, sorted (deterministic order)."""
    suffixes = (".py",) if os.path.abspath(root) == os.path.abspath(default_corpus_dir()) else TEXT_SUFFIXES
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for f in filenames:
            if f.endswith(suffixes):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(out)


def _cache_key(root: str, files: list[str], max_bytes: int) -> str:
    h = hashlib.sha256(f"{os.path.abspath(root)}\0{max_bytes}".encode())
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        h.update(f"\0{rel}\0{st.st_size}\0{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def build_corpus(corpus_dir: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, cache_dir: str | None = None) -> str:
    """Tokenize the folder (default: the stdlib) once; return the cached `.npy` path."""
    root = corpus_dir or default_corpus_dir()
    if not os.path.isdir(root):
        raise ValueError(f"corpus folder not found: {root}")
    files = _list_files(root)
    if not files:
        raise ValueError(f"corpus folder {root} has no text files ({', '.join(TEXT_SUFFIXES)})")
    cache_dir = cache_dir or sub_dir("corpus")
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"tokens-{_cache_key(root, files, max_bytes)}.npy")
    if os.path.exists(path):
        return path
    chunks: list[bytes] = []
    total = 0
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as fh:
                data = fh.read(max_bytes - total)
        except OSError:
            continue  # unreadable file: skipped, the hash still names the folder state
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if total >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, tokens)
    os.replace(tmp, path)  # atomic: concurrent builders never see half a file
    log.info("corpus: %d files, %d tokens from %s -> %s", len(chunks), tokens.size, root, path)
    return path


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # uint8, memory-mapped

    @property
    def split(self) -> int:
        return int(self.tokens.size * (1.0 - VAL_FRACTION))

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.split]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.split :]

    @classmethod
    def load(cls, path: str) -> "Corpus":
        return cls(np.load(path, mmap_mode="r"))


def windows(data: np.ndarray, starts: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token targets, each (len(starts), seq) int64."""
    idx = starts[:, None] + np.arange(seq + 1)[None, :]  # (n, seq+1)
    w = np.asarray(data[idx], dtype=np.int64)
    return w[:, :-1], w[:, 1:]


@dataclass(frozen=True)
class GlobalSampler:
    """seed + step -> the start offsets of the global batch's `global_batch` windows.

    Independent of the plan: any split of the same global batch trains on the same
    samples in the same order, which is what makes the 1-rank and the uneven n-rank
    runs the same training."""

    num_tokens: int
    seq: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < self.seq + 2:
            raise ValueError(f"corpus has {self.num_tokens} training tokens, fewer than seq {self.seq} + 2")

    def starts(self, step: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return rng.integers(0, self.num_tokens - self.seq - 1, size=self.global_batch)


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

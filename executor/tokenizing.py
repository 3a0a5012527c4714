"""Documents -> token arrays: the tokenizer and the parallel, order-preserving tokenization.

Two tokenizers (`load_tokenizer`): byte-level (a document's UTF-8 bytes, vocabulary 256, byte 0
as end-of-document, so a text file containing NUL is skipped as binary), or a local
`tokenizer.json` through the `tokenizers` library (never the hub), its end-of-document id from
`tokenizer_config.json` or `EOD_TOKENS`. Documents are read in `Unit`s of about `UNIT_BYTES` and
encoded by forked workers, results taken back in input order, so the stream is the same for any
number of processes; each unit returns one flat array of ids and the documents' lengths, never a
Python list of ints.

The rules in full: docs/executor.md ("The corpus").
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

log = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256
BYTE_EOD_ID = 0  # NUL: see the module docstring
EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
# ~1 MiB of text is ~0.1-0.5 s of BPE work: long enough that a unit's pickling back to the
# parent is a small part of it, short enough that 8 MiB of input still feeds 8 processes.
UNIT_BYTES = 1 << 20
MAX_FILES_PER_UNIT = 512
PARALLEL_MIN_BYTES = 2 * UNIT_BYTES  # below this, starting processes costs more than it saves
COPY_TOKENS = 1 << 24  # tokens per piece when copying or scanning a memory-mapped stream

Progress = Callable[[float, str], None]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding ids 0..vocab_size-1 (uint8 bytes, uint16 for GPT-2's
    50257, uint32 for Llama-3's 128256)."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ValueError(f"vocabulary of {vocab_size} ids does not fit 32-bit token ids")


@dataclass(frozen=True)
class TokenizerInfo:
    path: str | None  # None: byte-level
    vocab_size: int  # ids are 0..vocab_size-1, added tokens included
    eod_id: int
    fingerprint: str  # content hash of tokenizer.json (and the chosen end-of-document id)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    @property
    def name(self) -> str:
        return self.path or "byte-level"


def _configured_eos(tokenizer_json: str) -> str | None:
    """`eos_token` of a tokenizer_config.json in the same folder (a string or {"content": ...})."""
    cfg = os.path.join(os.path.dirname(tokenizer_json), "tokenizer_config.json")
    try:
        with open(cfg, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(path: str | None) -> TokenizerInfo:
    """Byte-level for None, else the local tokenizer.json; ValueError (one line) if unusable."""
    if path is None:
        return TokenizerInfo(None, BYTE_VOCAB_SIZE, BYTE_EOD_ID, "byte-level-nul-eod")
    from tokenizers import Tokenizer

    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer not found: {path}")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises its own Exception type
        raise ValueError(f"tokenizer {path} is not a tokenizers tokenizer.json ({str(e).splitlines()[0]})") from e
    configured = _configured_eos(path)
    candidates = ((configured,) if configured else ()) + EOD_TOKENS
    eod = next((i for i in map(tok.token_to_id, candidates) if i is not None), None)
    if eod is None:
        raise ValueError(f"tokenizer {path} has no end-of-document token (none of {', '.join(candidates)})")
    with open(path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()[:16]
    return TokenizerInfo(path, tok.get_vocab_size(with_added_tokens=True), eod, f"{digest}-eod{eod}")


@dataclass(frozen=True)
class Unit:
    """One piece of work: text files (one document each), or bytes [start, stop) of a JSON
    Lines file, cut at line ends."""
    kind: str  # "files" | "jsonl"
    paths: tuple[str, ...]
    start: int = 0
    stop: int = 0
    num_bytes: int = 0


def plan_units(text_files: list[str], jsonl_files: list[str], max_bytes: int | None = None) -> list[Unit]:
    """The units of the input in order; with `max_bytes`, only the first units whose input adds
    up to it (whole files, whole JSON Lines pieces), so the stream is still deterministic."""
    units: list[Unit] = []
    total = 0
    group: list[str] = []
    group_bytes = 0

    def full() -> bool:
        return max_bytes is not None and total >= max_bytes

    for path in text_files:
        if full():
            break
        size = os.path.getsize(path)
        group.append(path)
        group_bytes += size
        total += size
        if group_bytes >= UNIT_BYTES or len(group) >= MAX_FILES_PER_UNIT:
            units.append(Unit("files", tuple(group), num_bytes=group_bytes))
            group, group_bytes = [], 0
    if group:
        units.append(Unit("files", tuple(group), num_bytes=group_bytes))
    for path in jsonl_files:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            start = 0
            while start < size and not full():
                fh.seek(min(start + UNIT_BYTES, size))
                fh.readline()  # to the end of the line the cut fell into
                stop = min(fh.tell(), size)
                units.append(Unit("jsonl", (path,), start, stop, stop - start))
                total += stop - start
                start = stop
    return units


@dataclass
class UnitResult:
    tokens: np.ndarray  # every document's ids followed by the end-of-document id
    lengths: np.ndarray  # int64, tokens per document (its end-of-document id included)
    num_lines: int = 0  # JSON Lines units: lines read (to number the lines of later units)
    error: str | None = None  # a bad line: "line K: why" with K counted within the unit
    error_line: int = 0
    num_skipped: int = 0  # binary text files (they contain the byte-level end-of-document byte)


class Encoder:
    """Encodes units; one per process (the `tokenizers` object is loaded once)."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self.tok = None
        if info.path is not None:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(info.path)

    def _pack(self, docs: list) -> tuple[np.ndarray, np.ndarray]:
        """Documents (str, or bytes for byte-level) -> (flat ids with EOD after each, lengths)."""
        eod = self.info.eod_id
        if self.tok is None:
            lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
            return np.frombuffer(b"".join(d + b"\0" for d in docs), dtype=np.uint8).copy(), lengths
        ids = [e.ids for e in self.tok.encode_batch_fast(docs)]
        ids = [i if i and i[-1] == eod else i + [eod] for i in ids]  # a post-processor may end with it
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.info.dtype, count=int(lengths.sum()))
        return flat, lengths

    def encode(self, unit: Unit) -> UnitResult:
        if unit.kind == "files":
            return self._files(unit)
        return self._jsonl(unit)

    def _files(self, unit: Unit) -> UnitResult:
        docs: list = []
        skipped = 0
        for path in unit.paths:
            try:
                with open(path, "rb") as fh:
                    raw = fh.read()
            except OSError as e:
                log.warning("skipping unreadable %s (%s)", path, e)
                skipped += 1
                continue
            if not raw:
                continue
            if b"\0" in raw:  # binary: its bytes could not be told from the end-of-document byte
                skipped += 1
                continue
            docs.append(raw if self.tok is None else raw.decode("utf-8", errors="replace"))
        tokens, lengths = self._pack(docs)
        return UnitResult(tokens, lengths, num_skipped=skipped)

    def _jsonl(self, unit: Unit) -> UnitResult:
        with open(unit.paths[0], "rb") as fh:
            fh.seek(unit.start)
            data = fh.read(unit.stop - unit.start)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the piece ends with a newline: no line after it
        docs: list = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            why = None
            try:
                obj = json.loads(line)
            except ValueError as e:
                why = f"not valid JSON ({getattr(e, 'msg', e)})"
            else:
                if not isinstance(obj, dict) or "text" not in obj:
                    why = 'no "text" field'
                elif not isinstance(obj["text"], str):
                    why = f'"text" is {type(obj["text"]).__name__}, not a string'
            if why is not None:
                return UnitResult(np.empty(0, self.info.dtype), np.empty(0, np.int64), len(lines), why, i + 1)
            text = obj["text"]
            if text:
                docs.append(text.encode("utf-8").replace(b"\0", b"") if self.tok is None else text)
        tokens, lengths = self._pack(docs)
        return UnitResult(tokens, lengths, len(lines))


_ENCODER: Encoder | None = None  # the worker process's own


def _init_worker(info: TokenizerInfo) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = Encoder(info)


def _encode_in_worker(unit: Unit) -> UnitResult:
    assert _ENCODER is not None
    return _ENCODER.encode(unit)


def default_num_workers(info: TokenizerInfo, total_bytes: int) -> int:
    """Byte-level is a copy (I/O bound): one process. BPE is CPU bound: one per core, up to 8."""
    if info.path is None or total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 8, total_bytes // UNIT_BYTES))


def tokenize_units(units: list[Unit], info: TokenizerInfo, num_workers: int | None = None,
                   progress: Progress | None = None) -> Iterator[UnitResult]:
    """Encode the units, `num_workers` processes (None: `default_num_workers`), in order.
    Raises ValueError naming the file and line of the first bad JSON Lines line."""
    total = sum(u.num_bytes for u in units) or 1
    workers = num_workers or default_num_workers(info, total)
    lines_before: dict[str, int] = {}  # JSON Lines file -> lines in its units already seen
    done = 0
    results = _results(units, info, workers)
    try:
        for unit, r in zip(units, results):
            path = unit.paths[0]
            if r.error is not None:
                line = lines_before.get(path, 0) + r.error_line
                raise ValueError(f"{path}: line {line}: {r.error}")
            if unit.kind == "jsonl":
                lines_before[path] = lines_before.get(path, 0) + r.num_lines
            done += unit.num_bytes
            if progress is not None:
                progress(done / total, f"tokenized {done / 2**20:.1f} of {total / 2**20:.1f} MiB "
                                       f"({workers} process{'es' if workers > 1 else ''})")
            yield r
    finally:
        results.close()  # ends the worker processes now, also when a bad line stopped us early


def _results(units: list[Unit], info: TokenizerInfo, workers: int) -> Iterator[UnitResult]:
    """The units' results in input order: in this process, or from `workers` processes with at
    most 2 units per process in flight (results never pile up in memory). A worker that dies
    (killed, out of memory) raises BrokenProcessPool instead of hanging; leaving early (a bad
    line) cancels what is queued."""
    if workers <= 1 or len(units) <= 1:
        yield from map(Encoder(info).encode, units)
        return
    # fork: the children run only tokenizers and numpy, start in milliseconds and, unlike spawn
    # and forkserver, need no importable __main__ (a notebook or `python -` would respawn forever)
    ctx = multiprocessing.get_context("fork")
    ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(info,))
    try:
        todo = iter(units)
        pending = collections.deque(ex.submit(_encode_in_worker, u) for u in itertools.islice(todo, 2 * workers))
        while pending:
            r = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(ex.submit(_encode_in_worker, nxt))
            yield r
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


# ---- the text corpus on disk -------------------------------------------------------------------
def _move_tail(tmp: str, dtype: np.dtype, num_tokens: int, val_fh) -> None:
    """Move the last `num_tokens` of train.bin to the end of val.bin, piece by piece."""
    path = os.path.join(tmp, "train.bin")
    mm = np.memmap(path, dtype=dtype, mode="r")
    n = mm.size
    for i in range(n - num_tokens, n, COPY_TOKENS):
        np.asarray(mm[i:min(i + COPY_TOKENS, n)]).tofile(val_fh)
    del mm
    os.truncate(path, (n - num_tokens) * dtype.itemsize)


def write_text_corpus(tmp: str, units: list[Unit], tok: TokenizerInfo, num_workers: int | None,
                      progress: Progress | None, val_every: int, min_val_tokens: int) -> dict:
    """Tokenize the units into `tmp`/train.bin and val.bin (raw ids), written as they come, and
    each document's end offset into train_docs.npy / val_docs.npy; returns the manifest's fields.

    Held out, by documents: every `val_every`-th; when that gives fewer than
    min(min_val_tokens, tokens / val_every), whole documents from train's end are moved to val
    (never more than half the tokens), and with none movable the last document's tail is cut off."""
    train_lens: list[np.ndarray] = []  # tokens per document: one int per document, not per token
    val_lens: list[np.ndarray] = []
    num_docs = skipped = 0
    with open(os.path.join(tmp, "train.bin"), "wb") as train_fh, open(os.path.join(tmp, "val.bin"), "wb") as val_fh:
        for r in tokenize_units(units, tok, num_workers, progress):
            held = np.arange(num_docs, num_docs + r.lengths.size) % val_every == val_every - 1
            num_docs += r.lengths.size
            skipped += r.num_skipped
            in_val = np.repeat(held, r.lengths)  # per token: its document is held out
            r.tokens[~in_val].tofile(train_fh)
            r.tokens[in_val].tofile(val_fh)
            train_lens.append(r.lengths[~held])
            val_lens.append(r.lengths[held])
        if num_docs == 0:
            raise ValueError(f"no documents in the data ({skipped} binary or unreadable files skipped)"
                             if skipped else "no documents in the data: every input is empty")
        train, val = np.concatenate(train_lens), np.concatenate(val_lens)
        total = int(train.sum() + val.sum())
        target = min(min_val_tokens, -(-total // val_every))
        # too little held out (few or small documents): move whole documents from train's end to
        # val, never more than half of the tokens
        k = moved = 0
        have = int(val.sum())
        while have + moved < target and k < train.size - 1 and have + moved + train[-1 - k] <= total // 2:
            moved += int(train[-1 - k])
            k += 1
        train_fh.flush()
        if moved:
            _move_tail(tmp, tok.dtype, moved, val_fh)
            train, val = train[: train.size - k], np.concatenate([val, train[train.size - k:]])
        if val.size == 0:  # one document, or only huge ones at the end: cut the last one
            cut = max(1, min(target, int(train[-1]) - 1))
            _move_tail(tmp, tok.dtype, cut, val_fh)
            train[-1] -= cut
            val = np.array([cut], dtype=np.int64)
            log.warning("corpus has no document to hold out whole: the last %d tokens of its last "
                        "document are the validation split", cut)
    np.save(os.path.join(tmp, "train_docs.npy"), np.cumsum(train))
    np.save(os.path.join(tmp, "val_docs.npy"), np.cumsum(val))
    dt = tok.dtype.name
    return {"kind": "text", "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
            "num_docs": {"train": int(train.size), "val": int(val.size)}, "num_skipped_files": skipped,
            "train": {"path": "train.bin", "dtype": dt, "offset_bytes": 0, "num_tokens": int(train.sum())},
            "val": {"path": "val.bin", "dtype": dt, "offset_bytes": 0, "num_tokens": int(val.sum())}}

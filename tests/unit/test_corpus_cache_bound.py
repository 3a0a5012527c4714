"""The corpus cache's bound (executor/corpus.py): least recently used entries go first, never the
one in use nor one used in the last RECENT_USE_S, never a build in progress."""
from __future__ import annotations

import os
import time

import pytest

from executor import corpus


def _entry(cache, name: str, size: int, used_s_ago: float) -> str:
    folder = cache / name
    folder.mkdir()
    (folder / "train.bin").write_bytes(b"\0" * size)
    manifest = folder / corpus.MANIFEST
    manifest.write_text("{}")
    t = time.time() - used_s_ago
    os.utime(manifest, (t, t))
    return str(folder)


def test_least_recently_used_entries_go_until_the_cache_fits(tmp_path):
    old = _entry(tmp_path, "old", 4000, 3 * 86400)
    mid = _entry(tmp_path, "mid", 4000, 2 * 86400)
    new = _entry(tmp_path, "new", 4000, 86400)
    recent = _entry(tmp_path, "recent", 4000, 10)
    (tmp_path / "building.tmp-1").mkdir()  # no manifest: a build in progress
    (tmp_path / "building.tmp-1" / "train.bin").write_bytes(b"\0" * 10**5)
    removed = corpus.evict_cache(str(tmp_path), keep=old, limit_bytes=9000)
    assert removed == [mid, new]  # old is the one in use; recent was just handed to a run
    assert os.path.isdir(old) and os.path.isdir(recent) and os.path.isdir(tmp_path / "building.tmp-1")
    assert corpus.evict_cache(str(tmp_path), limit_bytes=10**9) == []


def test_the_bound_is_configured_in_gib(monkeypatch):
    monkeypatch.delenv(corpus.ENV_CACHE_GB, raising=False)
    assert corpus.cache_limit_bytes() == int(corpus.DEFAULT_CACHE_GB * 2**30)
    monkeypatch.setenv(corpus.ENV_CACHE_GB, "0.5")
    assert corpus.cache_limit_bytes() == 2**29
    for bad in ("0", "-1", "nan", "lots"):
        monkeypatch.setenv(corpus.ENV_CACHE_GB, bad)
        with pytest.raises(ValueError, match="GPUMIX_CORPUS_CACHE_GB"):
            corpus.cache_limit_bytes()


def test_a_cache_hit_marks_the_entry_used_and_a_small_bound_evicts_the_older(tmp_path, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("hello world " * 2000)
    cache = tmp_path / "cache"
    first = corpus.build_corpus(str(docs), cache_dir=str(cache), num_workers=1)
    t = time.time() - 86400
    os.utime(first, (t, t))
    corpus.build_corpus(str(docs), cache_dir=str(cache), num_workers=1)  # a hit
    assert os.stat(first).st_mtime > t + 3600
    (docs / "b.txt").write_text("another document " * 2000)  # another key
    os.utime(first, (t, t))
    monkeypatch.setenv(corpus.ENV_CACHE_GB, str(1 / 2**30))  # 1 byte: only the entry in use stays
    second = corpus.build_corpus(str(docs), cache_dir=str(cache), num_workers=1)
    assert os.path.exists(second) and not os.path.exists(first)

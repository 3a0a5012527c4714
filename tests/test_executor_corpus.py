import numpy as np
import pytest

from executor.corpus import Corpus, GlobalSampler, batch_slices, build_corpus, val_starts, windows


def test_corpus_from_a_folder_is_deterministic_bytes_with_a_validation_tail(tmp_path):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"second file\n")
    (src / "a.txt").write_bytes(b"first file\n")
    (src / "sub" / "c.md").write_bytes(b"third\n" * 100)
    (src / "skip.bin").write_bytes(b"\x00\x01")
    p1 = build_corpus(str(src), cache_dir=str(tmp_path / "c1"))
    p2 = build_corpus(str(src), cache_dir=str(tmp_path / "c2"))
    t1, t2 = np.load(p1), np.load(p2)
    assert t1.dtype == np.uint8 and np.array_equal(t1, t2)
    # sorted order, files joined by a blank line, the binary file left out
    assert bytes(t1[:24]) == b"first file\n\n\nsecond file"
    assert b"\x00\x01" not in bytes(t1)
    c = Corpus.load(p1)
    assert c.train.size + c.val.size == t1.size and 0 < c.val.size < c.train.size
    assert build_corpus(str(src), cache_dir=str(tmp_path / "c1")) == p1  # cached


def test_missing_or_empty_corpus_folder_is_bad_input(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        build_corpus(str(tmp_path / "nope"), cache_dir=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        build_corpus(str(tmp_path / "empty"), cache_dir=str(tmp_path))


def test_default_corpus_is_the_stdlib_sources(tmp_path):
    c = Corpus.load(build_corpus(cache_dir=str(tmp_path), max_bytes=200_000))
    assert c.tokens.size == 200_000
    assert b"import" in bytes(c.tokens[:200_000])


def test_global_sampler_is_a_function_of_seed_and_step_only():
    s = GlobalSampler(num_tokens=10_000, seq=16, global_batch=8, seed=3)
    assert np.array_equal(s.starts(5), GlobalSampler(10_000, 16, 8, 3).starts(5))
    assert not np.array_equal(s.starts(5), s.starts(6))
    assert not np.array_equal(s.starts(5), GlobalSampler(10_000, 16, 8, 4).starts(5))
    assert s.starts(1).max() + 16 + 1 <= 10_000


def test_batch_slices_cut_the_global_batch_in_plan_order():
    batches = [5, 2, 1]
    pieces = [batch_slices(batches, 0, 5), batch_slices(batches, 1, 1), batch_slices(batches, 2, 1)]
    flat = [i for rank in pieces for sl in rank for i in range(sl.start, sl.stop)]
    assert flat == list(range(8))
    assert pieces[1] == [slice(5, 6), slice(6, 7)]


def test_windows_are_next_token_pairs():
    data = np.arange(100, dtype=np.uint8)
    x, y = windows(data, np.array([0, 10]), 4)
    assert x.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert y.tolist() == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert val_starts(50, 4, 3).tolist() == [0, 22, 44]

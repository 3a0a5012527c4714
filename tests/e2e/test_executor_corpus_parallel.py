"""Tokenizing a corpus with worker processes gives the serial stream and reports progress (the rest of
the corpus: tests/unit/test_executor_corpus.py)."""
import numpy as np

import executor.tokenizing as tokenize_mod
from executor.corpus import Corpus, build_corpus
from tests.unit.test_executor_corpus import _jsonl, _texts, _train_tokenizer


def test_parallel_tokenization_is_the_serial_stream_and_reports_progress(tmp_path, monkeypatch):
    texts = _texts(300)
    _train_tokenizer(tmp_path / "tok.json", texts)
    data = _jsonl(tmp_path / "d.jsonl", texts)
    monkeypatch.setattr(tokenize_mod, "UNIT_BYTES", 2000)  # many units for two processes
    seen = []
    serial = Corpus.load(build_corpus(data, str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "a"), num_workers=1))
    par = Corpus.load(build_corpus(data, str(tmp_path / "tok.json"), lambda f, m: seen.append((f, m)),
                                   cache_dir=str(tmp_path / "b"), num_workers=2))
    assert np.array_equal(serial.train, par.train) and np.array_equal(serial.val, par.val)
    fractions = [f for f, _ in seen]
    assert len(fractions) > 5 and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert "2 processes" in seen[-1][1]

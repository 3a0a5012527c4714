"""executor.corpus / executor.tokenizing: sources -> packed token streams with end-of-document ids,
the document-level validation split, the cache, and the epoch sampler.

Expected streams are computed here straight from `tokenizers` (Tokenizer.encode per document),
never through executor.tokenizing."""
import json
import os

import numpy as np
import pytest

import executor.tokenizing as tokenize_mod
from executor.corpus import Corpus, GlobalSampler, batch_slices, build_corpus, val_starts, windows

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jackdaws".split()


def _texts(n: int) -> list[str]:
    """n distinct documents (distinct so a document can be told from the others)."""
    return [f"document {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(5 + i % 11)) + f" end{i}"
            for i in range(n)]


def _train_tokenizer(path, texts, vocab_size=120, eod="</s>"):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", eod]))
    tok.save(str(path))
    return tok


def _docs(stream: np.ndarray, eod: int) -> list[tuple[int, ...]]:
    """A stream cut after each end-of-document id (every document ends with one)."""
    ends = np.flatnonzero(np.asarray(stream) == eod) + 1
    assert ends.size and ends[-1] == stream.size, "the stream must end with an end-of-document id"
    return [tuple(int(t) for t in d) for d in np.split(np.asarray(stream), ends[:-1])]


def _jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts))
    return str(path)


# ---- text sources ------------------------------------------------------------------------------
def test_folder_gives_byte_documents_each_ended_by_nul_and_skips_binary_files(tmp_path):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"second file\n")
    (src / "a.txt").write_bytes(b"first file\n")
    (src / "sub" / "c.md").write_bytes(b"third\n" * 100)
    (src / "z.txt").write_bytes(b"has a \x00 byte")  # binary: NUL is the end-of-document byte
    (src / "skip.dat").write_bytes(b"not a text suffix")
    p = build_corpus(str(src), cache_dir=str(tmp_path / "c1"))
    c = Corpus.load(p)
    assert c.eod_id == 0 and c.vocab_size == 256 and c.train.dtype == np.uint8
    whole = bytes(c.train) + bytes(c.val)
    # sorted relative paths, NUL after each document; one document: val is the last one's tail
    assert whole == b"first file\n\0second file\n\0" + b"third\n" * 100 + b"\0"
    assert 0 < c.val.size < c.train.size
    # a second cache folder builds the same bytes
    c2 = Corpus.load(build_corpus(str(src), cache_dir=str(tmp_path / "c2")))
    assert np.array_equal(c2.train, c.train) and np.array_equal(c2.val, c.val)


def test_jsonl_and_folder_with_a_tokenizer_give_the_tokenizers_ids_and_a_document_split(tmp_path):
    texts = _texts(60)
    tok = _train_tokenizer(tmp_path / "tokenizer.json", texts)
    eod = tok.token_to_id("</s>")
    expected = [tuple(tok.encode(t).ids) + (eod,) for t in texts]
    c = Corpus.load(build_corpus(_jsonl(tmp_path / "d.jsonl", texts), str(tmp_path / "tokenizer.json"),
                                 cache_dir=str(tmp_path / "c")))
    assert c.eod_id == eod and c.vocab_size == tok.get_vocab_size() and c.train.dtype == np.uint8
    train, val = _docs(c.train, eod), _docs(c.val, eod)
    assert len(train) + len(val) == 60 and len(c.train_doc_ends) == len(train) and len(c.val_doc_ends) == len(val)
    # every 20th document is held out; no document is in both; train keeps the input order
    assert {expected[19], expected[39], expected[59]} <= set(val)
    assert not set(train) & set(val)
    assert train == [d for d in expected if d not in set(val)]
    assert sorted(train + val) == sorted(expected)
    assert c.val.size >= 0.05 * (c.train.size + c.val.size)
    # a folder of the same texts, one file each, in sorted-name order: the same streams
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"doc_{i:03d}.txt").write_text(t, encoding="utf-8")
    f = Corpus.load(build_corpus(str(folder), str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "c")))
    assert np.array_equal(f.train, c.train) and np.array_equal(f.val, c.val)


def test_a_one_document_corpus_holds_out_its_tail(tmp_path):
    (tmp_path / "one.txt").write_bytes(b"x" * 999)
    c = Corpus.load(build_corpus(str(tmp_path / "one.txt"), cache_dir=str(tmp_path / "c")))
    assert c.val.size == 50 and bytes(c.train) + bytes(c.val) == b"x" * 999 + b"\0"


def test_default_corpus_is_the_stdlib_sources_up_to_the_byte_cap(tmp_path):
    c = Corpus.load(build_corpus(cache_dir=str(tmp_path), max_bytes=200_000))
    total = c.train.size + c.val.size
    assert 200_000 <= total < 200_000 + 2**20  # whole files until the cap is passed
    assert b"import" in bytes(c.train[:50_000]) and c.eod_id == 0


# ---- pre-tokenized sources ---------------------------------------------------------------------
def test_token_files_are_memory_mapped_in_place_and_split_after_an_end_of_document(tmp_path):
    texts = _texts(40)
    tok = _train_tokenizer(tmp_path / "tok.json", texts)
    eod = tok.token_to_id("</s>")
    stream = np.concatenate([np.array(tok.encode(t).ids + [eod], dtype=np.uint16) for t in texts])
    np.save(tmp_path / "tokens.npy", stream)
    c = Corpus.load(build_corpus(str(tmp_path / "tokens.npy"), str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "c")))
    assert isinstance(c.train, np.memmap) and os.path.samefile(c.train.filename, tmp_path / "tokens.npy")
    assert np.array_equal(np.concatenate([c.train, c.val]), stream)
    assert c.train[-1] == eod and c.val[-1] == eod and 0 < c.val.size < 0.2 * stream.size
    assert c.eod_id == eod and c.vocab_size == tok.get_vocab_size()


def test_raw_bin_files_uint16_and_uint32_and_a_folder_of_them(tmp_path):
    src = tmp_path / "tokens"
    src.mkdir()
    a = np.arange(0, 500, dtype=np.uint16)
    b = np.arange(70_000, 70_300, dtype=np.uint32)
    a.tofile(src / "a.bin")
    b.tofile(src / "b.u32.bin")
    one = Corpus.load(build_corpus(str(src / "a.bin"), cache_dir=str(tmp_path / "c")))
    assert np.array_equal(np.concatenate([one.train, one.val]), a)
    assert one.eod_id is None and one.vocab_size == 500 and one.val.size == 25  # no documents known: 95 %
    both = Corpus.load(build_corpus(str(src), cache_dir=str(tmp_path / "c")))
    assert both.train.dtype == np.uint32 and both.vocab_size == 70_300
    assert np.array_equal(np.concatenate([both.train, both.val]), np.concatenate([a, b]))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 65536"):
        build_corpus(str(src / "b.u32.bin"), cache_dir=str(tmp_path / "c"), vocab_size=65536)


# ---- the cache ---------------------------------------------------------------------------------
def test_a_cache_hit_does_not_tokenize_and_a_changed_input_or_tokenizer_rebuilds(tmp_path, monkeypatch):
    texts = _texts(30)
    _train_tokenizer(tmp_path / "tok.json", texts)
    data = _jsonl(tmp_path / "d.jsonl", texts)
    cache = str(tmp_path / "c")
    first = build_corpus(data, str(tmp_path / "tok.json"), cache_dir=cache)
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(tokenize_mod, "tokenize_units", refuse)
    hits = []
    assert build_corpus(data, str(tmp_path / "tok.json"), lambda f, m: hits.append(m),
                        cache_dir=cache) == first
    assert hits and hits[0].startswith("cached") and not calls
    monkeypatch.undo()
    # same size, other content: a new cache
    edited = [t.replace("fox", "cat") for t in texts]
    _jsonl(tmp_path / "d.jsonl", edited)
    second = build_corpus(data, str(tmp_path / "tok.json"), cache_dir=cache)
    assert second != first
    assert not np.array_equal(Corpus.load(second).train, Corpus.load(first).train)
    # another tokenizer: a new cache
    _train_tokenizer(tmp_path / "tok.json", texts, vocab_size=100)
    assert build_corpus(data, str(tmp_path / "tok.json"), cache_dir=cache) not in (first, second)


# ---- refusals: one clear line each -------------------------------------------------------------
def _one_line_error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as e:
        build_corpus(*args, **kwargs)
    assert "\n" not in str(e.value)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    _train_tokenizer(tmp_path / "tok.json", _texts(30), vocab_size=120)
    (tmp_path / "a.txt").write_text("hello", encoding="utf-8")
    _one_line_error(r"tokenizer .*tok.json has 1\d\d ids, more than the model's vocabulary of 64",
                    str(tmp_path / "a.txt"), str(tmp_path / "tok.json"), vocab_size=64, cache_dir=str(tmp_path))
    _one_line_error("byte-level has 256 ids", str(tmp_path / "a.txt"), vocab_size=100, cache_dir=str(tmp_path))
    build_corpus(str(tmp_path / "a.txt"), vocab_size=256, cache_dir=str(tmp_path))  # fits exactly


def test_bad_inputs_are_refused_with_one_line_naming_the_problem(tmp_path, monkeypatch):
    c = str(tmp_path / "cache")
    _one_line_error("data not found", str(tmp_path / "nope"), cache_dir=c)
    (tmp_path / "empty").mkdir()
    _one_line_error("has no text, .jsonl, .bin or .npy files", str(tmp_path / "empty"), cache_dir=c)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_bytes(b"")
    _one_line_error("no documents in the data", str(tmp_path / "blank"), cache_dir=c)
    (tmp_path / "no_text.jsonl").write_text('{"text": "ok"}\n{"content": "x"}\n', encoding="utf-8")
    _one_line_error(r'no_text.jsonl: line 2: no "text" field', str(tmp_path / "no_text.jsonl"), cache_dir=c)
    # a malformed line far into the file, in a later unit: the line number still counts from 1
    monkeypatch.setattr(tokenize_mod, "UNIT_BYTES", 100)
    lines = [json.dumps({"text": t}) for t in _texts(40)]
    lines[33] = '{"text": "unterminated'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _one_line_error(r"bad.jsonl: line 34: not valid JSON", str(tmp_path / "bad.jsonl"), cache_dir=c)
    (tmp_path / "t.txt").write_text("x", encoding="utf-8")
    _one_line_error("tokenizer not found", str(tmp_path / "t.txt"), str(tmp_path / "missing.json"), cache_dir=c)
    (tmp_path / "junk.json").write_text("{}", encoding="utf-8")
    _one_line_error("is not a tokenizers tokenizer.json", str(tmp_path / "t.txt"), str(tmp_path / "junk.json"),
                    cache_dir=c)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x", encoding="utf-8")
    np.zeros(4, np.uint16).tofile(tmp_path / "mixed" / "t.bin")
    _one_line_error("mixes pre-tokenized token files with text", str(tmp_path / "mixed"), cache_dir=c)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    _one_line_error("not a whole number of uint16 ids", str(tmp_path / "odd.bin"), cache_dir=c)


# ---- sampling ----------------------------------------------------------------------------------
def test_each_epoch_is_a_new_permutation_of_every_window():
    seq, batch = 16, 7
    s = GlobalSampler(num_tokens=30 * seq + 5, seq=seq, global_batch=batch, seed=3)
    assert s.num_windows == 30
    flat = np.concatenate([s.starts(t) for t in range(1, 1 + 3 * 30 // batch + 1)])  # > 3 epochs
    epochs = [flat[e * 30:(e + 1) * 30] for e in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == [k * seq for k in range(30)]  # every window exactly once
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert (flat + seq + 1 <= s.num_tokens).all()
    assert (s.epoch(1), s.epoch(5), s.epoch(6)) == (0, 0, 1)  # step 5 starts at position 28, step 6 at 35
    # deterministic in (seed, step); another seed, another order
    assert np.array_equal(GlobalSampler(30 * seq + 5, seq, batch, 3).starts(9), s.starts(9))
    assert not np.array_equal(GlobalSampler(30 * seq + 5, seq, batch, 4).starts(9), s.starts(9))
    with pytest.raises(ValueError, match="steps count from 1"):
        s.starts(0)


def test_any_split_of_the_global_batch_takes_the_same_windows_in_order():
    s = GlobalSampler(num_tokens=50_000, seq=16, global_batch=8, seed=1)
    for step in (1, 2, 77):
        starts = s.starts(step)
        for batches, micro in (([8], [8]), ([5, 2, 1], [5, 1, 1]), ([4, 4], [2, 4]), ([3, 3, 2], [1, 3, 2])):
            pieces = [starts[sl] for p in range(len(batches)) for sl in batch_slices(batches, p, micro[p])]
            assert np.array_equal(np.concatenate(pieces), starts)


def test_the_sampler_needs_no_epoch_sized_memory_on_a_huge_corpus():
    s = GlobalSampler(num_tokens=10**12, seq=2048, global_batch=512, seed=0)
    a = s.starts(1_000_000)
    assert np.unique(a).size == 512 and (a % 2048 == 0).all() and (a + 2049 <= 10**12).all()
    with pytest.raises(ValueError, match="fewer than one window"):
        GlobalSampler(num_tokens=16, seq=16, global_batch=1)


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

"""The prepared corpus store: the rows it serves are the in-memory packing's, a second run is a
cache hit that reads no document, processes and workers share a preparation, each process reads
only its rows, an interrupted preparation is never trusted, and sources stream in pieces."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from fiddlejax.data import packing, pipeline, prepare, sources, store, tokenizer
from fiddlejax.data.sources import DataError
from tests.test_data_sources import stdlib_docs

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    docs = stdlib_docs(120)
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return d, docs


def dcfg(tmp_path, d, **kw):
    return {"batch_size": 4, "seed": 0, "tokenizer": "bytes", "pack": True, "workers": 0,
            "path": str(d / "c.jsonl"), "cache_dir": str(tmp_path / "cache"), **kw}


def rows_of(r) -> dict:
    got = [r[i] for i in range(len(r))]
    return {k: np.stack([g[k] for g in got]) for k in got[0]}


@pytest.mark.parametrize("pack", [True, False])
def test_store_rows_equal_the_in_memory_packing(corpus, tmp_path, pack):
    d, docs = corpus
    tok = tokenizer.load("bytes")
    c = pipeline.corpus(str(d / "c.jsonl"), dcfg(tmp_path, d, pack=pack, val_fraction=0.2), tok,
                        SEQ, "data.path", log=lambda s: None)
    train, val = pipeline.split(docs, 0.2)
    for got, part in ((c.train, train), (c.validation, val)):
        want = packing.pack_rows(pipeline.tokenize(part, tok), SEQ + 1, pack=pack)
        have = rows_of(got)
        assert len(got) == len(want["tokens"]) > 0
        for k in want:
            assert have[k].dtype == np.int32 and np.array_equal(have[k], want[k]), k
    assert c.fingerprint["paths"] == [str(d / "c.jsonl")] and len(c.fingerprint["sha256"]) == 64


def test_second_run_is_a_cache_hit_that_reads_no_document(corpus, tmp_path, monkeypatch):
    d, _ = corpus
    tok, cfg, logs = tokenizer.load("bytes"), dcfg(tmp_path, d), []
    first = pipeline.prepared(cfg["path"], cfg, tok, "data.path", log=logs.append)
    assert "cache hit" not in logs[-1] and str(tmp_path / "cache") in logs[-1]

    def no_reading(*a, **k):
        raise AssertionError("a cache hit read the corpus")

    monkeypatch.setattr(sources, "read_piece", no_reading)
    again = pipeline.prepared(cfg["path"], cfg, tok, "data.path", log=logs.append)
    assert "cache hit" in logs[-1] and again.root == first.root
    # another tokenizer, or another split, is another store
    other = prepare.spec(cfg["path"], dict(cfg, val_fraction=0.3), tok, "data.path")
    assert other.name() != prepare.spec(cfg["path"], cfg, tok, "data.path").name()


def test_workers_and_processes_prepare_the_same_store(corpus, tmp_path, monkeypatch):
    d, _ = corpus
    monkeypatch.setattr(sources, "PIECE_BYTES", 20_000)  # several pieces
    tok = tokenizer.load("bytes")
    sp = prepare.spec(str(d / "c.jsonl"), {}, tok, "data.path")
    assert len(sp.work()) >= 4
    one, _ = prepare.ensure(sp, tmp_path / "one")
    two, _ = prepare.ensure(sp, tmp_path / "workers", workers=2)
    ranks: dict[int, tuple] = {}

    def rank(r: int) -> None:
        ranks[r] = prepare.ensure(sp, tmp_path / "ranks", rank=r, count=2,
                                  start=lambda n, total: ranks.setdefault(10 + r, n))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ranks[0][0] == ranks[1][0] and 0 < ranks[10] < len(sp.work())  # each did a share
    a = store.Store(one)
    for other in (two, ranks[0][0]):
        b = store.Store(other)
        assert b.meta["fingerprint"] == a.meta["fingerprint"]
        for s in store.SPLITS:
            ra, rb = a.rows(s, SEQ + 1), b.rows(s, SEQ + 1)
            assert len(ra) == len(rb) and all(
                np.array_equal(ra[i]["tokens"], rb[i]["tokens"]) for i in range(len(ra)))


def test_an_interrupted_preparation_is_never_trusted(corpus, tmp_path, monkeypatch):
    d, _ = corpus
    monkeypatch.setattr(sources, "PIECE_BYTES", 20_000)
    tok = tokenizer.load("bytes")
    sp = prepare.spec(str(d / "c.jsonl"), {}, tok, "data.path")
    real, calls = prepare.build_piece, []

    def dies_on_the_third(*a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(prepare, "build_piece", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        prepare.ensure(sp, tmp_path)
    assert not store.complete(tmp_path / sp.name())  # nothing published
    monkeypatch.setattr(prepare, "build_piece", real)
    built = []
    monkeypatch.setattr(prepare, "build_piece", lambda *a: built.append(1) or real(*a))
    root, hit = prepare.ensure(sp, tmp_path)
    assert not hit and store.complete(root) and len(built) == len(sp.work()) - 2  # kept 2
    assert not list(tmp_path.glob("*.partial"))


def test_each_process_reads_only_its_rows(corpus, tmp_path):
    d, _ = corpus
    tok = tokenizer.load("bytes")
    cfg = dcfg(tmp_path, d, batch_size=8)
    whole, _ = pipeline.job_batches(cfg, tok, SEQ, 256, "")
    halves = [pipeline.job_batches(cfg, tok, SEQ, 256, "", p, 2)[0] for p in (0, 1)]
    for _ in range(3):
        full, parts = next(whole), [next(h) for h in halves]
        for k in full:
            assert np.array_equal(np.concatenate([p[k] for p in parts]), full[k])
        assert halves[0].last_ids + halves[1].last_ids == whole.last_ids
    reads = []
    c = pipeline.corpus(cfg["path"], cfg, tok, SEQ, "data.path", log=lambda s: None)

    class Counted:  # the store's rows, counting which are read
        def __getitem__(self, i):
            reads.append(i)
            return c.train[i]

    batch = pipeline.ReadRows([Counted()], 4, 8)(np.arange(10, 18, dtype=np.int64))
    assert reads == [14, 15, 16, 17] and batch["tokens"].shape == (4, SEQ + 1)


def test_stream_resumes_exactly_and_refuses_other_data_on_the_store(corpus, tmp_path):
    d, _ = corpus
    tok = tokenizer.load("bytes")
    cfg = dcfg(tmp_path, d)
    a, _ = pipeline.job_batches(cfg, tok, SEQ, 256, "")
    for _ in range(5):
        next(a)
    state = json.loads(json.dumps(a.get_state()))
    want = [next(a) for _ in range(3)]
    b, _ = pipeline.job_batches(cfg, tok, SEQ, 256, "", 1, 2)  # another process count
    b.set_state(state)
    for w in want:
        assert np.array_equal(next(b)["tokens"], w["tokens"][2:])
    (tmp_path / "o.jsonl").write_text(json.dumps({"text": "another corpus " * 40}) + "\n")
    other, _ = pipeline.job_batches(dict(cfg, path=str(tmp_path / "o.jsonl")), tok, SEQ, 256,
                                    "")
    with pytest.raises(DataError, match=r"c.jsonl.*but this run has .*o.jsonl"):
        other.set_state(state)


def test_sources_stream_in_pieces(corpus, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d, docs = corpus
    opts = sources.Options()
    files = sources.resolve(str(d / "c.jsonl"))
    cut = sources.pieces(files, opts, piece_bytes=5_000)
    assert len(cut) > 10
    with monkeypatch.context() as m:  # a line's number reads the file up to it: errors only
        m.setattr(sources, "_line_number", lambda *a: pytest.fail("a valid line was counted"))
        assert [t for p in cut for t in sources.read_piece(p, opts)] == docs
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=7)
    files = sources.resolve(str(tmp_path / "c.parquet"))
    cut = sources.pieces(files, opts)
    assert len(cut) == -(-len(docs) // 7)  # a piece per row group
    assert [t for p in cut for t in sources.read_piece(p, opts)] == docs
    ids = np.arange(1, 40, dtype=np.uint16)
    ids[::5] = 0
    ids.tofile(tmp_path / "t.bin")
    got = list(sources.documents(sources.resolve(str(tmp_path / "t.bin")),
                                 sources.Options(eos_id=0)))
    assert all(isinstance(g.base, np.memmap) or isinstance(g, np.memmap) for g in got)
    assert [g.tolist() for g in got] == [ids[s + 1:s + 5].tolist() for s in range(0, 39, 5)]
    # a bad line in a later piece is named by its line number in the file
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:50]) + "{oops\n")
    last = sources.pieces(sources.resolve(str(bad)), opts, piece_bytes=5_000)[-1]
    with pytest.raises(DataError, match=r"bad.jsonl:51: not valid JSON"):
        list(sources.read_piece(last, opts))


def test_data_prepare_command_builds_what_train_opens(corpus, tmp_path, capsys):
    from fiddlejax.cli import main

    d, _ = corpus
    args = [f"data.path={d / 'c.jsonl'}", "data.tokenizer=bytes",
            f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["data", "prepare", *args]) == 0
    assert "tokens/s" in capsys.readouterr().out
    stores = list((tmp_path / "cache").glob("c-*/meta.json"))
    assert len(stores) == 1
    logs = []
    cfg = dcfg(tmp_path, d)
    pipeline.prepared(cfg["path"], cfg, tokenizer.load("bytes"), "data.path", log=logs.append)
    assert "cache hit" in logs[-1]
    assert main(["data", "prepare", "data.path=/nonexistent.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_the_bundled_corpus_skips_the_standard_librarys_empty_files():
    """``data.path`` unset with a tokenizer (``eval model.from_pretrained=DIR``) prepares the
    stdlib corpus: its empty files (``email/mime/__init__.py``) are no documents, not errors."""
    from fiddlejax.data.builtin import stdlib_files

    assert any(p.stat().st_size == 0 for p in stdlib_files())  # there are some
    sp = prepare.spec(None, {}, tokenizer.load("bytes"), "data.path")
    assert sp.files and all(f.size > 0 for f in sp.files)
    assert sp.work()  # an empty file would raise DataError here

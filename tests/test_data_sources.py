"""Own data: every source kind reads the same documents, tokenizers (bytes, tokenizer.json,
sentencepiece), the validation split, mixtures and the data state; bad inputs name the file
and the line. The corpus is made from the standard library's text, the BPE tokenizer (vocab
512) is trained here: nothing downloads."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fiddlejax.data import pipeline, sources, tokenizer
from fiddlejax.data.sources import DataError

OPTS = sources.Options()


def stdlib_docs(n=60):
    from fiddlejax.data import stdlib_files

    docs = []
    for p in stdlib_files()[:40]:
        docs += [c for c in p.read_text(errors="replace").split("\n\n\n") if len(c) > 100]
    return docs[:n]


def test_stdlib_files_are_sorted_and_skip_the_test_folders():
    """The bundled corpus's files (a walk that never enters the skipped folders): sorted by
    relative path, none under a test folder or site-packages, a fresh list each call."""
    import sysconfig

    from fiddlejax.data import builtin

    root = Path(sysconfig.get_paths()["stdlib"])
    files = builtin.stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) > 300 and "json/decoder.py" in rel
    assert not [r for r in rel if builtin._SKIP_DIRS & set(r.split("/"))]
    files.clear()
    assert len(builtin.stdlib_files()) == len(rel)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as jsonl, jsonl.gz, parquet, a save_to_disk directory, txt files,
    ArrayRecord; and a BPE tokenizer.json of vocab 512."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d, docs = tmp_path_factory.mktemp("corpus"), stdlib_docs()
    lines = "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(docs))
    (d / "c.jsonl").write_text(lines)
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.write(lines)
    table = pa.table({"text": docs})
    pq.write_table(table, d / "c.parquet")
    hf = d / "hf"
    hf.mkdir()
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (hf / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    txt = d / "txt"
    txt.mkdir()
    for i, t in enumerate(docs):
        (txt / f"{i:03d}.txt").write_text(t)
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(d / "c.arrayrecord"), "group_size:1")
    for t in docs:
        w.write(t.encode())
    w.close()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    return d, docs


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.parquet", "hf", "txt",
                                  "c.arrayrecord", "c.*"])
def test_every_source_kind_reads_the_documents(corpus, name):
    d, docs = corpus
    got = list(sources.documents(sources.resolve(str(d / name)), OPTS))
    if name == "c.*":  # a glob: jsonl, jsonl.gz, parquet and arrayrecord, in name order
        assert got == docs * 4
    else:
        assert got == docs


def test_token_files_split_at_the_named_eos(tmp_path):
    ids = np.array([5, 6, 0, 7, 0, 8, 9], np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.uint32))
    for name in ("t.bin", "t.npy"):
        files = sources.resolve(str(tmp_path / name))
        docs = list(sources.documents(files, sources.Options(eos_id=0)))
        assert [d.tolist() for d in docs] == [[5, 6], [7], [8, 9]]
    with pytest.raises(DataError, match="set data.eos_id"):
        list(sources.documents(files, OPTS))


@pytest.mark.parametrize("content, match", [
    ('{"text": "a"}\n{"text": "b",\n', r"bad.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n{"body": "b"}\n', r"bad.jsonl:2: no field 'text' \(has \['body'\]\)"),
    ('{"text": 3}\n', r"bad.jsonl:1: field 'text' is int"),
    ("", r"bad.jsonl is empty"),
])
def test_bad_jsonl_names_the_file_and_line(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        list(sources.documents(sources.resolve(str(tmp_path / "bad.jsonl")), OPTS))


def test_bad_paths_are_refused(tmp_path, corpus):
    with pytest.raises(DataError, match="does not exist"):
        sources.resolve(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="matches no file"):
        sources.resolve(str(tmp_path / "*.parquet"))
    with pytest.raises(DataError, match="without data files"):
        sources.resolve(str(tmp_path))
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unknown kind"):
        sources.resolve(str(tmp_path / "x.csv"))
    with pytest.raises(DataError, match=r"no column 'body'"):
        list(sources.documents(sources.resolve(str(corpus[0] / "c.parquet")),
                               sources.Options(field="body")))


def test_tokenizers(corpus, tmp_path):
    d, docs = corpus
    tok = tokenizer.load(str(d / "tokenizer.json"))
    assert tok.vocab_size == 512 and tok.eos_id == 0
    assert tok.decode(tok.encode(docs[0])) == docs[0]
    assert tokenizer.load(str(d)) is not None  # a directory holding tokenizer.json
    assert tokenizer.load("auto").kind == "bytes"
    assert tokenizer.load("auto", str(d)).kind == "tokenizer.json"  # from_pretrained's own
    assert tokenizer.vocab_size(tok, 3) == 513
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(
        tmp_path / "sp"), vocab_size=300, eos_id=2, minloglevel=2)
    sp = tokenizer.load(str(tmp_path / "sp.model"))
    assert sp.vocab_size == 300 and sp.eos_id == 2 and sp.decode(sp.encode("def f(): pass"))
    with pytest.raises(DataError, match="does not exist"):
        tokenizer.load(str(tmp_path / "missing.json"))
    # grain worker processes tokenize the same ids as this process
    assert [a.tolist() for a in pipeline.tokenize(docs[:8], tok, workers=2, chunk=2)] == [
        a.tolist() for a in pipeline.tokenize(docs[:8], tok)]


def test_validation_split_by_hash_is_stable_and_disjoint(corpus):
    docs = corpus[1]
    train, val = pipeline.split(docs, 0.2)
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(docs)
    assert pipeline.split(list(reversed(docs)), 0.2)[1] == list(reversed(val))
    assert 0 < len(val) < len(docs) / 2


DCFG = {"batch_size": 4, "seed": 0, "tokenizer": "bytes", "pack": True, "workers": 0}


def test_mixture_is_deterministic_and_weighted(corpus):
    d, _ = corpus
    dcfg = dict(DCFG, mixture=[{"path": str(d / "c.jsonl"), "weight": 0.8},
                               {"path": str(d / "txt"), "weight": 0.2}])
    tok = tokenizer.load("bytes")

    def ids(seed):
        train, _ = pipeline.job_batches(dict(dcfg, seed=seed), tok, 32, 256, "")
        out = []
        for _ in range(25):
            next(train)
            out += train.last_ids
        return out

    first = ids(0)
    assert first == ids(0) and first != ids(1)
    share = np.mean([i >> 32 for i in first])  # component 1's share
    assert 0.1 < share < 0.35
    with pytest.raises(DataError, match=r"data.mixture\[0\]"):
        pipeline.components({"mixture": [{"path": "a", "weight": -1}]})


def test_stream_state_resumes_and_refuses_other_data(corpus):
    d, _ = corpus
    tok = tokenizer.load("bytes")
    dcfg = dict(DCFG, path=str(d / "c.jsonl"))
    a, _ = pipeline.job_batches(dcfg, tok, 32, 256, "")
    for _ in range(3):
        next(a)
    state = json.loads(json.dumps(a.get_state()))  # as a checkpoint stores it
    expect = next(a)
    b, _ = pipeline.job_batches(dcfg, tok, 32, 256, "")
    b.set_state(state)
    assert all(np.array_equal(expect[k], v) for k, v in next(b).items())
    other, _ = pipeline.job_batches(dict(dcfg, path=str(d / "c.parquet")), tok, 32, 256, "")
    with pytest.raises(DataError, match=r"trained with data \[\[.*c.jsonl.*but this run has "
                                        r"\[\[.*c.parquet"):
        other.set_state(state)
    bpe = tokenizer.load(str(d / "tokenizer.json"))
    new_tok, _ = pipeline.job_batches(dcfg, bpe, 32, 512, "")
    with pytest.raises(DataError, match="tokenizer bytes .* but this run has tokenizer.json"):
        new_tok.set_state(state)
    allowed, _ = pipeline.job_batches(dict(dcfg, allow_change=True), bpe, 32, 512, "")
    allowed.set_state(state)
    with pytest.raises(DataError, match="trained with data 'the bundled stdlib corpus"):
        b.set_state({"next_index": 3})  # a checkpoint of the default byte-window stream


def test_job_refuses_bad_data_settings_before_building(tmp_path, corpus):
    from fiddlejax.app import build, config, runs

    cfg = config.load(None, ["model.name=bert", f"data.path={corpus[0] / 'c.jsonl'}"])
    with pytest.raises(config.ConfigError, match="model.name=bert trains on its bundled data"):
        build.resolve_data(cfg)
    cfg = config.load(None, [f"data.tokenizer={tmp_path / 'none.json'}"])
    with pytest.raises(DataError, match="none.json does not exist"):
        build.resolve_data(cfg)
    cfg = config.load(None, [f"data.tokenizer={corpus[0] / 'tokenizer.json'}", "mesh.tensor=2"])
    build.resolve_data(cfg)
    assert cfg["model"]["vocab_size"] == 512
    with pytest.raises(config.ConfigError, match="data.val_fraction=1.5 must be"):
        config.load(None, ["data.val_fraction=1.5"])
    with pytest.raises(ValueError, match="init_from=.* is neither a fiddlejax run"):
        runs.init_weights({"init_from": str(tmp_path)}, None, None)


def test_vocabulary_too_small_for_the_tokenizer_is_refused(corpus):
    d, _ = corpus
    bpe = tokenizer.load(str(d / "tokenizer.json"))
    with pytest.raises(ValueError, match="vocabulary is \\[0, 100\\); set model.vocab_size=5"):
        pipeline.job_batches(dict(DCFG, path=str(d / "c.jsonl")), bpe, 32, 100,
                             "set model.vocab_size={need}")

"""Reliability, round four (issue 49): bad inputs refused as one line naming the key or the file
and the fix, with exit status 2, before anything compiles.

Each case was silent or unclear before: a Hugging Face tensor of the wrong shape ("cannot
reshape array of size 288 ..."), NaN weights (trained on NaN losses), a yarn ``rope_scaling``
ignored beside ``rope_parameters``; a ``**`` glob through a link to its parent (one file read
41 times); ``data.mixture`` NaN, inf or ``[]``; garbage ``.npy`` files, damaged save_to_disk
JSON and tokenizer configs; UTF-8 errors by byte offset; resumes on another ``data.field``,
``data.val_fraction`` or EOS/BOS; generate's sampling arguments after a minute of loading; a
run's config.yaml with a python tag (a traceback); export's arguments after the restore.
(A device batch with ids out of range: tests/test_reliability.py.)"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fiddlejax.app import inference
from fiddlejax.data import pipeline, sources, tokenizer
from fiddlejax.data.sources import DataError

FIXTURES = Path(__file__).parent / "fixtures"


# -- Hugging Face directories ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (d=16, 4 heads of 4, 2 KV heads) as a Hugging Face directory."""
    from flax import nnx

    from fiddlejax.models.llama import Llama, LlamaConfig

    d = tmp_path_factory.mktemp("hf") / "llama"
    Llama(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2),
          rngs=nnx.Rngs(0)).save_pretrained(d)
    return d


def variant(src: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of ``src`` with its tensors and config.json changed in place by the functions."""
    shutil.copytree(src, dst)
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def generate_error(capsys, *args: str) -> str:
    assert inference.main("generate", ["prompt=hi", "max_new_tokens=1", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(hf_dir, tmp_path, capsys):
    """Layer 1's k_proj 18 x 16 (layer 0's was the only one checked): "cannot reshape array
    of size 288 into shape (16,2,4)" at init, naming nothing."""
    from fiddlejax import models

    def wrong(t):
        t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((18, 16), np.float32)

    d = variant(hf_dir, tmp_path / "shape", tensors=wrong)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight in "
                       rf"{d}/model\.safetensors has shape \(18, 16\), which does not fit "
                       r"config\.json \(.*num_key_value_heads=2, head_dim=4"):
        models.from_pretrained(d, abstract=True)  # the headers only: before anything is built
    err = generate_error(capsys, f"model.from_pretrained={d}")
    assert "model.layers.1.self_attn.k_proj.weight" in err and "model.safetensors" in err


def test_hidden_size_not_matching_the_weights_is_named(hf_dir, tmp_path, capsys):
    d = variant(hf_dir, tmp_path / "hidden", config=lambda c: c.update(hidden_size=8))
    err = generate_error(capsys, f"model.from_pretrained={d}")
    assert "model.layers.0.input_layernorm.weight in" in err
    assert "has shape (16,), which does not fit config.json (" in err and "hidden_size=8" in err


def test_nan_weights_are_refused_as_they_are_read(hf_dir, tmp_path, capsys):
    """A NaN weight trained with loss NaN (exit 0 under the skip limit) and generate printed
    only the prompt; now the read that meets it names the tensor and the file."""
    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 4] = np.nan

    d = variant(hf_dir, tmp_path / "nan", tensors=poison)
    err = generate_error(capsys, f"model.from_pretrained={d}")
    assert f"model.layers.1.mlp.up_proj.weight in {d}/model.safetensors holds NaN or " \
           "infinite values" in err


def test_rope_parameters_beside_a_yarn_rope_scaling_is_refused():
    from fiddlejax.models import families

    hf = json.loads((FIXTURES / "llama_tiny" / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"config\.json has rope_parameters=.*'default'.* and "
                       r"rope_scaling=.*'yarn'.*which disagree .*keep one"):
        families.read({**hf, "rope_scaling": yarn})
    # the same scaling in both (transformers 4 and 5 keys side by side) reads
    same = {"rope_type": "default", "rope_theta": 10000.0}
    assert families.read({**hf, "rope_scaling": same})["rope_scaling"] == {"rope_type": "default"}
    both = families.read({**hf, "rope_parameters": {**yarn, "rope_theta": 1e4},
                          "rope_scaling": {**yarn, "type": "yarn"}})
    assert both["rope_scaling"]["rope_type"] == "yarn"


# -- data --------------------------------------------------------------------------------------
@pytest.mark.timeout(30)  # glob.glob never ended here
def test_a_glob_never_follows_a_directory_link(tmp_path):
    """A ``**`` glob through a link to the directory itself read one file 41 times; with two
    such links glob.glob never ended."""
    sub = tmp_path / "data" / "sub"
    sub.mkdir(parents=True)
    (sub / "a.jsonl").write_text('{"text": "hi"}\n')
    (sub / "self").symlink_to(".")
    (sub / "up").symlink_to("..")
    for spec in (f"{tmp_path}/data/**/*.jsonl", f"{tmp_path}/data/**", f"{tmp_path}/data",
                 [f"{tmp_path}/data/sub/a.jsonl", f"{tmp_path}/data/sub/self/a.jsonl"]):
        assert [Path(f.path).name for f in sources.resolve(spec)] == ["a.jsonl"], spec


@pytest.mark.parametrize("mixture, words", [
    ([{"path": "a.jsonl", "weight": math.nan}], "data.mixture[0]="),
    ([{"path": "a.jsonl", "weight": 1.0}, {"path": "b.jsonl", "weight": math.inf}],
     "data.mixture[1]="),
    ([], "data.mixture=[] lists no data"),
])
def test_mixture_weights_must_be_finite_and_present(mixture, words):
    from fiddlejax.app import build, config

    with pytest.raises(DataError, match=words.replace("[", r"\[").replace("]", r"\]")):
        pipeline.components({"path": None, "mixture": mixture})
    cfg = config.load(None, ["model.name=llama", f"data.mixture={json.dumps(mixture)}"
                             .replace("NaN", ".nan").replace("Infinity", ".inf")])
    with pytest.raises(DataError, match="data.mixture"):  # before any data is read
        build.resolve_data(cfg)


@pytest.mark.parametrize("content", ["objects", "garbage"])
def test_a_bad_npy_file_is_named(tmp_path, content):
    p = tmp_path / "ids.npy"
    if content == "objects":
        np.save(p, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    else:
        p.write_bytes(b"\x93NUMPY garbage" * 10)
    files = sources.resolve(str(p))
    with pytest.raises(DataError, match=rf"{p} is not a \.npy array of token ids \(.*\); save"):
        list(sources.documents(files, sources.Options(eos_id=0)))


@pytest.mark.parametrize("name, text", [
    ("state.json", "{not json"), ("state.json", '["a list"]'),
    ("state.json", '{"_data_files": [{"name": "x.arrow"}]}'),
    ("dataset_dict.json", '["train", "test"]'), ("dataset_dict.json", '{"splits": "train"}'),
])
def test_damaged_save_to_disk_json_is_named(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=rf"{tmp_path / name} is damaged \(.*\); save the "
                       "dataset again"):
        sources.resolve(str(tmp_path))


@pytest.mark.parametrize("text, words", [
    ('{"eos_token": ', "is not valid JSON (Expecting value: line 1"),
    ('["<|endoftext|>"]', "is not a JSON object (a list)"),
    ('{"eos_token": 5}', "has eos_token=5, not a token's text"),
    (b'{"eos_token": "\xff"}', "is not valid JSON ("),
])
def test_a_damaged_tokenizer_config_is_named(tmp_path, text, words):
    shutil.copy(FIXTURES / "hf_qwen3_tok" / "tokenizer.json", tmp_path)
    f = tmp_path / "tokenizer_config.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError) as e:
        tokenizer.load(str(tmp_path / "tokenizer.json"))
    assert str(e.value).startswith(f"{f} ") and words in str(e.value)


def test_invalid_utf8_is_named_by_line(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"one\ntwo\nthr\xffee\n")
    with pytest.raises(DataError, match=rf"{p}:3: not UTF-8 text \(byte 11\)"):
        list(sources.documents(sources.resolve(str(p)), sources.Options()))


# -- resume --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, words", [
    ("field", "body", "data.field='text' but this run has 'body'"),
    ("val_fraction", 0.2, "data.val_fraction=0.01 but this run has 0.2"),
    ("eos_id", 7, "the tokenizer's EOS id (tokenizer_config.json's eos_token)=2"),
    ("bos_id", 1, "the tokenizer's BOS id"),
])
def test_resume_refuses_other_reading_unless_allowed(key, value, words):
    """A changed data.field, data.val_fraction or tokenizer_config.json (EOS/BOS) resumed
    silently on other tokens or rows; refused now, as a changed corpus is."""
    tok = type("Tok", (), {"eos_id": 2, "bos_id": None})()
    old = {"sources": ["x"], "reading": pipeline.reading({"field": "text",
                                                          "val_fraction": 0.01}, tok)}
    new = {**old, "reading": {**old["reading"], key: value}}
    with pytest.raises(DataError, match=r"data.allow_change=true") as e:
        pipeline.check_same_data(old, new, allow_change=False)
    assert words in str(e.value)
    pipeline.check_same_data(old, new, allow_change=True)
    pipeline.check_same_data({"sources": ["x"]}, new, allow_change=False)  # older checkpoints


def test_resume_names_the_changed_key_not_the_data_hash():
    """Another data.field also changes the prepared data's hash: the refusal named two equal
    paths with two sha256s, not the key. And data.val_fraction=null is its default (0.05), so
    setting the default, or a fraction data.val_path makes unused, is not a change."""
    tok = type("Tok", (), {"eos_id": 2, "bos_id": None})()

    def ident(sha: str, **dcfg) -> dict:
        return {"sources": [{"paths": ["a.jsonl"], "sha256": sha}],
                "reading": pipeline.reading({"field": "text", **dcfg}, tok)}

    with pytest.raises(DataError, match=r"data.field='text' but this run has 'body'"):
        pipeline.check_same_data(ident("aa"), ident("bb", field="body"), allow_change=False)
    with pytest.raises(DataError, match=r"data.val_fraction=0.05 but this run has 0.2"):
        pipeline.check_same_data(ident("aa"), ident("aa", val_fraction=0.2), allow_change=False)
    pipeline.check_same_data(ident("aa"), ident("aa", val_fraction=0.05), allow_change=False)
    pipeline.check_same_data(ident("aa", val_path="v.jsonl"),
                             ident("aa", val_path="v.jsonl", val_fraction=0.3), allow_change=False)


# -- the commands' own arguments -----------------------------------------------------------------
@pytest.mark.parametrize("arg, words", [
    ("temperature=nan", "temperature=nan must be a number >= 0"),
    ("temperature=-1", "temperature=-1 must be a number >= 0"),
    ("top_p=0", "top_p=0 must be in (0, 1]"),
    ("top_p=1.5", "top_p=1.5 must be in (0, 1]"),
    ("top_p=nan", "top_p=nan must be in (0, 1]"),
    ("max_new_tokens=-3", "max_new_tokens=-3 must be at least 1"),
    ("max_new_tokens=0", "max_new_tokens=0 must be at least 1"),
])
def test_generate_checks_its_arguments_before_loading(tmp_path, capsys, arg, words):
    """run.dir does not exist: the argument's error comes first, so nothing was loaded."""
    err = generate_error(capsys, f"run.dir={tmp_path / 'none'}", arg)
    assert words in err


def test_a_run_config_with_a_python_tag_is_one_line(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(
        f'model: !!python/object/apply:os.system ["touch {tmp_path}/pwned"]\n')
    assert inference.main("eval", [f"run.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{tmp_path}/config.yaml is not a config fiddlejax wrote (line 1)" in err
    assert "python/object/apply" in err and not (tmp_path / "pwned").exists()
    (tmp_path / "config.yaml").write_text("- a list\n")
    assert inference.main("eval", [f"run.dir={tmp_path}"]) == 2
    assert "not a mapping of sections" in capsys.readouterr().err


def test_export_checks_its_arguments_before_the_restore(tmp_path, capsys):
    from fiddlejax.app.export import export_command

    missing = str(tmp_path / "no-run")  # restoring it would fail: the arguments fail first
    assert export_command([missing, str(tmp_path / "out"), "--max-shard-size", "5XB"]) == 2
    assert "--max-shard-size='5XB' must be a positive byte count" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert export_command([missing, str(tmp_path / "file")]) == 2
    assert f"OUT_DIR {tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_the_job_stops_on_a_batch_with_ids_outside_the_vocabulary():
    """The step skips such a batch in-graph (tests/test_reliability.py); the job stops on it
    at once, naming it, rather than counting it as a non-finite step."""
    from fiddlejax.app.nonfinite import NonFiniteSteps
    from fiddlejax.checks import NonFiniteLoss

    cfg = {"train": {"nonfinite": "skip", "nonfinite_limit": 5}, "optimizer": {"lr": 1e-3},
           "checkpoint": {"dir": None}, "run": {"dir": "r"}}
    guard = NonFiniteSteps(cfg, None, print)
    assert guard.check(1, [2.0], [1.0], [0], [0]) == [False]
    with pytest.raises(NonFiniteLoss, match=r"step 2: the batch holds 3 token ids outside the "
                       r"model's vocabulary; its update was skipped; .*last good step is 1.*"
                       r"Fix the data"):
        guard.check(2, [math.nan], [math.nan], [1], [3])

"""Token files end to end: ``hal data prepare`` with a real tokenizer trained here, ``train.data: PATH.bin``
sampling as a pure function of (seed, step) inside its split, the checks before training, and
``hal train`` on a prepared file. No downloads: the tokenizer is trained on a few sentences."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from hal.errors import ConfigError
from hal.parallel.config.run import parse_train
from hal.parallel.data.batches import global_batch, validation_batch
from hal.parallel.data.token_file import check_token_file

from ..conftest import REPO, run_hal

tokenizers = pytest.importorskip("tokenizers")

WORDS = "the cat sat on a mat dog ran in park hello world big small red blue tree bird sang".split()
TIMEOUT = 240


def _word_tokenizer(path: Path, specials: tuple[str, ...] = ("<unk>", "</s>", "<sep>")) -> Any:
    """A WordLevel tokenizer over WORDS, trained with tokenizers' own trainer and saved as tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=list(specials))
    tok.train_from_iterator([" ".join(WORDS)], trainer=trainer)
    tok.save(str(path))
    return tok


@pytest.fixture
def tok(tmp_path: Path) -> Any:
    return _word_tokenizer(tmp_path / "tokenizer.json")


def _sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(count)]


def _prepare(tmp_path: Path, *inputs: Path, out: str = "out", extra: tuple[str, ...] = ()) -> Any:
    return run_hal("data", "prepare", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / out),
                   *extra, *map(str, inputs))


def _one_error_line(result: Any) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return str(lines[0])


# --- hal data prepare ------------------------------------------------------------------------------------


def test_prepare_writes_every_document_and_its_separator(tmp_path: Path, tok: Any) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("the cat sat\non a mat\n\n\nhello world\n\n", encoding="utf-8")  # 2 documents (blank-line separated)
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"text": "a dog ran in the park"}\n\n{"text": "big red tree", "id": 7}\n', encoding="utf-8")
    result = _prepare(tmp_path, txt, jsonl, extra=("--json",))
    assert result.returncode == 0, result.stderr
    index = json.loads(result.stdout)
    on_disk = json.loads((tmp_path / "out.idx.json").read_text())
    assert {k: index[k] for k in on_disk} == on_disk
    documents = ["the cat sat on a mat", "hello world", "a dog ran in the park", "big red tree"]
    eod = tok.token_to_id("</s>")
    ids = np.fromfile(tmp_path / "out.bin", dtype="<u2")
    assert ids.tolist() == [i for doc in documents for i in (*tok.encode(doc).ids, eod)]
    pieces = np.split(ids, np.flatnonzero(ids == eod) + 1)[:-1]  # each ends with its separator
    assert [tok.decode(p[:-1].tolist()) for p in pieces] == documents
    vocab = tok.get_vocab_size()
    assert on_disk["format"] == 1 and on_disk["dtype"] == "uint16" and on_disk["tokens"] == len(ids)
    assert (on_disk["documents"], on_disk["vocab_size"], on_disk["eod_id"]) == (4, vocab, eod)
    import hashlib

    assert on_disk["tokenizer_sha256"] == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert [(s["path"], s["documents"]) for s in on_disk["sources"]] == [(str(txt.resolve()), 2), (str(jsonl.resolve()), 2)]
    assert sum(s["tokens"] for s in on_disk["sources"]) == len(ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl", "out.bin", "out.idx.json", "tokenizer.json"]


def test_eod_flag_names_the_separator(tmp_path: Path, tok: Any) -> None:
    (tmp_path / "a.txt").write_text("hello world\n", encoding="utf-8")
    result = _prepare(tmp_path, tmp_path / "a.txt", extra=("--eod", "<sep>"))
    assert result.returncode == 0, result.stderr
    assert "3 tokens (uint16), 1 documents" in result.stdout
    sep = tok.token_to_id("<sep>")
    assert np.fromfile(tmp_path / "out.bin", dtype="<u2").tolist() == [*tok.encode("hello world").ids, sep]


def test_a_large_vocabulary_is_written_as_uint32(tmp_path: Path) -> None:
    from hal.parallel.data.prepare import prepare_tokens

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w69999 w3\n", encoding="utf-8")
    index = prepare_tokens([tmp_path / "a.txt"], tmp_path / "big.json", tmp_path / "big")
    assert (index["dtype"], index["vocab_size"]) == ("uint32", 70_002)
    assert np.fromfile(tmp_path / "big.bin", dtype="<u4").tolist() == [70_001, 5, 1]


BAD_INPUT = {
    # name: (files to write, arguments after the tokenizer/out flags, text in the one error line)
    "missing-file": ({}, ["nope.txt"], "nope.txt: no such file"),
    "bad-json-line": ({"a.jsonl": '{"text": "hello"}\n{"text": oops}\n'}, ["a.jsonl"], "a.jsonl:2: not JSON"),
    "no-text-field": ({"a.jsonl": '{"text": "hello"}\n\n{"body": "x"}\n'}, ["a.jsonl"], 'a.jsonl:3: no "text" field'),
    "empty-input": ({"a.txt": "\n\n  \n", "b.jsonl": ""}, ["a.txt", "b.jsonl"], "no documents in"),
    "unknown-kind": ({"a.csv": "x\n"}, ["a.csv"], "unknown kind of input '.csv'"),
    "not-utf8": ({"a.txt": b"hello \xff world\n"}, ["a.txt"], "a.txt:1: not UTF-8"),
    "unknown-eod": ({"a.txt": "hello\n"}, ["--eod", "<eot>", "a.txt"], "--eod '<eot>' is not a token of"),
    "missing-tokenizer": ({"a.txt": "hello\n"}, ["--tokenizer", "no/tokenizer.json", "a.txt"], "no such file; give a Hugging Face"),
    # a good file first: its tokens were already written to the temporary file when the second one fails
    "lone-surrogate": ({"a.jsonl": '{"text": "a\\ud800b"}\n'}, ["a.jsonl"], 'a.jsonl:1: "text" is not valid Unicode'),
    "deeply-nested": ({"a.jsonl": '{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"}, ["a.jsonl"],
                      "a.jsonl:2: JSON nested too deeply"),
    "fails-after-a-good-file": ({"a.txt": "hello world\n" * 50, "b.jsonl": '{"text": "ok"}\n[1, 2]\n'},
                                ["a.txt", "b.jsonl"], 'b.jsonl:2: no "text" field'),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case: str, tmp_path: Path, tok: Any) -> None:
    files, args, needle = BAD_INPUT[case]
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content, encoding="utf-8")
    args = [str(tmp_path / a) if not a.startswith("-") and not a.startswith("<") and "/" not in a else a for a in args]
    result = run_hal("data", "prepare", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out"),
                     *args, cwd=tmp_path)
    assert needle in _one_error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"tokenizer.json", *files})  # no .bin, no temporaries


def test_a_tokenizer_or_input_too_large_or_not_a_file_is_one_line_before_it_is_read(tmp_path: Path, tok: Any) -> None:
    from hal.parallel.data.prepare import MAX_TOKENIZER_BYTES

    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: the size is checked, so nothing of it is read
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    (tmp_path / "folder").mkdir()
    for given, words in ((huge, "larger than 128 MiB, more than such a file holds; give the model's Hugging Face tokenizer.json"),
                         (tmp_path / "folder", "is not a regular file")):
        result = run_hal("data", "prepare", "--tokenizer", str(given), "--out", str(tmp_path / "out"),
                         str(tmp_path / "a.txt"), cwd=tmp_path)
        assert words in _one_error_line(result)
    result = run_hal("data", "prepare", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out"),
                     str(tmp_path / "folder"), cwd=tmp_path)  # an input that is a folder: not "no such file"
    assert "folder: is not a regular file (a directory, pipe or device); give .txt or .jsonl" in _one_error_line(result)
    assert not list(tmp_path.glob("out*"))


def test_an_out_prefix_whose_folder_is_missing_or_a_file_is_one_error(tmp_path: Path, tok: Any) -> None:
    from hal.errors import ConfigError
    from hal.parallel.data.prepare import prepare_tokens

    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "a-file").write_text("x\n")
    for out, words in ((tmp_path / "missing" / "out", "does not exist; create it first"),
                       (tmp_path / "a-file" / "out", "is a file, not a directory")):
        with pytest.raises(ConfigError, match=words):
            prepare_tokens([tmp_path / "a.txt"], tmp_path / "tokenizer.json", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a.txt", "tokenizer.json"]


def test_an_out_that_names_no_file_or_whose_bin_is_a_directory_is_one_error(tmp_path: Path, tok: Any) -> None:
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x.bin").mkdir()
    for out, words in (("", "names no file; give a file prefix such as data/train"),
                       ("o/", "names no file; give a file prefix"), ("o/.bin", "names no file"),
                       ("o/x", "o/x.bin: is a directory")):
        result = run_hal("data", "prepare", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", out,
                         str(tmp_path / "a.txt"), cwd=tmp_path)
        assert words in _one_error_line(result), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "o", "tokenizer.json"]
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["x.bin"]


def test_a_tokenizer_without_an_end_of_document_token_asks_for_eod(tmp_path: Path) -> None:
    _word_tokenizer(tmp_path / "tokenizer.json", specials=("<unk>",))
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    line = _one_error_line(_prepare(tmp_path, tmp_path / "a.txt"))
    assert "has no end-of-document token" in line and "--eod TOKEN" in line
    assert not (tmp_path / "out.bin").exists()


def test_without_tokenizers_the_command_says_how_to_install_it(tmp_path: Path, tok: Any) -> None:
    blocker = tmp_path / "blocked"
    (blocker / "tokenizers").mkdir(parents=True)
    (blocker / "tokenizers" / "__init__.py").write_text("raise ImportError('tokenizers is not installed here')\n")
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    result = run_hal("data", "prepare", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out"),
                     str(tmp_path / "a.txt"), env={"PYTHONPATH": f"{blocker}:{REPO}"})
    line = _one_error_line(result)
    assert "'tokenizers' package, which is not installed" in line and "pip install 'hetero-hal[data]'" in line


# --- sampling from a token file -------------------------------------------------------------------------


def _positions_file(path: Path, tokens: int) -> Path:
    """A nanoGPT-style index-less uint16 .bin whose id at every position is the position: windows show offsets."""
    np.arange(tokens, dtype="<u2").tofile(path)
    return path


def test_batches_are_a_function_of_seed_and_step_inside_the_training_split(tmp_path: Path) -> None:
    path = str(_positions_file(tmp_path / "plain.bin", 4000))
    split = 4000 - int(4000 * 0.25)
    batch = global_batch(path, 3, 7, 4, 2, 16, 4000, validation=0.25)
    assert batch.shape == (4, 2, 17) and batch.dtype.is_floating_point is False
    assert (global_batch(path, 3, 7, 4, 2, 16, 4000, validation=0.25) == batch).all()
    assert not (global_batch(path, 3, 8, 4, 2, 16, 4000, validation=0.25) == batch).all()
    assert not (global_batch(path, 4, 7, 4, 2, 16, 4000, validation=0.25) == batch).all()
    # grouping rows into micro-batches does not change the data
    assert (global_batch(path, 3, 7, 2, 4, 16, 4000, validation=0.25).reshape(8, 17) == batch.reshape(8, 17)).all()
    rows = [global_batch(path, 0, step, 4, 2, 16, 4000, validation=0.25).reshape(-1, 17) for step in range(200)]
    every = np.concatenate([r.numpy() for r in rows])
    assert (np.diff(every, axis=1) == 1).all()  # each row is consecutive ids of the file
    assert every.max() < split and every.min() >= 0 and every.max() > split - 60  # reaches the end of the split
    held = np.concatenate([validation_batch(path, 0, k, 8, 16, 0.25).numpy() for k in range(100)])
    assert (np.diff(held, axis=1) == 1).all() and held.min() >= split and held.max() < 4000
    assert (validation_batch(path, 0, 5, 8, 16, 0.25) == validation_batch(path, 0, 5, 8, 16, 0.25)).all()
    with pytest.raises(ConfigError, match="validation batches need"):
        validation_batch(path, 0, 0, 8, 16, 0.0)


def test_checks_before_training_are_one_line_each(tmp_path: Path) -> None:
    def refused(path: Path, needle: str, *, seq_len: int = 16, vocab: int = 1000, validation: float = 0.0) -> None:
        with pytest.raises(ConfigError) as info:
            check_token_file(str(path), seq_len=seq_len, vocab_size=vocab, validation=validation, where="f.yaml: train.data")
        text = str(info.value)
        assert text.startswith("f.yaml: train.data ") and needle in text and "\n" not in text, text

    refused(tmp_path / "none.bin", "no such token file; make it with hal data prepare")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    refused(tmp_path / "odd.bin", "3 bytes is not a whole number of uint16 ids")
    plain = _positions_file(tmp_path / "p.bin", 600)
    refused(plain, "token id 599 (at position 599) is not below model.vocab_size 500; raise model.vocab_size above 599",
            vocab=500)
    refused(plain, "the training part holds 600 tokens, fewer than one row of 1001", seq_len=1000)
    refused(plain, "train.validation 0.01 holds out 6 tokens, fewer than one row of 17", validation=0.01)
    assert check_token_file(str(plain), seq_len=16, vocab_size=600, validation=0.1, where="w").tokens == 600
    (tmp_path / "p.idx.json").write_text(json.dumps({"format": 1, "dtype": "uint16", "tokens": 601, "vocab_size": 700}))
    refused(plain, "its index p.idx.json says 601 tokens but the file holds 600")
    (tmp_path / "p.idx.json").write_text(json.dumps({"format": 1, "dtype": "uint16", "tokens": 600, "vocab_size": 700}))
    refused(plain, "set model.vocab_size: 700", vocab=500)  # the tokenizer's size, from the index
    (tmp_path / "p.idx.json").write_text("{not json")
    refused(plain, "index", vocab=500)


def test_train_keys_data_and_validation() -> None:
    assert parse_train({"data": "tokens/train.bin", "validation": 0.1}).validation == 0.1
    assert parse_train({}).validation == 0.0
    for raw, needle in [({"data": "train.txt"}, "or a token file path ending in .bin"),
                        ({"data": "corpse"}, "did you mean 'corpus'"),
                        ({"data": "x.bin", "validation": 0.5}, "key 'train.validation' is 0.5, not below 0.5"),
                        ({"data": "x.bin", "validation": -0.1}, "key 'train.validation' must be a number ≥ 0")]:
        with pytest.raises(ConfigError) as info:
            parse_train(raw, "f.yaml")
        assert needle in str(info.value), str(info.value)


# --- hal plan / hal train on a token file ---------------------------------------------------------------------


def _run_config(tmp_path: Path, data: Path, vocab_size: int, **train: Any) -> Path:
    raw = {
        "backend": "cpu", "precision": "fp32", "fallback": "warn",
        "model": {"vocab_size": vocab_size, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "ffn_hidden_size": 64, "max_seq_len": 16},
        "parallel": {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
                     "stages": [{"backend": "cpu", "devices": 1, "layers": 1}, {"backend": "cpu", "devices": 1, "layers": 1}]},
        "train": {"steps": 3, "lr": 3.0e-3, "seed": 0, "data": str(data), **train},
    }
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_an_id_outside_the_vocabulary_is_refused_by_hal_plan_and_hal_train(tmp_path: Path) -> None:
    config = _run_config(tmp_path, _positions_file(tmp_path / "p.bin", 600), 256)
    for args in (["plan", str(config)], ["train", str(config), "--run-dir", str(tmp_path / "run")]):
        line = _one_error_line(run_hal(*args))
        assert "train.data" in line and "token id 599" in line and "model.vocab_size 256" in line, line
    assert not (tmp_path / "run").exists()
    bad = _run_config(tmp_path, tmp_path / "p.bin", 600, validation=0.6)
    assert "not below 0.5" in _one_error_line(run_hal("plan", str(bad)))
    no_split = _run_config(tmp_path, tmp_path / "p.bin", 600, eval_every=5)
    assert "train.eval_every needs a validation part" in _one_error_line(run_hal("plan", str(no_split)))


def test_hal_train_runs_on_a_prepared_token_file(tmp_path: Path, tok: Any) -> None:
    (tmp_path / "stories.txt").write_text("\n\n".join(_sentences(150)) + "\n", encoding="utf-8")
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in _sentences(50, seed=1)))
    prepared = _prepare(tmp_path, tmp_path / "stories.txt", tmp_path / "more.jsonl", out="data/train")
    # the data/ directory does not exist yet: refused in one line
    assert "directory" in _one_error_line(prepared) and not (tmp_path / "data").exists()
    (tmp_path / "data").mkdir()
    prepared = _prepare(tmp_path, tmp_path / "stories.txt", tmp_path / "more.jsonl", out="data/train")
    assert prepared.returncode == 0, prepared.stderr
    vocab = tok.get_vocab_size()
    config = _run_config(tmp_path, tmp_path / "data" / "train.bin", vocab, validation=0.1, eval_every=2, eval_batches=2)
    run_dir = tmp_path / "run"
    result = run_hal("train", str(config), "--run-dir", str(run_dir), "--json", timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and summary["losses"] == [r["loss"] for r in records]
    assert records[0]["loss"] == pytest.approx(math.log(vocab), rel=0.2)  # an untrained model over the tokenizer's ids
    assert all(r["tokens"] == 4 * 16 for r in records)
    # evaluation every 2 steps on the held-out part: loss and perplexity in that step's line only
    assert [("eval_loss" in r) for r in records] == [False, True, False]
    assert records[1]["eval_ppl"] == pytest.approx(math.exp(records[1]["eval_loss"]))
    assert records[1]["eval_loss"] == pytest.approx(math.log(vocab), rel=0.2)
    # and on screen: one line per evaluation, after that step's progress line
    shown = [line for line in result.stderr.splitlines() if line.startswith(("step ", "eval "))]
    assert len(shown) == 4 and shown[1].startswith("step 2/3 "), result.stderr
    assert shown[2] == f"eval step 2/3 loss {records[1]['eval_loss']:.4f} ppl {records[1]['eval_ppl']:.2f}"
    job = json.loads((run_dir / "job.json").read_text())
    assert job["train"]["data"] == str((tmp_path / "data" / "train.bin").resolve()) and job["train"]["validation"] == 0.1


@pytest.mark.slow
def test_ten_megabytes_with_the_shipped_tokenizer_round_trip_and_resume_bitwise(tmp_path: Path) -> None:
    """The issue's bar: 10 MB of text through ``hal data prepare`` with the shipped tokenizer — throughput in
    its report, every document decoding back to its text — then training on it resumes bitwise."""
    from hal.parallel.data.prepare import documents

    shipped = REPO / "examples" / "data"
    paragraphs = [p for name in ("corpus.txt", "ledger.txt") for p in documents(shipped / name)]
    text, i, size = [], 0, 0
    while size < 10_000_000:  # distinct documents: each carries its number
        text.append(f"Entry {i}. {paragraphs[i % len(paragraphs)]}")
        size += len(text[-1])
        i += 1
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(text) + "\n", encoding="utf-8")
    result = run_hal("data", "prepare", "--tokenizer", str(shipped / "tokenizer.json"), "--out", str(tmp_path / "big"),
                     str(big), "--json", timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["input_bytes"] >= 10_000_000 and report["mb_per_s"] > 0 and report["tokens_per_s"] > 0
    print(f"\nhal data prepare: {report['input_bytes'] / 1e6:.1f} MB, {report['tokens']:,} tokens in "
          f"{report['seconds']:.1f} s: {report['mb_per_s']:.1f} MB/s, {report['tokens_per_s']:,.0f} tokens/s")
    ids = np.fromfile(tmp_path / "big.bin", dtype=report["dtype"])
    ends = np.flatnonzero(ids == report["eod_id"])
    assert len(ends) == report["documents"] == len(text) and ends[-1] == len(ids) - 1
    tokenizer = tokenizers.Tokenizer.from_file(str(shipped / "tokenizer.json"))
    pieces = np.split(ids, ends + 1)[:-1]
    decoded = tokenizer.decode_batch([p[:-1].tolist() for p in pieces], skip_special_tokens=False)
    assert decoded == list(documents(big))

    # 4 steps straight, or resumed from its checkpoint at step 2 for the last 2: the same losses, bit for bit
    config = _run_config(tmp_path, tmp_path / "big.bin", report["vocab_size"], steps=4, checkpoint_every=2)
    straight = run_hal("train", str(config), "--run-dir", str(tmp_path / "straight"), "--json", timeout=TIMEOUT)
    assert straight.returncode == 0, straight.stderr
    resumed = run_hal("train", str(config), "--resume", str(tmp_path / "straight" / "checkpoints" / "step-000002"),
                      "--run-dir", str(tmp_path / "resumed"), "--json", timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["losses"] == json.loads(straight.stdout)["losses"][2:]

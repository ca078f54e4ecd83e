"""The tokenizer shipped in examples/data: byte-level (any text round-trips), what make_tokenizer.py makes
from the shipped text, the vocabulary the tiny example's model declares, and a token file prepared with it
decoding back to the documents. In-process: no command is started."""
from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ..conftest import REPO

tokenizers = pytest.importorskip("tokenizers")

DATA = REPO / "examples" / "data"
TEXTS = (DATA / "corpus.txt", DATA / "ledger.txt")


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("make_tokenizer", DATA / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped() -> Any:
    return tokenizers.Tokenizer.from_file(str(DATA / "tokenizer.json"))


def test_any_text_round_trips(shipped: Any) -> None:
    rng = random.Random(0)
    texts = [path.read_text(encoding="utf-8") for path in TEXTS]
    texts += ["naïve café — 東京 🚀\r\n\ttabs  and   spaces\n\n", " leading space", "\x00\x01\x7f", "<|endoftext|> in text"]
    texts += ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000), rng.randrange(0x1F300, 0x1F600)]))
                      for _ in range(200)) for _ in range(20)]
    for text in texts:
        ids = shipped.encode(text, add_special_tokens=False).ids
        assert shipped.decode(ids, skip_special_tokens=False) == text, text[:60]
    prose = texts[0]
    assert len(prose) / len(shipped.encode(prose).ids) > 3  # subwords, not bytes: about 3 characters a token


def test_it_is_what_make_tokenizer_makes_from_the_shipped_text(tmp_path: Path, shipped: Any) -> None:
    script = _script()
    assert script.main(["--out", str(tmp_path / "tokenizer.json")]) == 0
    made, ours = (json.loads(p.read_text(encoding="utf-8")) for p in (tmp_path / "tokenizer.json", DATA / "tokenizer.json"))

    def merges(model: dict[str, Any]) -> list[list[str]]:  # "a b" (older tokenizers) or ["a", "b"]
        return [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]

    fix = "examples/data/tokenizer.json is not what make_tokenizer.py makes; run python3 examples/data/make_tokenizer.py"
    assert made["model"]["vocab"] == ours["model"]["vocab"], fix
    assert merges(made["model"]) == merges(ours["model"]), fix
    assert made["added_tokens"] == ours["added_tokens"], fix
    assert (shipped.get_vocab_size(), shipped.token_to_id(script.EOD)) == (script.VOCAB_SIZE, 0)


def test_the_tiny_examples_model_has_the_tokenizers_vocabulary(shipped: Any) -> None:
    raw = yaml.safe_load((REPO / "examples" / "tiny_cpu.yaml").read_text(encoding="utf-8"))
    assert raw["model"]["vocab_size"] == shipped.get_vocab_size()


def test_a_prepared_token_file_decodes_to_the_documents(tmp_path: Path, shipped: Any) -> None:
    from hal.parallel.data.prepare import documents, prepare_tokens

    index = prepare_tokens(TEXTS, DATA / "tokenizer.json", tmp_path / "tiny")
    assert (index["dtype"], index["vocab_size"], index["eod_id"]) == ("uint16", 1024, 0)
    ids = np.fromfile(tmp_path / "tiny.bin", dtype="<u2")
    pieces = np.split(ids, np.flatnonzero(ids == index["eod_id"]) + 1)[:-1]  # each ends with its separator
    want = [doc for path in TEXTS for doc in documents(path)]
    assert [shipped.decode(p[:-1].tolist()) for p in pieces] == want
    assert len(ids) == index["tokens"] > 15_000

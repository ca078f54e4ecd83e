"""Reading ``hal data prepare``'s inputs in pieces of bounded size (``parallel.data.documents``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hal.errors import ConfigError
from hal.parallel.data.documents import Piece, documents, jsonl_pieces, text_pieces

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def _old_documents(text: str) -> list[str]:
    """The rule before pieces (the file read line by line, "\\n" ending a line): runs of non-blank lines, each run one
    document without its trailing newlines."""
    docs, lines = [], []
    for line in (part + "\n" for part in text.split("\n")):
        if line.strip():
            lines.append(line)
        elif lines:
            docs.append("".join(lines).rstrip("\n"))
            lines = []
    if lines:
        docs.append("".join(lines).rstrip("\n"))
    return docs


def test_documents_within_the_window_are_one_piece_each_as_before(tmp_path: Path) -> None:
    text = (DATA / "corpus.txt").read_text(encoding="utf-8") + "\n \n\t\nlast one\r\nwith crlf\n\n\n"
    path = tmp_path / "a.txt"
    path.write_bytes(text.encode("utf-8"))
    got = list(text_pieces(path))
    assert all(p.last for p in got)
    assert [p.text for p in got] == _old_documents(text.replace("\r\n", "\n"))


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_any_read_size_gives_the_documents_of_the_line_rule(tmp_path: Path, block: int) -> None:
    """Random lines (text, spaces, tabs, form feeds, non-breaking spaces, CRLF, multibyte) read in blocks of any size:
    the documents are exactly those of the line-by-line rule."""
    import random

    rng = random.Random(block)
    atoms = ["word", "é", "中", " ", "\t", "\f", "\u00a0", "x y"]
    lines = ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 4))) + rng.choice(["\n", "\r\n"])
             for _ in range(300)]
    text = "".join(lines) + rng.choice(["", "tail", "  "])
    path = tmp_path / "r.txt"
    path.write_bytes(text.encode("utf-8"))
    got = list(text_pieces(path, block=block))
    assert all(p.last for p in got)
    assert [p.text for p in got] == [d for d in _old_documents(text.replace("\r\n", "\n")) if d.strip()]


def test_a_line_longer_than_the_window_is_cut_at_whitespace_and_only_its_last_piece_ends_it(tmp_path: Path) -> None:
    words = [f"word{i}" for i in range(400)]
    path = tmp_path / "one.txt"
    path.write_text(" ".join(words) + "\n\nnext\n", encoding="utf-8")
    got = list(text_pieces(path, window=64))
    first = [p for p in got[:-1]]
    assert got[-1] == Piece("next", True) and [p.last for p in first] == [False] * (len(first) - 1) + [True]
    assert all(len(p.text) <= 64 for p in got)
    assert "".join(p.text for p in first) == " ".join(words)
    assert all(p.text.startswith(" ") for p in first[1:])  # cut before a space: no word is split
    assert list(documents(path)) == [" ".join(words), "next"]


def test_multibyte_characters_and_crlf_split_by_a_read_come_back_whole(tmp_path: Path) -> None:
    line = "é" * 40 + "\r\n" + "中文" * 30 + "\n"  # 2- and 3-byte characters cut by 16-byte reads
    path = tmp_path / "u.txt"
    path.write_bytes(line.encode("utf-8"))
    for block in (1, 5, 16):
        assert "".join(p.text for p in text_pieces(path, window=16, block=block)) == \
            line.replace("\r\n", "\n").rstrip("\n")


def test_a_decoding_error_names_the_line_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\n" + b"x" * 40 + b"\xff tail\n")
    for block in (16, 1 << 20):
        with pytest.raises(ConfigError, match=r"bad.txt:2: not UTF-8 text \(invalid start byte at byte 40\)"):
            list(text_pieces(path, window=16, block=block))
    path.write_bytes(b"ends inside \xe4\xb8")
    with pytest.raises(ConfigError, match=r"bad.txt:1: not UTF-8 text .*ends inside a character"):
        list(text_pieces(path))


def test_jsonl_texts_are_split_too_and_a_record_over_the_limit_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    long = " ".join(["token"] * 50)
    path.write_text("\n".join(json.dumps({"text": t}) for t in ("short", "   ", long)) + "\n", encoding="utf-8")
    got = list(jsonl_pieces(path, window=32))
    assert got[0] == Piece("short", True) and got[-1].last and not any(p.last for p in got[1:-1])
    assert "".join(p.text for p in got[1:]) == long
    with pytest.raises(ConfigError, match=r"a.jsonl:3: a JSONL record longer than 100 bytes .*as a \.txt file"):
        list(jsonl_pieces(path, max_line=100))


def test_a_document_tokenized_in_pieces_decodes_to_itself(tmp_path: Path) -> None:
    """Byte-level BPE (the shipped tokenizer): the ids of the pieces, concatenated, decode to the whole text."""
    tokenizers = pytest.importorskip("tokenizers")
    from hal.parallel.data.prepare import prepare_tokens

    text = (DATA / "corpus.txt").read_text(encoding="utf-8").replace("\n", " ")[:20_000]
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    index = prepare_tokens([path], DATA / "tokenizer.json", tmp_path / "out", window=1000)
    assert (index["documents"], index["split_documents"], index["window_chars"]) == (1, 1, 1000)
    ids = np.fromfile(tmp_path / "out.bin", dtype="<u2")
    assert ids[-1] == index["eod_id"] and (ids[:-1] != index["eod_id"]).all()
    tokenizer = tokenizers.Tokenizer.from_file(str(DATA / "tokenizer.json"))
    assert tokenizer.decode(ids[:-1].tolist()) == text.rstrip("\n")

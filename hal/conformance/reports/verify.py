"""``hal conformance verify``: is a results.json the one that was written? Its digest recomputed, and the digest its
report.html shows beside it compared."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hal.errors import ConfigError

from .provenance import DIGEST_KEY, digest
from .results import MAX_RESULTS_BYTES, read_document

_SHOWN = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass
class Verification:
    path: str
    kind: str
    recorded: str | None
    computed: str
    shown: str | None  # the digest report.html shows, where a report.html sits beside the file

    @property
    def ok(self) -> bool:
        return self.recorded == self.computed and (self.shown is None or self.shown == self.computed)

    def text(self) -> str:
        if self.recorded is None:
            return f"{self.path}: records no digest (written before digests, 2026-12-08); cannot verify it"
        if self.recorded != self.computed:
            return (f"{self.path}: CHANGED after it was written: its digest is {self.recorded}, its content hashes "
                    f"to {self.computed}")
        if self.shown is not None and self.shown != self.computed:
            return (f"{self.path}: its digest was recomputed after an edit: report.html beside it shows {self.shown}, "
                    f"the file {self.computed}")
        where = " and report.html shows it" if self.shown else ""
        return f"{self.path}: intact ({self.kind}); digest {self.computed}{where}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "ok": self.ok, "recorded": self.recorded,
                "computed": self.computed, "report_html": self.shown}


def verify_path(path: str | os.PathLike[str]) -> Verification:
    target = Path(path)
    if target.is_dir():
        target = target / "results.json"
        if not target.is_file():
            raise ConfigError(f"{path}: holds no results.json; give a report directory or a results.json")
    doc = read_document(target, "a results.json written by hal conformance run, survey or parity")
    if not isinstance(doc, dict):
        raise ConfigError(f"{target}: not a JSON object; give a results.json written by hal conformance")
    html_file = target.parent / "report.html"
    shown = None
    if html_file.is_file() and html_file.stat().st_size <= MAX_RESULTS_BYTES:
        found = _SHOWN.findall(html_file.read_text(encoding="utf-8", errors="replace"))
        shown = found[0] if found else None
    recorded = doc.get(DIGEST_KEY)
    try:
        computed = digest(doc)
    except ValueError as exc:  # a non-finite number: hal never writes one
        raise ConfigError(f"{target}: holds a value hal never writes ({exc}); the file is damaged") from None
    return Verification(str(target), str(doc.get("kind")), recorded if isinstance(recorded, str) else None, computed, shown)

"""Per-sample results on disk (JSON lines), so an interrupted evaluation resumes where it stopped.

Every finished (kind, context, sample, selector, sparsity) result is appended as one line and
flushed. A record counts only if its ``fingerprint`` -- a hash of every setting that changes
results (model, seed, windows, corpus, adapters, ...) -- matches the current run; the grid
(contexts, sparsities, selectors, tasks, sample counts) is not part of it, so growing the grid
reuses what was already computed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Iterator, Optional


def fingerprint(settings: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_key(kind: str, context: int, sample: int, selector: str, sparsity: Optional[float], task: str = "") -> str:
    level = "dense" if sparsity is None else f"{float(sparsity):g}x"
    return f"{kind}/{task}/{context}/{sample}/{selector}/{level}"


class ResultStore:
    """Append-only JSON-lines file of per-sample records keyed by :func:`record_key`."""

    def __init__(self, path: str, fingerprint_value: str):
        self.path = path
        self.fingerprint = fingerprint_value
        self.records: Dict[str, Dict[str, Any]] = {}
        if os.path.exists(path):
            with open(path, "rb+") as f:  # end a line cut short by an interruption, so appends start clean
                f.seek(0, os.SEEK_END)
                if f.tell():
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by an interruption
                        continue
                    if record.get("fingerprint") == fingerprint_value:
                        self.records[record["key"]] = record

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def add(self, key: str, record: Dict[str, Any]) -> None:
        record = dict(record, key=key, fingerprint=self.fingerprint)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = record

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return iter(self.records.values())

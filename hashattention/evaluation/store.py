"""Per-sample results on disk (JSON lines), so an interrupted evaluation resumes where it stopped.

Every finished (kind, context, sample, selector, sparsity) result is appended as one line and
flushed. Its key starts with a ``fingerprint``: a hash of every setting that changes the result
(model, seed, windows, corpus, ...) and of the selector's own identity (e.g. a hash of the
adapter weights it loaded), so a record is reused only when it would come out the same. The
grid (contexts, sparsities, selectors, tasks, sample counts) is not part of it, so growing the
grid, or adding a selector later, reuses what was already computed.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional


def fingerprint(settings: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_key(fingerprint_value: str, kind: str, context: int, sample: int, selector: str,
               sparsity: Optional[float], task: str = "") -> str:
    level = "dense" if sparsity is None else f"{float(sparsity):g}x"
    return f"{fingerprint_value}/{kind}/{task}/{context}/{sample}/{selector}/{level}"


class ResultStore:
    """Append-only JSON-lines file of per-sample records keyed by :func:`record_key`."""

    def __init__(self, path: str):
        self.path = path
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
                    if isinstance(record, dict) and "key" in record:
                        self.records[record["key"]] = record

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def add(self, key: str, record: Dict[str, Any]) -> None:
        record = dict(record, key=key)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = record

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        return self.records.get(key)

"""Versioned cost-model files beside the records, each with the metrics and record count it was trained on.

    <root>/_models/<uri-quoted target>/v000012-<rand>.model   the model's bytes, as its owner serialised them
    <root>/_models/<uri-quoted target>/v000012-<rand>.json    metadata: metrics, record_count, kind, sha256...

The bytes are written first and the JSON second, both atomically: a version exists once its JSON does.
Version numbers grow by one per save; the random suffix keeps two savers that pick the same number at
the same moment from overwriting each other, without any locking (newest = highest number, then latest
creation time).
"""
from __future__ import annotations

import builtins
import hashlib
import json
import re
import uuid
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, unquote

import pandas as pd

from tensortune.storage.filesystem import Location, list_files, open_location, read_bytes, write_atomic
from tensortune.storage.layout import MODELS_DIR
from tensortune.storage.schema import TOOL_VERSION

_META_NAME = re.compile(r"^v(?P<number>\d{6,})-(?P<suffix>[0-9a-f]{8})\.json$")
FORMAT = 1


class ModelStoreError(RuntimeError):
    """A stored cost model is missing its bytes or its bytes do not match the recorded checksum."""


class ModelStore:
    """Cost models of a record store: `ModelStore("./tuning-records")` (or the same URL as the records)."""

    def __init__(self, url_or_path: str = "./tuning-records", *, filesystem: Any = None,
                 durable: bool = True):
        self.location: Location = open_location(url_or_path, filesystem)
        self.durable = durable

    def __repr__(self) -> str:
        return f"ModelStore({self.location.url!r})"

    def save(self, target: str, model_bytes: bytes, metrics: dict[str, Any], record_count: int,
             kind: str) -> str:
        """Store a new version of the cost model for `target`; returns its version string."""
        if not isinstance(model_bytes, (bytes, bytearray, memoryview)):
            raise TypeError(f"model_bytes must be bytes (serialise the model first), not "
                            f"{type(model_bytes).__name__}")
        try:
            json.dumps(metrics)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metrics must be JSON-serialisable (plain numbers and strings): {exc}") from exc
        numbers = [m["number"] for m in self._metas(target)]
        version = f"v{(max(numbers) + 1 if numbers else 1):06d}-{uuid.uuid4().hex[:8]}"
        data = bytes(model_bytes)
        meta = {
            "version": version, "number": int(version[1:7]), "target": target, "kind": kind,
            "created": datetime.now(timezone.utc).isoformat(), "record_count": int(record_count),
            "metrics": metrics, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "tool_version": TOOL_VERSION, "format": FORMAT,
        }
        write_atomic(self.location, self._path(target, version, ".model"), data, durable=self.durable)
        write_atomic(self.location, self._path(target, version, ".json"),
                     json.dumps(meta, indent=1).encode(), durable=self.durable)
        return version

    def load(self, target: str, version: str) -> tuple[bytes, dict[str, Any]]:
        """One stored version's bytes and metadata."""
        try:
            meta = json.loads(read_bytes(self.location, self._path(target, version, ".json")))
        except FileNotFoundError:
            raise ModelStoreError(f"no cost model {version} for target {target!r} in "
                                  f"{self.location.url}; list(target) shows what is stored") from None
        return self._bytes(target, meta), meta

    def load_newest(self, target: str) -> tuple[bytes, dict[str, Any]] | None:
        """The newest cost model for `target` and its metadata, or None when there is none."""
        metas = self._metas(target)
        if not metas:
            return None
        newest = max(metas, key=lambda m: (m["number"], m["created"], m["version"]))
        return self._bytes(target, newest), newest

    def list(self, target: str | None = None) -> pd.DataFrame:
        """Every stored version (of one target, or all), oldest first; metrics as `metric.<name>`."""
        if target is None:
            metas = [m for t in self._targets() for m in self._metas(t)]
        else:
            metas = self._metas(target)
        rows = [{**{k: v for k, v in m.items() if k != "metrics"},
                 **{f"metric.{k}": v for k, v in m.get("metrics", {}).items()}} for m in metas]
        columns = ["target", "version", "number", "kind", "created", "record_count", "size_bytes"]
        if not rows:
            return pd.DataFrame(columns=columns)
        frame = pd.DataFrame(rows)
        frame["created"] = pd.to_datetime(frame["created"], utc=True)
        ordered = columns + sorted(c for c in frame.columns if c not in columns)
        return frame[ordered].sort_values(["target", "number", "created"]).reset_index(drop=True)

    def _folder(self, target: str) -> str:
        if not target:
            raise ValueError("target is empty: name the target the model was trained for")
        return self.location.path(MODELS_DIR, quote(target, safe=""))

    def _path(self, target: str, version: str, suffix: str) -> str:
        return f"{self._folder(target)}/{version}{suffix}"

    def _targets(self) -> builtins.list[str]:
        folder = self.location.path(MODELS_DIR)
        names = {self.location.relative(i.path).split("/")[1] for i in list_files(self.location, folder)}
        return sorted(unquote(n) for n in names)

    def _metas(self, target: str) -> builtins.list[dict[str, Any]]:
        metas = []
        for info in list_files(self.location, self._folder(target)):
            if not _META_NAME.match(info.base_name):
                continue
            try:
                meta = json.loads(read_bytes(self.location, info.path))
                meta["number"] = int(meta["number"])
            except (ValueError, KeyError) as exc:
                raise ModelStoreError(f"cost-model metadata {info.path} is unreadable ({exc}); move it "
                                      "and its .model file out of the store") from exc
            metas.append(meta)
        return metas

    def _bytes(self, target: str, meta: dict[str, Any]) -> bytes:
        path = self._path(target, meta["version"], ".model")
        try:
            data = read_bytes(self.location, path)
        except FileNotFoundError:
            raise ModelStoreError(f"cost model {path} is missing although its metadata exists; "
                                  "delete the .json beside it or restore the file") from None
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise ModelStoreError(f"cost model {path} does not match its recorded sha256 (damaged or "
                                  "overwritten); delete it and its .json, or retrain")
        return data

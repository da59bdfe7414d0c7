"""Where a store lives: a local folder or any pyarrow/fsspec filesystem URL, and how to write to it atomically.

Readers must never see half a file. On a local disk that means write a hidden temporary file in the same
folder, fsync it and rename it over the final name (rename is atomic within a filesystem). On object stores
(S3, GCS, Azure) an object only becomes visible once its upload completes, and "rename" is a copy, so the
bytes are uploaded straight to the final key. Anything else (fsspec's sftp, memory, ...) gets the
temporary-name-then-move route, which is as atomic as that filesystem's move.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Union

import pyarrow as pa
import pyarrow.fs as pafs

_OBJECT_STORES = {"s3", "s3a", "gcs", "gs", "abfs", "abfss", "az", "adl"}


@dataclass(frozen=True)
class Location:
    """A filesystem and the root folder of a store on it (paths are '/'-joined, no trailing '/')."""

    fs: pafs.FileSystem
    root: str
    url: str
    local: bool
    object_store: bool

    def path(self, *parts: str) -> str:
        """The full path of `parts` under the root."""
        return "/".join([self.root, *parts]) if parts else self.root

    def relative(self, path: str) -> str:
        """`path` relative to the root."""
        prefix = self.root + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path!r} is not under the store root {self.root!r}")
        return path[len(prefix):]


def open_location(url_or_path: str, filesystem: Any = None) -> Location:
    """Resolve a local path, a `file://`, `s3://`, `gs://`... URL, or a path on an explicit filesystem.

    `filesystem` may be a pyarrow FileSystem or an fsspec AbstractFileSystem (for settings a URL cannot
    carry); `url_or_path` is then a path on it. S3 options may ride on the URL as pyarrow reads them
    (`s3://bucket/prefix?endpoint_override=http://127.0.0.1:9000&scheme=http&region=us-east-1`), or come
    from the usual AWS_* environment variables.
    """
    if filesystem is not None:
        fs = _as_pyarrow(filesystem)
        root = url_or_path.rstrip("/") or "/"
    elif "://" not in url_or_path:
        fs = pafs.LocalFileSystem()
        root = os.path.abspath(os.path.expanduser(url_or_path)).replace(os.sep, "/")
    else:
        try:
            fs, root = pafs.FileSystem.from_uri(url_or_path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
            fs, root = _fsspec_location(url_or_path)
        root = root.rstrip("/")
    kind = _kind(fs)
    return Location(fs=fs, root=root, url=url_or_path, local=kind == "local",
                    object_store=kind in _OBJECT_STORES)


def _fsspec_location(url: str) -> tuple[pafs.FileSystem, str]:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec ships with dask
        raise ValueError(f"pyarrow cannot open {url!r} and fsspec is not installed: "
                         "pip install fsspec (plus the scheme's package, e.g. gcsfs)") from exc
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot open record store URL {url!r}: {exc}. Install the fsspec package "
                         "for that scheme, or pass a local folder") from exc
    return _as_pyarrow(fs), path


def _as_pyarrow(filesystem: Any) -> pafs.FileSystem:
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))


def _kind(fs: pafs.FileSystem) -> str:
    if isinstance(fs, pafs.LocalFileSystem):
        return "local"
    if isinstance(fs, pafs.PyFileSystem):
        protocol = getattr(fs.handler.fs, "protocol", "")
        protocol = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
        return "local" if protocol in ("file", "local") else str(protocol)
    return fs.type_name


Payload = Union[bytes, pa.Buffer, Callable[[Any], None]]


def write_atomic(location: Location, path: str, payload: Payload, durable: bool = True) -> int:
    """Write a file so that readers see either nothing or all of it; returns its size in bytes.

    `payload` is the content, or a function that writes it to a binary file object (on local disks
    it then streams into the temporary file, so big files are never held in memory twice).
    `durable` (local disks only) fsyncs the file and its folder, so a power cut after the call returns
    cannot lose the file or leave it empty.
    """
    if location.local and isinstance(location.fs, pafs.LocalFileSystem):
        return _write_local(path, payload, durable)
    data = _materialise(payload)
    folder, name = path.rsplit("/", 1)
    if location.object_store:
        try:
            with location.fs.open_output_stream(path) as out:
                out.write(data)
        except BaseException:
            delete_quietly(location, path)
            raise
        return len(data)
    location.fs.create_dir(folder, recursive=True)
    temp = f"{folder}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with location.fs.open_output_stream(temp) as out:
            out.write(data)
        location.fs.move(temp, path)
    except BaseException:
        delete_quietly(location, temp)
        raise
    return len(data)


def _materialise(payload: Payload) -> bytes | pa.Buffer:
    if isinstance(payload, (bytes, bytearray, pa.Buffer)):
        return payload
    sink = pa.BufferOutputStream()
    payload(sink)
    return sink.getvalue()


def _write_local(path: str, payload: Payload, durable: bool) -> int:
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            if isinstance(payload, (bytes, bytearray, pa.Buffer)):
                out.write(memoryview(payload))
            else:
                payload(out)
            size = out.tell()
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return size


def list_files(location: Location, folder: str) -> list[pafs.FileInfo]:
    """Every file (not folder) under `folder`, recursively; empty when the folder does not exist."""
    selector = pafs.FileSelector(folder, recursive=True, allow_not_found=True)
    return [info for info in location.fs.get_file_info(selector) if info.type == pafs.FileType.File]


def exists(location: Location, path: str) -> bool:
    """Whether `path` is there now."""
    return location.fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(location: Location, path: str) -> bytes:
    """The whole content of `path`."""
    with location.fs.open_input_stream(path) as stream:
        return stream.read()


def move(location: Location, source: str, destination: str) -> None:
    """Move a file, creating the destination folder where the filesystem has folders."""
    if not location.object_store:
        location.fs.create_dir(destination.rsplit("/", 1)[0], recursive=True)
    location.fs.move(source, destination)


def delete_quietly(location: Location, path: str) -> bool:
    """Delete `path`; False (no error) when it is already gone."""
    try:
        location.fs.delete_file(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        if "not found" in str(exc).lower() or "does not exist" in str(exc).lower():
            return False
        raise

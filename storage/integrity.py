"""Files in a store that are not readable record files: find them, and either stop or quarantine them.

Never skip one silently: a query over a store with a bad file either fails naming the file and the way
out, or (when the store was opened with on_bad_file="quarantine") moves it to `<root>/_quarantine/` and
warns, so nothing disappears without a trace.
"""
from __future__ import annotations

import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tensortune.storage.filesystem import Location, move
from tensortune.storage.layout import QUARANTINE_DIR
from tensortune.storage.schema import FILE_SCHEMA, REQUIRED_COLUMNS

ON_BAD_FILE = ("raise", "quarantine")


class BadFileError(RuntimeError):
    """A record store holds files that are corrupt or not tensortune record files."""

    def __init__(self, message: str, problems: dict[str, str]):
        super().__init__(message)
        self.problems = problems


def check_policy(on_bad_file: str) -> str:
    """Validate an on_bad_file setting."""
    if on_bad_file not in ON_BAD_FILE:
        raise ValueError(f"on_bad_file={on_bad_file!r} is not one of {ON_BAD_FILE}")
    return on_bad_file


def find_bad_files(location: Location, paths: list[str], deep: bool = True) -> dict[str, str]:
    """{path: what is wrong} for the files among `paths` that cannot be read as record files.

    The footer and schema of every file are checked; with `deep`, the data of the files whose footer
    is fine is read too, to catch damage in the middle of a file.
    """
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda p: (p, _problem(location, p, deep)), paths))
    return {path: problem for path, problem in results if problem is not None}


def _problem(location: Location, path: str, deep: bool) -> str | None:
    try:
        with location.fs.open_input_file(path) as handle:
            parquet = pq.ParquetFile(handle)
            schema = parquet.schema_arrow
            missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
            if missing:
                return f"not a tensortune record file (no column {', '.join(missing)})"
            for name in schema.names:
                if name in FILE_SCHEMA.names and not _compatible(schema.field(name).type,
                                                                 FILE_SCHEMA.field(name).type):
                    return (f"column {name!r} has type {schema.field(name).type}, "
                            f"expected {FILE_SCHEMA.field(name).type}")
            if deep:
                parquet.read()
    except FileNotFoundError:
        return None  # compacted away meanwhile: not a problem of the file
    except (pa.ArrowException, OSError, ValueError) as exc:
        return f"unreadable ({str(exc).splitlines()[0]})"
    return None


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_dictionary(actual):
        actual = actual.value_type
    if actual == expected:
        return True
    return {actual, expected} <= {pa.string(), pa.large_string()}


def handle_bad_files(location: Location, problems: dict[str, str], policy: str) -> None:
    """Raise BadFileError for `problems`, or move the files to the quarantine folder with a warning."""
    if not problems:
        return
    listing = "\n".join(f"  {path}: {why}" for path, why in sorted(problems.items()))
    if policy == "raise":
        raise BadFileError(
            f"record store {location.url} holds {len(problems)} file(s) that are not readable "
            f"tensortune record files:\n{listing}\nNothing was read. Move them out of the store, or "
            f"open it with RecordStore(..., on_bad_file='quarantine') (CLI: `tensortune history --quarantine`) "
            f"to move them to {location.path(QUARANTINE_DIR)}/ and carry on.", problems)
    for path in sorted(problems):
        destination = location.path(QUARANTINE_DIR, location.relative(path))
        if location.fs.get_file_info(destination).type != pafs.FileType.NotFound:
            destination = f"{destination}.{uuid.uuid4().hex[:8]}"
        move(location, path, destination)
    warnings.warn(f"record store {location.url}: moved {len(problems)} bad file(s) to "
                  f"{location.path(QUARANTINE_DIR)}/:\n{listing}", stacklevel=3)

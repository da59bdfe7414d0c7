"""Compaction journals: how a merge of part files stays exactly-once for readers and other compactors.

A compactor writes `<root>/_compactions/<id>.json` (inputs + output name) before its output file becomes
visible, and marks it finished only after every input has left the dataset (retired: moved to
`_superseded/` for a grace period, see storage.superseded; for a reader that is the same as deleted).
So whenever a reader lists an output next to some of its inputs, the journal is there to say those
inputs are superseded; and two compactors that claim the same input see each other's journal and back
off. The claim is also what a raw reader's hold waits for (storage.holds): a compactor writes it before
it looks for holds.

A finished journal stays for TOMBSTONE_SECONDS. A listing of a folder is not a snapshot: a reader can
miss an output created behind its cursor and the inputs retired ahead of it, and so miss rows. The
tombstone lets it see that (a compaction whose output it cannot see lost inputs it did not list) and
list again; a listing slower than half the tombstone's life is retried too, so it cannot outlast one.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

from tensortune.storage.filesystem import Location, delete_quietly, list_files, read_bytes, write_atomic
from tensortune.storage.layout import COMPACTIONS_DIR
from tensortune.storage.superseded import retire

TOMBSTONE_SECONDS = 60.0
MAX_LISTING_SECONDS = TOMBSTONE_SECONDS / 2  # the rest is slack for clock skew between hosts
STALE_SECONDS = 3600.0  # a claim this old is taken for dead whoever holds it


@dataclass(frozen=True)
class Journal:
    """One compaction's claim: these inputs (paths relative to the root) become that output."""

    id: str
    output: str
    inputs: tuple[str, ...]
    created: float = field(default_factory=time.time)  # seconds since the epoch
    host: str = field(default_factory=lambda: _machine())
    pid: int = field(default_factory=os.getpid)
    finished: float | None = None  # when the last input was retired (then this is a tombstone)

    @staticmethod
    def new(output: str, inputs: list[str]) -> "Journal":
        """A journal with a fresh id."""
        return Journal(id=uuid.uuid4().hex, output=output, inputs=tuple(inputs))

    def path(self, location: Location) -> str:
        """Where this journal lives in the store."""
        return location.path(COMPACTIONS_DIR, f"{self.id}.json")

    def expired(self) -> bool:
        """A tombstone old enough that no reader's listing can have overlapped the compaction."""
        return self.finished is not None and time.time() - self.finished > TOMBSTONE_SECONDS

    def abandoned(self, stale_seconds: float = STALE_SECONDS) -> bool:
        """True when the compactor that wrote this is surely gone: dead on this host, or too old."""
        if time.time() - self.created > stale_seconds:
            return True
        if self.host != _machine():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


_FIELDS = {f.name for f in fields(Journal)}  # a newer build may add fields: ignore what we don't know


def _machine() -> str:
    """Where a pid means something: the host name plus, on Linux, the pid namespace (containers on
    one host may share a name and a volume, but not their pids)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


def write_journal(location: Location, journal: Journal) -> None:
    """Write a journal atomically (it is the compaction's claim, so it must be durable)."""
    payload = asdict(journal)
    payload["inputs"] = list(journal.inputs)
    write_atomic(location, journal.path(location), json.dumps(payload).encode(), durable=True)


def read_journals(location: Location) -> list[Journal]:
    """Every journal in the store; a journal that cannot be parsed is an error naming the file."""
    journals = []
    for info in list_files(location, location.path(COMPACTIONS_DIR)):
        if not info.base_name.endswith(".json") or info.base_name.startswith("."):
            continue
        try:
            payload = json.loads(read_bytes(location, info.path))
            payload["inputs"] = tuple(payload["inputs"])
            journals.append(Journal(**{k: v for k, v in payload.items() if k in _FIELDS}))
        except FileNotFoundError:
            continue  # finished and removed while we listed
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"compaction journal {info.path} is unreadable ({exc}). It should never be partly "
                "written; if no compaction is running, check that its output and inputs are as "
                "expected, then delete the journal") from exc
    return journals


def finish_journal(location: Location, journal: Journal) -> Journal:
    """Turn a claim whose inputs are all retired into a tombstone."""
    done = replace(journal, finished=time.time())
    write_journal(location, done)
    return done


def complete_journal(location: Location, journal: Journal) -> Journal:
    """Finish a committed claim (its output exists): retire the inputs still in the dataset, then make
    it a tombstone. Whoever does it (the compactor, a later one recovering, a reader taking a hold),
    and however often, the end is the same."""
    retire(location, journal.id, journal.inputs)
    return finish_journal(location, journal)


def delete_journal(location: Location, journal: Journal) -> None:
    """Remove an expired tombstone or an abandoned claim."""
    delete_quietly(location, journal.path(location))


@dataclass(frozen=True)
class View:
    """What a listing means once the journals are applied."""

    skip: set[str]  # listed files whose rows are in a listed compaction output: read them there
    torn: bool  # the listing missed rows (it overlapped a compaction): list again


def resolve(journals: list[Journal], present: set[str], exists: Callable[[str], bool]) -> View:
    """Apply `journals` to the relative paths `present` in one listing.

    A file's rows are visible if it is listed or went into a compaction output whose rows are visible
    (outputs are merged again, so this follows chains). The listing is torn when a compaction lost
    inputs it did not list and its output, unlisted, exists now: the output appeared behind the cursor.
    (An output that does not exist is a claim that never committed, or a file quarantined or deleted
    by hand: listing again would not bring it back.) `exists` is asked only in those rare cases.
    """
    outputs: dict[str, list[str]] = {}
    for journal in journals:
        for name in journal.inputs:
            outputs.setdefault(name, []).append(journal.output)
    known: dict[str, bool] = {}

    def visible(name: str) -> bool:
        if name not in known:
            known[name] = False  # outputs are fresh names, so there are no cycles; this guards anyway
            known[name] = name in present or any(visible(o) for o in outputs.get(name, ()))
        return known[name]

    skip = {name for name in present if any(visible(o) for o in outputs.get(name, ()))}
    torn = any(not visible(j.output) and any(name not in present for name in j.inputs)
               and exists(j.output) for j in journals)
    return View(skip=skip, torn=torn)

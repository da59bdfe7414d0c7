"""Holds: how a raw reader (pandas, pyarrow, DuckDB on the store's folder) reads while tuning runs.

A raw reader lists the folder and then opens what it listed. A compaction that runs in between
replaces files: if its output is visible and its inputs still listed, the reader counts their rows
twice; if the inputs were retired (storage.superseded) after the listing, opening one fails with
FileNotFoundError. No placement of files fixes this: a path in a listing is the only name the reader
can open, so a replaced file cannot both keep its old path and vanish from new listings, and going from
the inputs to the output takes more than one rename. So a raw reader asks compactions to stand still:

    <root>/_holds/<id>.json      {"expires": ..., "host": ..., "pid": ...}

While a live hold exists no compaction publishes an output or retires an input. Appends go on; each
adds one whole part file by an atomic rename, which a listing either shows or does not. So inside a
hold a raw listing holds every row appended before it began exactly once, and every listed file stays
where it was until the hold ends.

Why no compaction slips past a hold: a compactor writes its claim (storage.journal) and only then looks
for holds; a reader writes its hold and only then looks at the claims. Whichever looks second sees the
other's file. The compactor that sees a hold withdraws its claim; the reader that sees a claim waits
until it is finished or withdrawn, and finishes itself a committed claim whose compactor died (it
retires the inputs, as recovery would: compactions stand still now, so none would do it), and drops
an uncommitted claim taken for dead, so that a compactor that was only slow backs off. This needs
listings that show a file once its write has returned: local disks, S3/GCS/Azure (strongly
consistent), and NFS with its directory cache turned down (`actimeo=0` or `lookupcache=none`) when
readers and compactors run on different hosts. A hold expires (a reader killed mid-read must not stop
compaction for good); a block that outlives its hold is warned about.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, field

from tensortune.storage.filesystem import Location, delete_quietly, exists, list_files, read_bytes, write_atomic
from tensortune.storage.journal import complete_journal, delete_journal, read_journals
from tensortune.storage.layout import HOLDS_DIR

HOLD_SECONDS = 600.0  # how long a hold lasts unless its reader says otherwise
SETTLE_SECONDS = 120.0  # how long taking a hold waits for the compactions already under way
_POLL = 0.05


@dataclass(frozen=True)
class Hold:
    """One reader's request that compactions stand still until `expires` (seconds since the epoch)."""

    id: str
    expires: float
    created: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)

    def path(self, location: Location) -> str:
        """Where this hold lives in the store."""
        return location.path(HOLDS_DIR, f"{self.id}.json")


def is_held(location: Location) -> bool:
    """Whether a live (unexpired) hold exists: then a compaction must not change any record file."""
    now = time.time()
    return any(expires > now for expires in _holds(location).values())


def remove_expired_holds(location: Location) -> int:
    """Delete the holds of readers that died holding (a minute past their expiry, for clock skew)."""
    limit = time.time() - 60.0
    return sum(delete_quietly(location, path) for path, expires in _holds(location).items() if expires < limit)


def _holds(location: Location) -> dict[str, float]:
    """{path: expiry} of every hold in the store."""
    found = {}
    for info in list_files(location, location.path(HOLDS_DIR)):
        if not info.base_name.endswith(".json") or info.base_name.startswith("."):
            continue
        try:
            found[info.path] = float(json.loads(read_bytes(location, info.path))["expires"])
        except FileNotFoundError:
            continue  # released while we listed
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"hold {info.path} is unreadable ({exc}). Holds are written whole; if no "
                             "reader is running, delete it") from exc
    return found


def take_hold(location: Location, seconds: float = HOLD_SECONDS,
              settle_seconds: float = SETTLE_SECONDS) -> Hold:
    """Write a hold, then wait until no compaction that started before it can still change a file."""
    if seconds <= 0:
        raise ValueError(f"a hold of {seconds} s protects nothing: give a positive duration")
    hold = Hold(id=uuid.uuid4().hex, expires=time.time() + seconds)
    write_atomic(location, hold.path(location), json.dumps(asdict(hold)).encode(), durable=False)
    try:
        _settle(location, time.monotonic() + settle_seconds)
    except BaseException:
        release_hold(location, hold)
        raise
    return hold


def release_hold(location: Location, hold: Hold) -> None:
    """Remove a hold; warns when it had expired, since compactions may then have run under the reader."""
    delete_quietly(location, hold.path(location))
    if time.time() > hold.expires:
        warnings.warn(f"record store {location.url}: a read held compactions for longer than its hold "
                      f"lasted ({hold.expires - hold.created:.0f} s), so a compaction may have replaced "
                      "files under it; hold for longer (hold_compactions(seconds=...))", stacklevel=3)


def _settle(location: Location, deadline: float) -> None:
    """Wait for the claims written before our hold: each either commits and finishes, or sees the hold
    and withdraws. A committed claim whose compactor is taken for dead is finished here, an uncommitted
    one dropped, as recovery does (a compactor that was only slow finds its claim gone and backs off)."""
    while True:
        waiting = []
        for journal in read_journals(location):
            if journal.finished is not None:
                continue
            committed = exists(location, location.path(journal.output))
            if journal.abandoned():
                if committed:
                    complete_journal(location, journal)
                else:
                    delete_journal(location, journal)
                continue
            waiting.append(journal)
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{j.id} (pid {j.pid} on {j.host})" for j in waiting)
            raise TimeoutError(f"record store {location.url}: compactions {names} have not finished; "
                               "try again later, or stop them")
        time.sleep(_POLL)

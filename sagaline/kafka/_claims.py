"""This machine's claims on static group members: one live client per member id.

A participant runtime and the coordinator join their groups as static members
(``group.instance.id``; the coordinator's ``transactional.id`` is the same string). A
second client with the same member id on the same broker fences the first, which dies
or flaps with a librdkafka error that says nothing of the twin. Each takes its claim
here when it starts (:func:`claim_member`); a second one on this machine, of this
process or another, is refused with :class:`InstanceClaimed` naming the holder's pid.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

__all__ = ["InstanceClaimed", "broker_list_key", "claim_member", "member_held", "release_member"]

log = logging.getLogger("sagaline.kafka")


class InstanceClaimed(RuntimeError):
    """Another client on this machine holds the static group member: ``holder`` is
    "this process" or "another process (pid N)", ``path`` the lock file."""

    def __init__(self, message: str, holder: str, path: str) -> None:
        super().__init__(message)
        self.holder = holder
        self.path = path


def claim_member(bootstrap: str, member: str, refusal: Callable[[str, str], str]) -> int | None:
    """Lock this machine's claim on the static group member ``member`` of ``bootstrap``
    and return the descriptor; :func:`release_member`, or the process ending however it
    ends, lets go, so a restarted process takes the id back at once (and fences its
    dead predecessor's transaction). :class:`InstanceClaimed` with ``refusal(holder,
    lock path)`` when another client, of this process or another, holds it.

    None, with a warning, when no lock file can be opened or locked (a read-only root
    file system in a container, a file of that name another user made, an NFS mount
    without a lock daemon): the claim only
    guards against a twin on this machine, and an instance served without it before
    claims existed, so it is not refused for that."""
    import fcntl

    key = f"{broker_list_key(bootstrap)}\0{member}"
    if bootstrap.startswith("memory://"):
        key += f"\0{os.getpid()}"  # an in-process broker: another process's is another one
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = f"sagaline-{os.getuid()}-member-{digest}"
    try:
        path = os.path.join(tempfile.gettempdir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # gettempdir() too: no usable temporary directory
        _unclaimed(member, getattr(exc, "filename", None) or name, "opened", exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        holder = "this process" if pid == str(os.getpid()) else f"another process (pid {pid})"
        raise InstanceClaimed(refusal(holder, path), holder, path) from None
    except OSError as exc:  # held is BlockingIOError: this file system locks nothing (ENOLCK)
        os.close(fd)
        _unclaimed(member, path, "locked", exc)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _claims.add(fd)
    return fd


@contextmanager
def member_held(
    bootstrap: str,
    member: str,
    refusal: Callable[[str, str], str],
    refused: Callable[[], None],
) -> Iterator[None]:
    """The claim on ``member`` (:func:`claim_member`) held for the ``with`` block and
    let go when it ends, however it ends. Refused: ``refused()`` (a client closing
    what it opened for a run that will not happen), then :class:`InstanceClaimed`."""
    try:
        claim = claim_member(bootstrap, member, refusal)
    except InstanceClaimed:
        refused()
        raise
    try:
        yield
    finally:
        release_member(claim)


def _unclaimed(member: str, path: str, verb: str, exc: OSError) -> None:
    log.warning(
        "instance %s not claimed on this machine: its lock file %s cannot be %s"
        " (%s); a second instance with that id here is not refused, and would fence"
        " this one. Set TMPDIR to a directory this user can write",
        member,
        path,
        verb,
        exc.strerror or exc,
    )


def broker_list_key(bootstrap: str) -> str:
    """``bootstrap`` as one spelling of its broker list: "k2:9092, K1:9092" and
    "k1:9092,k2:9092" are one cluster's, so one claim (a different list of one
    cluster's brokers is not recognised: that would take its cluster id)."""
    if bootstrap.startswith("memory://"):
        return bootstrap
    return ",".join(sorted({b.strip().lower() for b in bootstrap.split(",") if b.strip()}))


# The descriptors of this process's claims. A child forked while one is held (a
# multiprocessing pool with the fork start method) would inherit it, and with it the
# flock: the claim would outlive the runtime that stopped, refusing the next one
# ("already running in this process") while the child lived. The child closes its
# copies at once; the parent's still hold the lock.
_claims: set[int] = set()


def release_member(fd: int | None) -> None:
    """Let go of a claim :func:`claim_member` returned (None: none was taken)."""
    if fd is None:
        return
    _claims.discard(fd)
    os.close(fd)


def _forget_claims() -> None:
    for fd in list(_claims):
        with suppress(OSError):
            os.close(fd)
    _claims.clear()


os.register_at_fork(after_in_child=_forget_claims)

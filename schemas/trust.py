"""Identities and permissions on the ledger: who wrote a record, and may they?

With a trust file configured (``SAGALINE_TRUST_FILE``), every process signs with its
own Ed25519 key (``SAGALINE_SIGNING_KEY``, a PEM file) and every reader checks, in
:func:`schemas.wire.from_message`, that

1. the key id in header ``sagaline-kid`` is in the trust file and not retired,
2. the Ed25519 signature in ``sagaline-sig`` covers the record key and value,
3. the key's identity has the role allowed to write that record type
   (:data:`PERMISSIONS`), writes under its own name (``envelope.producer``), as the
   approver/resolver it claims to be, for a tenant it may act for, and (agents) for a
   principal it owns.

The checks that need a saga's history (a participant reports only on commands sent
to it; an agent drives only sagas it started; a saga keeps its tenant) run in the
coordinator core, which trusts ``envelope.producer`` because step 3 bound it to the key.

The trust file (JSON, or TOML when the name ends in ``.toml``)::

    {
      "identities": {
        "sagaline-coordinator": {"role": "coordinator"},
        "payments": {"role": "participant", "tenants": ["acme"]},
        "refund-agent": {"role": "agent", "principals": ["user:42"], "tenants": ["acme"]},
        "alice": {"role": "operator"}
      },
      "keys": {
        "payments.3f9a1c": {"identity": "payments", "public_key": "<base64 raw 32 bytes>"},
        "payments.0b77e2": {"identity": "payments", "public_key": "...", "retired": true}
      }
    }

``tenants`` omitted means every tenant; ``principals`` omitted means the identity's
own name (an empty ``principals`` list is refused, naming the identity). An operator
identity used by the dashboard lists ``"acts_for": ["alice", "bob"]`` (or ``["*"]``,
every operator identity): it signs decisions of the operators it has authenticated,
naming them as approver. ``sagaline keys new IDENTITY --role
ROLE`` writes a key pair and prints its entry.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import logging
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from schemas.errors import (
    BadSignature,
    ForbiddenWriter,
    MissingSignature,
    RetiredKey,
    TenantMismatch,
    UnknownKey,
)
from schemas.models import (
    ApprovalDenied,
    ApprovalGranted,
    IncidentResolved,
    Record,
    SagaStarted,
)
from schemas.signing import (
    ALG_HEADER,
    KID_HEADER,
    SIG_HEADER,
    HeaderList,
    Headers,
    Signer,
    header_value,
    shown,
    signed_material,
)

ED25519 = "ed25519"

log = logging.getLogger("sagaline.trust")


class Role(enum.StrEnum):
    """What an identity is; its role decides which record types it may write."""

    COORDINATOR = "coordinator"
    PARTICIPANT = "participant"
    AGENT = "agent"
    OPERATOR = "operator"


_OUTCOMES = frozenset(
    {
        "StepIntentRecorded",
        "StepCommitted",
        "StepFailed",
        "StepOutcomeUnknown",
        "StepReconciled",
        "CompensationAccepted",
        "CompensationCommitted",
        "CompensationFailed",
        "IncidentRaised",  # a runtime asked to look up a tool that declares no lookup
    }
)

PERMISSIONS: dict[Role, frozenset[str] | None] = {
    Role.COORDINATOR: None,  # every type: commands, terminal, incidents, its ledger events
    Role.PARTICIPANT: _OUTCOMES,
    Role.AGENT: frozenset({"SagaStarted", "StepScheduled", "SagaEndRequested"}),
    Role.OPERATOR: frozenset({"ApprovalGranted", "ApprovalDenied", "IncidentResolved"}),
}
"""Record types each role may write (``None``: all). docs/security.md mirrors it."""


class TrustFileError(ValueError):
    """The trust file or a key file cannot be used; the message names what to fix."""


@dataclass(frozen=True)
class Identity:
    """A writer on the ledger: a coordinator, a participant, an agent, an operator."""

    name: str
    role: Role
    tenants: frozenset[str] | None = None  # None: every tenant
    principals: frozenset[str] = frozenset()
    # Operators a gateway (the dashboard) decides for, after it authenticated them.
    acts_for: frozenset[str] = frozenset()
    # Their tenants (None: every tenant): a gateway decides for an operator only
    # within the tenants that operator may act for with its own key.
    acts_for_tenants: Mapping[str, frozenset[str] | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def may_act_for(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    identity: Identity
    public_key: Ed25519PublicKey = field(repr=False)
    retired: bool = False


class TrustStore:
    """Key ids -> public keys -> identities, as read from the trust file.

    A store loaded from a file re-reads it when it changes, so adding or retiring a key
    takes effect at the next record, without restarts. Every lookup compares the
    file's ``stat`` (device, inode, size, mtime and ctime in nanoseconds: far cheaper
    than the signature check it precedes). ``stat`` cannot show a rewrite of the same
    size within one tick of the file system's clock, so while the file's timestamps
    are within :data:`RACY_NS` of now (just after an edit) every lookup also compares
    a hash of the contents; after that, a lookup compares them at most every
    :attr:`CONTENT_CHECK_S` seconds (a network mount that caches attributes).
    Unchanged contents are not parsed again.
    """

    CONTENT_CHECK_S = 1.0
    """How often, at most, a lookup reads a settled file to compare its contents."""

    def __init__(
        self,
        identities: Mapping[str, Identity],
        keys: Mapping[str, TrustedKey],
        path: Path | None = None,
    ):
        self.identities = dict(identities)
        self.keys = dict(keys)
        self._path = path
        # What stat showed before the contents in hand were read (None: nothing yet,
        # so the first lookup reads the file), and whether it could hide a rewrite.
        self._stamp: _Stamp | None = None
        self._racy = False
        # The hash of the contents last read (None: unreadable), good or broken.
        self._seen: bytes | None = None
        self._next_check = _monotonic() + self.CONTENT_CHECK_S

    def refresh(self) -> None:
        """Re-read the file if it changed; a broken edit keeps the last good contents.

        Threads may refresh at once: what was read is stored with the stamp and hash
        it was read under, in one assignment, never a hash without its keys. A thread
        storing an older reading after a newer one leaves a stamp that no longer
        matches the file (or, at worst, a hash the next content check finds stale),
        so the next lookup reads the file again."""
        if self._path is None:
            return
        stamp = _stamp(self._path)
        now = _monotonic()
        if stamp == self._stamp and not self._racy and now < self._next_check:
            return
        self._next_check = now + self.CONTENT_CHECK_S
        # Stat before reading: a write landing in between gives a new stamp next time.
        racy = _racy(stamp)
        try:
            raw = _read(self._path)
        except TrustFileError as exc:
            if self._seen is not None:  # log the file going missing once, not per record
                log.error("keeping the previous trust file: %s", exc)
            self._stamp, self._racy, self._seen = stamp, racy, None
            return
        seen = hashlib.sha256(raw).digest()
        if seen == self._seen:  # touched, or rewritten with the same contents
            self._stamp, self._racy = stamp, racy
            return
        try:
            fresh = TrustStore._parse(self._path, raw)
        except TrustFileError as exc:
            # Remember a broken version too: re-reading and logging it at every record
            # would flood the log; the next change is read again.
            log.error("keeping the previous trust file: %s", exc)
            self._stamp, self._racy, self._seen = stamp, racy, seen
            return
        self.identities, self.keys, self._stamp, self._racy, self._seen = (
            fresh.identities,
            fresh.keys,
            stamp,
            racy,
            seen,
        )

    @classmethod
    def load(cls, path: str | Path) -> TrustStore:
        """Read a JSON or TOML trust file; :class:`TrustFileError` says what is wrong."""
        path = Path(path)
        stamp = _stamp(path)
        raw = _read(path)
        store = cls._parse(path, raw)
        store._stamp, store._racy = stamp, _racy(stamp)
        store._seen = hashlib.sha256(raw).digest()
        return store

    @classmethod
    def _parse(cls, path: Path, raw: bytes) -> TrustStore:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TrustFileError(f"trust file {path} is not UTF-8: {exc.reason}") from None
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
            raise TrustFileError(f"trust file {path} does not parse: {exc}") from None
        return cls.from_mapping(data, where=str(path), path=path)

    @classmethod
    def from_mapping(
        cls, data: Any, where: str = "trust file", path: Path | None = None
    ) -> TrustStore:
        if not isinstance(data, dict):
            raise TrustFileError(f"{where}: expected an object with identities and keys")
        # Every shape is checked here: anything else escaping would end a reader whose
        # refresh() meets a broken edit, instead of keeping the last good contents.
        entries = _entries(data.get("identities"), "identities", where)
        identities: dict[str, Identity] = {}
        for name, entry in entries.items():
            try:
                role = Role(entry["role"])
            except (KeyError, ValueError, TypeError):
                raise TrustFileError(
                    f"{where}: identity {name!r} needs a role, one of "
                    f"{', '.join(r.value for r in Role)}"
                ) from None
            tenants = _names(entry.get("tenants"), f"identity {name!r}", "tenants", where)
            principals = _names(entry.get("principals"), f"identity {name!r}", "principals", where)
            if principals == []:
                raise TrustFileError(
                    f"{where}: identity {name!r}: principals is an empty list; list the "
                    "principals it may start sagas for, or leave it out for the "
                    "identity's own name"
                )
            identities[name] = Identity(
                name=name,
                role=role,
                tenants=None if tenants is None or "*" in tenants else frozenset(tenants),
                principals=frozenset(principals or [name]),
            )
        operators = {n for n, i in identities.items() if i.role is Role.OPERATOR}
        for name, entry in entries.items():
            acts_for = set(
                _names(entry.get("acts_for"), f"identity {name!r}", "acts_for", where) or ()
            )
            if acts_for and identities[name].role is not Role.OPERATOR:
                raise TrustFileError(f"{where}: only an operator identity may have acts_for")
            resolved = operators if "*" in acts_for else acts_for & operators
            identities[name] = dataclasses.replace(
                identities[name],
                acts_for=frozenset(resolved),
                acts_for_tenants={op: identities[op].tenants for op in resolved},
            )
        keys: dict[str, TrustedKey] = {}
        for kid, entry in _entries(data.get("keys"), "keys", where).items():
            named = entry.get("identity")
            # A list or object here is unhashable: refuse it as a wrong shape, not a TypeError.
            owner = identities.get(named) if isinstance(named, str) else None
            if owner is None:
                raise TrustFileError(
                    f"{where}: key {kid!r} names identity {entry.get('identity')!r}, which "
                    "is not under identities"
                )
            try:
                public = Ed25519PublicKey.from_public_bytes(
                    base64.b64decode(entry["public_key"], validate=True)
                )
            except (KeyError, ValueError, TypeError):
                raise TrustFileError(
                    f"{where}: key {kid!r} needs public_key, the base64 of a raw 32-byte "
                    "Ed25519 public key (as printed by `sagaline keys new`)"
                ) from None
            retired = entry.get("retired", False)
            if not isinstance(retired, bool):
                raise TrustFileError(f"{where}: key {kid!r}: retired must be true or false")
            keys[kid] = TrustedKey(kid, owner, public, retired)
        return cls(identities, keys, path)

    def key(self, key_id: str) -> TrustedKey:
        """The live key ``key_id``; raises :class:`UnknownKey` or :class:`RetiredKey`."""
        self.refresh()
        found = self.keys.get(key_id)
        if found is None:
            raise UnknownKey(
                f"key id {shown(key_id)} is not in the trust file: add its entry "
                "(`sagaline keys new` prints it) or stop the writer"
            )
        if found.retired:
            raise RetiredKey(
                f"key id {key_id!r} of {found.identity.name!r} is retired in the trust file; "
                "the writer must sign with its current key"
            )
        return found

    def key_id_of(self, public_key: Ed25519PublicKey) -> str | None:
        """The id under which ``public_key`` is listed, if any (newest entry wins)."""
        raw = _raw(public_key)
        found = None
        for kid, entry in self.keys.items():
            if _raw(entry.public_key) == raw:
                found = kid
        return found


def _entries(value: Any, section: str, where: str) -> dict[str, dict[str, Any]]:
    """The ``identities`` or ``keys`` object: names to objects (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TrustFileError(f"{where}: {section} must be an object of named entries")
    for name, entry in value.items():
        if not isinstance(entry, dict):
            raise TrustFileError(f"{where}: {section} entry {name!r} must be an object")
    return value


def _names(value: Any, owner: str, field_name: str, where: str) -> list[str] | None:
    """A list of names (absent: None). One string is refused, not read as its
    characters: ``"tenants": "acme"`` would otherwise allow tenants "a", "c"..."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TrustFileError(
            f'{where}: {owner}: {field_name} must be a list of names, like ["acme"]'
        )
    return value


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TrustFileError(
            f"cannot read trust file {path}: {exc.strerror}; set SAGALINE_TRUST_FILE "
            "to an existing file"
        ) from None


_Stamp = tuple[int, int, int, int, int]


def _stamp(path: Path) -> _Stamp | None:
    """What ``stat`` shows of a change: an in-place edit moves mtime and ctime, a
    rename-over changes the inode; ctime also moves when mtime is set back."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


RACY_NS = 2_000_000_000
"""A file changed this recently (by the wall clock) may be rewritten with the same size
and timestamps: file systems keep time in ticks (a few ms on Linux, 2 s on FAT)."""


def _racy(stamp: _Stamp | None) -> bool:
    if stamp is None:
        return False
    now = time.time_ns()
    return any(abs(now - t) < RACY_NS for t in stamp[3:])


_monotonic = time.monotonic  # a module name, so tests can move the clock


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def authorize(writer: Identity, record: Record, reader: Identity | None = None) -> None:
    """Raise unless ``writer`` may write ``record`` (and ``reader`` may act on it).

    Stateless: the role's record types, ``envelope.producer`` is the writer's name,
    approvers and resolvers are the writer, tenants, agent principals.
    """
    env = record.envelope
    allowed = PERMISSIONS[writer.role]
    if allowed is not None and record.TYPE not in allowed:
        raise ForbiddenWriter(
            f"{writer.name!r} ({writer.role.value}) may not write {record.TYPE}; "
            f"{writer.role.value}s write only {', '.join(sorted(allowed))}"
        )
    if env.producer != writer.name:
        raise ForbiddenWriter(
            f"{record.TYPE} claims producer {env.producer!r} but is signed by {writer.name!r}"
        )
    claimed = _claimed_person(record)
    if claimed is not None and claimed != writer.name and claimed not in writer.acts_for:
        raise ForbiddenWriter(
            f"{record.TYPE} names {claimed!r} as approver/resolver but is signed by "
            f"{writer.name!r}: operators act only in their own name (a gateway only for "
            "the operators in its acts_for)"
        )
    if isinstance(record, SagaStarted) and record.principal not in writer.principals:
        raise ForbiddenWriter(
            f"agent {writer.name!r} may not start a saga for principal {record.principal!r} "
            f"(its principals: {', '.join(sorted(writer.principals))})"
        )
    if not writer.may_act_for(env.tenant_id):
        raise TenantMismatch(
            f"{writer.name!r} wrote {record.TYPE} for tenant {env.tenant_id!r}, outside its "
            f"tenants {sorted(writer.tenants or ())}"
        )
    if claimed is not None and claimed != writer.name:
        # A gateway deciding for an operator: within that operator's tenants too.
        tenants = writer.acts_for_tenants.get(claimed, frozenset())
        if tenants is not None and env.tenant_id not in tenants:
            raise TenantMismatch(
                f"{writer.name!r} decided as {claimed!r} ({record.TYPE}) for tenant "
                f"{env.tenant_id!r}, outside {claimed!r}'s tenants {sorted(tenants)}"
            )
    if reader is not None and not reader.may_act_for(env.tenant_id):
        raise TenantMismatch(
            f"{reader.name!r} serves tenants {sorted(reader.tenants or ())}, not "
            f"{env.tenant_id!r}: {record.TYPE} {record.event_id} refused"
        )


def _claimed_person(record: Record) -> str | None:
    if isinstance(record, ApprovalGranted):
        return record.granted_by
    if isinstance(record, ApprovalDenied):
        return record.denied_by
    if isinstance(record, IncidentResolved):
        return record.resolved_by
    return None


class SigningKeyError(TrustFileError):
    """This process's own key can no longer sign: retired or gone from the trust file
    (its records would be refused by every reader), and no live replacement in its
    key file. The message says what to do."""


KEY_CHECK_S = 1.0
"""How often, at most, a signer looks at its key file for a rotated key while its
current key is still live (at once when it is not)."""


class IdentitySigner(Signer):
    """Signs with this process's Ed25519 key; verifies and authorizes against the trust
    file. Without a private key it only verifies (a read-only viewer).

    Before each record it signs, the signer checks that its key is still live in the
    trust file. Given the key file's path (``key_path``, what ``SAGALINE_SIGNING_KEY``
    names), it also picks up a key rotated in place: a new key written there, of the
    same identity and listed live in the trust file, is used from the next record.
    A key retired or removed with no such replacement raises :class:`SigningKeyError`
    rather than writing records every reader refuses.

    Example::

        trust = TrustStore.load("trust.json")
        signer = IdentitySigner(trust, load_private_key("payments.pem"))
        key, value, headers = to_message(record, signer)   # signed as "payments"
        from_message(key, value, headers, signer)           # verified and authorized
    """

    __slots__ = (
        "_active",
        "_first",
        "_key_path",
        "_key_stamp",
        "_live_entry",
        "_logged_stamp",
        "_next_key_check",
        "trust",
    )

    def __init__(
        self,
        trust: TrustStore,
        private_key: Ed25519PrivateKey | None = None,
        key_id: str | None = None,
        key_path: str | Path | None = None,
    ) -> None:
        super().__init__(None, key_id=key_id or "")
        self.trust = trust
        # (private key, key id) used together: a rotation swaps the pair at once, so a
        # record never carries one key's id with another key's signature.
        self._active: tuple[Ed25519PrivateKey, str] | None = None
        self._first: Identity | None = None
        self._key_path = Path(key_path) if key_path is not None else None
        self._key_stamp = _stamp(self._key_path) if self._key_path is not None else None
        self._logged_stamp: _Stamp | None = None
        self._live_entry: TrustedKey | None = None  # the entry last found live for _active
        self._next_key_check = _monotonic() + KEY_CHECK_S
        if private_key is not None:
            kid = key_id or trust.key_id_of(private_key.public_key())
            if kid is None or kid not in trust.keys:
                raise TrustFileError(
                    "this process's signing key is not in the trust file: add the entry "
                    "`sagaline keys new` printed, or set SAGALINE_SIGNING_KEY_ID"
                )
            entry = trust.keys[kid]
            if _raw(entry.public_key) != _raw(private_key.public_key()):
                raise TrustFileError(
                    f"key id {kid!r} in the trust file holds another public key than "
                    "SAGALINE_SIGNING_KEY: use the matching key file or fix the entry"
                )
            self.key_id = kid
            self._active = (private_key, kid)
            self._first = entry.identity

    @property
    def identity(self) -> Identity | None:
        """Who this process signs as (None: a read-only viewer), as the trust file
        describes it now (its tenants, acts_for): the name never changes while it runs."""
        if self._first is None:
            return None
        return self.trust.identities.get(self._first.name, self._first)

    @property
    def enabled(self) -> bool:
        return True  # with a trust file every record must verify

    @property
    def can_sign(self) -> bool:
        """True when this process holds a key the trust file lists and has not retired
        (after picking up a key rotated in its key file)."""
        try:
            self._signing_key()
        except (SigningKeyError, ValueError):
            return False
        return True

    @property
    def signs_as(self) -> str | None:
        return self._first.name if self._first else None

    def __repr__(self) -> str:
        who = self._first.name if self._first else None
        return f"IdentitySigner(identity={who!r}, key_id={self.key_id!r})"

    def require(self, name: str, role: Role, process: str) -> None:
        """Raise :class:`TrustFileError` unless this process can sign as ``name``, an
        identity of ``role``: the name it writes as ``envelope.producer``. Every reader
        would refuse what it writes otherwise (a key of another identity, no key at all,
        a key retired with no live replacement). Called once at start by a service
        (``process`` names it in the message), before it does anything."""
        if self._first is None:
            raise TrustFileError(
                f"{process} writes as {name!r} but holds no signing key: set "
                f"SAGALINE_SIGNING_KEY to the key file of {name!r} (`sagaline keys new "
                f"{name} --role {role.value}`, its entry merged into the trust file)"
            )
        who = self.identity
        assert who is not None
        if who.name != name or who.role is not role:
            raise TrustFileError(
                f"{process} writes as {name!r} ({role.value}), but its key {self.key_id!r} "
                f"belongs to {who.name!r} ({who.role.value}) in the trust file: every "
                f"reader would refuse its records (forbidden-writer); set "
                f"SAGALINE_SIGNING_KEY to the key file of {name!r}"
            )
        self._signing_key()  # SigningKeyError: retired or gone, with no live replacement

    def sign(self, key: bytes | None, value: bytes) -> bytes:
        return self._signing_key()[0].sign(signed_material(key, value))

    def headers(self, key: bytes | None, value: bytes) -> Headers:
        private, kid = self._signing_key()
        return [
            (SIG_HEADER, private.sign(signed_material(key, value)).hex().encode("ascii")),
            (KID_HEADER, kid.encode("utf-8")),
            (ALG_HEADER, ED25519.encode("ascii")),
        ]

    def _signing_key(self) -> tuple[Ed25519PrivateKey, str]:
        """The live (private key, key id) to sign the next record with."""
        active = self._active
        if active is None:
            raise ValueError(
                "this process has no signing key; set SAGALINE_SIGNING_KEY to its PEM file"
            )
        self.trust.refresh()  # a stat, as for every record read
        entry = self.trust.keys.get(active[1])
        live = entry is not None and entry is self._live_entry
        if not live and self._problem(*active) is None:
            live, self._live_entry = True, entry  # checked once per reading of the file
        now = _monotonic()
        if live and now < self._next_key_check:
            return active
        self._next_key_check = now + KEY_CHECK_S
        rotated = self._rotated()
        if rotated is not None:
            return rotated
        problem = self._problem(*active)
        if problem is not None:
            where = (
                f"write its new key to SAGALINE_SIGNING_KEY ({self._key_path}) and list it "
                "in the trust file (it is used from the next record), or restart with "
                "SAGALINE_SIGNING_KEY set to a live key"
                if self._key_path is not None
                else "restart with SAGALINE_SIGNING_KEY set to a live key"
            )
            raise SigningKeyError(
                f"this process's signing key {active[1]!r} {problem}: every reader would "
                f"refuse its records, so nothing is signed; {where}"
            )
        return active

    def _problem(self, private: Ed25519PrivateKey, kid: str) -> str | None:
        """Why ``kid`` cannot sign now, or None."""
        entry = self.trust.keys.get(kid)
        if entry is None:
            return "is no longer in the trust file"
        if entry.retired:
            return f"of {entry.identity.name!r} is retired in the trust file"
        if _raw(entry.public_key) != _raw(private.public_key()):
            return "is listed in the trust file with another public key"
        if self._first is not None and entry.identity.name != self._first.name:
            return (
                f"is listed in the trust file for {entry.identity.name!r}, not "
                f"{self._first.name!r} as at start"
            )
        return None

    def _rotated(self) -> tuple[Ed25519PrivateKey, str] | None:
        """The key now in the key file, when it changed and the trust file lists it live
        for this identity: from then on the one used (and returned)."""
        if self._key_path is None:
            return None
        stamp = _stamp(self._key_path)
        if stamp == self._key_stamp:
            return None
        try:
            private = load_private_key(self._key_path)
        except TrustFileError as exc:  # half written, or not a key: wait for the next change
            self._key_stamp = stamp
            log.error("keeping the previous signing key: %s", exc)
            return None
        active = self._active
        assert active is not None
        if _raw(private.public_key()) == _raw(active[0].public_key()):
            self._key_stamp = stamp  # rewritten with the same key
            return None
        kid = self.trust.key_id_of(private.public_key())
        problem = (
            "its public key is not in the trust file"
            if kid is None
            else (None if (why := self._problem(private, kid)) is None else f"{kid!r} {why}")
        )
        if problem is not None:
            # Perhaps the trust file is edited next: looked at again at the next check.
            if stamp != self._logged_stamp:
                self._logged_stamp = stamp
                log.error(
                    "the new key in %s cannot sign yet (%s); still signing with %r",
                    self._key_path,
                    problem,
                    active[1],
                )
            return None
        assert kid is not None
        self._key_stamp = stamp
        self._active = (private, kid)
        self.key_id = kid
        log.warning(
            "signing key rotated: %s now signs with key id %r (was %r)",
            self.signs_as,
            kid,
            active[1],
        )
        return private, kid

    def verify(self, key: bytes | None, value: bytes, headers: HeaderList | None) -> Identity:
        return self.writer(key, value, headers)

    def writer(self, key: bytes | None, value: bytes, headers: HeaderList | None) -> Identity:
        """The identity whose live key signed (key, value); raises a SignatureError."""
        sig = header_value(headers, SIG_HEADER)
        kid = header_value(headers, KID_HEADER)
        if sig is None or kid is None:
            raise MissingSignature(
                "record is not signed with an identity key (no sagaline-sig/sagaline-kid) "
                "but a trust file is configured here"
            )
        alg = header_value(headers, ALG_HEADER)
        if alg != ED25519.encode():
            raise BadSignature(
                f"record is signed with {shown(alg)}, not ed25519: shared-key (HMAC) records "
                "carry no identity and are refused when a trust file is configured"
            )
        entry = self.trust.key(kid.decode("utf-8", "replace"))
        try:
            entry.public_key.verify(bytes.fromhex(sig.decode("ascii")), signed_material(key, value))
        except (InvalidSignature, ValueError, UnicodeDecodeError):
            raise BadSignature(
                f"Ed25519 signature does not verify under key {entry.key_id!r} of "
                f"{entry.identity.name!r}: altered, moved from another saga, or forged"
            ) from None
        return entry.identity

    def authorize(
        self, record: Record, headers: HeaderList | None, writer: Identity | None = None
    ) -> None:
        """Check ``record`` against the permissions of ``writer``, the identity
        :meth:`verify` found: the same trust-file entry whose key checked the signature.
        Looking the key id up again would read a trust file edited in between, and
        could authorize a record as an identity whose key never verified it."""
        if writer is None:  # a caller that did not keep verify()'s answer
            kid = header_value(headers, KID_HEADER)
            assert kid is not None  # verify() ran first
            writer = self.trust.key(kid.decode("utf-8", "replace")).identity
        authorize(writer, record, self.identity)


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """An unencrypted PKCS#8 PEM Ed25519 private key (what `sagaline keys new` writes)."""
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise TrustFileError(
            f"cannot load the signing key {path}: {exc}; point SAGALINE_SIGNING_KEY at "
            "the PEM file `sagaline keys new` wrote"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustFileError(f"{path} is not an Ed25519 private key")
    return key


def new_key_pair(
    identity: str, role: Role, key_id: str | None = None
) -> tuple[bytes, str, dict[str, Any]]:
    """A fresh key: ``(private PEM, key id, trust-file entries for it)``."""
    private = Ed25519PrivateKey.generate()
    raw = _raw(private.public_key())
    kid = key_id or f"{identity}.{hashlib.sha256(raw).hexdigest()[:12]}"
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    entry = {
        "identities": {identity: {"role": role.value}},
        "keys": {kid: {"identity": identity, "public_key": base64.b64encode(raw).decode()}},
    }
    return pem, kid, entry


__all__ = [
    "PERMISSIONS",
    "Identity",
    "IdentitySigner",
    "Role",
    "SigningKeyError",
    "TrustFileError",
    "TrustStore",
    "TrustedKey",
    "authorize",
    "load_private_key",
    "new_key_pair",
]

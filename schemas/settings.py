"""The one configuration object of every Sagaline process.

Defaults run the local demo; deployments override through environment variables:

================================  ===================  ===========================
variable                          field                default
================================  ===================  ===========================
``KAFKA_BOOTSTRAP_SERVERS``       ``bootstrap``        ``None`` (unset, see below)
``SAGALINE_TOPIC_PREFIX``         ``topic_prefix``     ``""``
``SAGALINE_PARTITIONS``           ``partitions``       ``6``
``SAGALINE_REPLICATION_FACTOR``   ``replication``      unset (the brokers')
``SAGALINE_MIN_INSYNC_REPLICAS``  ``replication``      unset (the brokers')
``SAGALINE_HMAC_KEY``             ``hmac_key``         unset (no signing)
``SAGALINE_HMAC_KEY_ID``          ``hmac_key_id``      ``"k1"``
``SAGALINE_TENANT_ID``            ``tenant_id``        ``"default"``
``SAGALINE_STATE_DIR``            ``state_dir``        ``".sagaline"``
``SAGALINE_SECRET_KEY``           ``secret_key``       unset (secrets redacted)
``SAGALINE_SECRET_KEY_ID``        ``secret_key_id``    ``"s1"``
``SAGALINE_OLD_SECRET_KEYS``      ``old_secret_keys``  unset (``id=secret,...``)
``SAGALINE_TRUST_FILE``           ``trust_file``       unset (HMAC or no signing)
``SAGALINE_SIGNING_KEY``          ``signing_key``      unset (PEM file path)
``SAGALINE_SIGNING_KEY_ID``       ``signing_key_id``   from the trust file
``SAGALINE_METRICS_HOST``         ``metrics_host``     ``"127.0.0.1"``
``SAGALINE_MAX_*``                ``limits``           see :mod:`schemas.limits`
================================  ===================  ===========================

``SAGALINE_SIGNING_KEY`` or ``SAGALINE_SIGNING_KEY_ID`` without
``SAGALINE_TRUST_FILE``, ``SAGALINE_SECRET_KEY_ID`` or ``SAGALINE_OLD_SECRET_KEYS``
without ``SAGALINE_SECRET_KEY``, and ``SAGALINE_HMAC_KEY_ID`` without
``SAGALINE_HMAC_KEY`` (and no trust file) are refused (:class:`SettingsError`), not
ignored.
With ``KAFKA_BOOTSTRAP_SERVERS`` unset, service commands stop with
``sagaline.kafka.BrokerNotConfigured`` (they never start a broker); only development
paths (the demo, the tests, ``--dev-broker``, ``sagaline.connect()``) then use the
local broker (``sagaline kafka up``).
``SAGALINE_REPLICATION_FACTOR`` and ``SAGALINE_MIN_INSYNC_REPLICAS`` (default: the
brokers' ``default.replication.factor`` and ``min.insync.replicas``) set
``replication``, used when topics are created.
Kafka client settings (SASL, SSL, tuning) are not here: they pass straight to
librdkafka from ``SAGALINE_KAFKA_*`` variables (see :mod:`sagaline.kafka`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from schemas.limits import LIMIT_ENV_VARS, Limits, LimitsError
from schemas.sealing import Sealer
from schemas.signing import Signer
from schemas.topics import DEFAULT_PARTITIONS, MAX_PARTITIONS, Replication, TopicNames

ENV_VARS: tuple[str, ...] = (
    "KAFKA_BOOTSTRAP_SERVERS",
    "SAGALINE_TOPIC_PREFIX",
    "SAGALINE_PARTITIONS",
    "SAGALINE_HMAC_KEY",
    "SAGALINE_HMAC_KEY_ID",
    "SAGALINE_TENANT_ID",
    "SAGALINE_STATE_DIR",
    "SAGALINE_SECRET_KEY",
    "SAGALINE_REPLICATION_FACTOR",
    "SAGALINE_MIN_INSYNC_REPLICAS",
    "SAGALINE_SECRET_KEY_ID",
    "SAGALINE_OLD_SECRET_KEYS",
    "SAGALINE_TRUST_FILE",
    "SAGALINE_SIGNING_KEY",
    "SAGALINE_SIGNING_KEY_ID",
    "SAGALINE_METRICS_HOST",
    *LIMIT_ENV_VARS,
)
"""Every environment variable :meth:`Settings.from_env` reads."""


class SettingsError(ValueError):
    """An environment variable holds a value Sagaline cannot use."""


@dataclass(frozen=True)
class Settings:
    """Process configuration. ``bootstrap=None``: no broker configured (service
    commands stop with ``BrokerNotConfigured``; only development paths use the local
    broker); the keys are never shown in its repr."""

    bootstrap: str | None = None
    topic_prefix: str = ""
    partitions: int = DEFAULT_PARTITIONS
    hmac_key: bytes | None = field(default=None, repr=False)
    hmac_key_id: str = "k1"
    tenant_id: str = "default"
    state_dir: Path = Path(".sagaline")
    secret_key: bytes | None = field(default=None, repr=False)
    replication: Replication = field(default_factory=Replication)
    secret_key_id: str = "s1"
    old_secret_keys: tuple[tuple[str, bytes], ...] = field(default=(), repr=False)
    trust_file: Path | None = None
    signing_key: Path | None = None
    signing_key_id: str | None = None
    metrics_host: str = "127.0.0.1"
    limits: Limits = field(default_factory=Limits)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the variables above (from ``os.environ`` unless ``env`` is given)."""
        env = os.environ if env is None else env
        # Empty counts as unset, as for every variable (``${VAR:-}`` in compose).
        raw_partitions = env.get("SAGALINE_PARTITIONS", "").strip() or str(DEFAULT_PARTITIONS)
        try:
            partitions = int(raw_partitions)
        except ValueError:
            raise SettingsError(
                f"SAGALINE_PARTITIONS={raw_partitions!r} is not an integer"
            ) from None
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise SettingsError(
                f"SAGALINE_PARTITIONS={partitions} must be between 1 and {MAX_PARTITIONS} "
                "(the most partitions the Kafka client creates a topic with)"
            )
        key = env.get("SAGALINE_HMAC_KEY") or None
        secret_key = (env.get("SAGALINE_SECRET_KEY") or "").encode("utf-8") or None
        secret_key_id = env.get("SAGALINE_SECRET_KEY_ID") or "s1"
        trust_file = _path(env.get("SAGALINE_TRUST_FILE"))
        _companions_need_their_key(env, trust_file is not None)
        replication = _replication(env)
        try:
            limits = Limits.from_env(env)
        except LimitsError as exc:
            raise SettingsError(str(exc)) from None
        return cls(
            bootstrap=env.get("KAFKA_BOOTSTRAP_SERVERS") or None,
            topic_prefix=env.get("SAGALINE_TOPIC_PREFIX", ""),
            partitions=partitions,
            hmac_key=key.encode("utf-8") if key else None,
            hmac_key_id=env.get("SAGALINE_HMAC_KEY_ID") or "k1",
            tenant_id=env.get("SAGALINE_TENANT_ID") or "default",
            state_dir=Path(env.get("SAGALINE_STATE_DIR") or ".sagaline"),
            secret_key=secret_key,
            replication=replication,
            secret_key_id=secret_key_id,
            old_secret_keys=_old_secret_keys(
                env.get("SAGALINE_OLD_SECRET_KEYS") or "", secret_key_id, secret_key
            ),
            trust_file=trust_file,
            signing_key=_path(env.get("SAGALINE_SIGNING_KEY")),
            signing_key_id=env.get("SAGALINE_SIGNING_KEY_ID") or None,
            metrics_host=env.get("SAGALINE_METRICS_HOST") or "127.0.0.1",
            limits=limits,
        )

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.topic_prefix)

    def sealer(self) -> Sealer:
        """Seals secret tool arguments for the ledger (redacts when no key is set)."""
        return Sealer(self.secret_key, self.secret_key_id, dict(self.old_secret_keys))

    def signer(self) -> Signer:
        """The signer for this process: its Ed25519 identity when a trust file is set
        (:mod:`schemas.trust`), else the shared HMAC key, else a no-op signer."""
        if self.trust_file is not None:
            from schemas.trust import IdentitySigner, TrustStore, load_private_key

            private = load_private_key(self.signing_key) if self.signing_key else None
            return IdentitySigner(
                TrustStore.load(self.trust_file), private, self.signing_key_id, self.signing_key
            )
        return Signer(self.hmac_key, key_id=self.hmac_key_id)


def _companions_need_their_key(env: Mapping[str, str], identities: bool) -> None:
    """A key's companion set without the key means the key went missing (a rotation
    that lost the new secret, a misspelt name): without this check the process ran in
    a weaker mode -- secrets redacted, not sealed, so the tool got the marker instead
    of the value; records signed with the shared key or not at all -- and said nothing."""
    rules = [
        (
            ("SAGALINE_SIGNING_KEY", "SAGALINE_SIGNING_KEY_ID"),
            "SAGALINE_TRUST_FILE",
            identities,
            "an identity key is used only with a trust file; without it this process would"
            " sign with the shared HMAC key, or not at all",
        ),
        (
            ("SAGALINE_SECRET_KEY_ID", "SAGALINE_OLD_SECRET_KEYS"),
            "SAGALINE_SECRET_KEY",
            False,
            "old keys only open, they never seal; without the current key this process"
            " would redact secret arguments instead of sealing them (tools get the marker)",
        ),
        (
            ("SAGALINE_HMAC_KEY_ID",),
            "SAGALINE_HMAC_KEY",
            identities,  # with identities the HMAC key is not used at all, nor its id
            "without the key this process would write unsigned records",
        ),
    ]
    for companions, key, satisfied, why in rules:
        if satisfied or env.get(key):
            continue
        given = [var for var in companions if env.get(var)]
        if given:
            named = " and ".join(given)
            raise SettingsError(
                f"{named} set without {key}: {why}; set {key} too, or unset {named}"
            )


def _replication(env: Mapping[str, str]) -> Replication:
    values: dict[str, int | None] = {}
    for var, name in (
        ("SAGALINE_REPLICATION_FACTOR", "factor"),
        ("SAGALINE_MIN_INSYNC_REPLICAS", "min_insync"),
    ):
        raw = env.get(var, "").strip()
        try:
            values[name] = int(raw) if raw else None
        except ValueError:
            raise SettingsError(f"{var}={raw!r} is not an integer") from None
    try:
        # Unset is the brokers' default; an explicit 0 is refused, not taken as unset.
        return Replication(factor=values["factor"], min_insync=values["min_insync"])
    except ValueError as exc:
        raise SettingsError(
            f"SAGALINE_REPLICATION_FACTOR / SAGALINE_MIN_INSYNC_REPLICAS: {exc}"
        ) from None


def _path(raw: str | None) -> Path | None:
    return Path(raw) if raw else None


def _old_secret_keys(
    raw: str, current_id: str = "s1", current: bytes | None = None
) -> tuple[tuple[str, bytes], ...]:
    """``id=secret,id=secret``: sealing keys that still open, never seal.

    A sealed value names only its key id, so an id must stand for one secret: an old
    key under the current key's id (a rotation that kept ``SAGALINE_SECRET_KEY_ID``)
    or under the id of another old key, with another secret, is refused. Otherwise one
    of them was silently dropped and every value it sealed failed to open."""
    out: list[tuple[str, bytes]] = []
    seen: dict[str, bytes] = {} if current is None else {current_id: current}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        kid, sep, secret = item.partition("=")
        if not sep or not kid or not secret:
            raise SettingsError(
                "SAGALINE_OLD_SECRET_KEYS must be id=secret pairs separated by commas "
                "(the id a value was sealed under, as in SAGALINE_SECRET_KEY_ID)"
            )
        value = secret.encode("utf-8")
        if seen.setdefault(kid, value) != value:
            which = (
                "the id of the current SAGALINE_SECRET_KEY (SAGALINE_SECRET_KEY_ID, s1 when unset)"
                if current is not None and kid == current_id
                else "another key in SAGALINE_OLD_SECRET_KEYS"
            )
            raise SettingsError(
                f"SAGALINE_OLD_SECRET_KEYS gives key id {kid!r} a secret other than "
                f"{which}: a sealed value names only its key id, so one id cannot stand "
                "for two secrets and the values sealed under one of them would not open; "
                "give the new SAGALINE_SECRET_KEY a new SAGALINE_SECRET_KEY_ID (e.g. s2) "
                f"and keep the old secret as {kid}=..."
            )
        out.append((kid, value))
    return tuple(out)


__all__ = ["ENV_VARS", "Settings", "SettingsError"]

"""Client configuration: every librdkafka setting from one place.

A deployment reaches librdkafka through two sources, merged in this order (later
wins): a Java-style properties file named by ``SAGALINE_KAFKA_PROPERTIES_FILE``, then
environment variables ``SAGALINE_KAFKA_<NAME>``, where ``<NAME>`` is the librdkafka
property upper-cased with dots as underscores (``SAGALINE_KAFKA_SECURITY_PROTOCOL=
SASL_SSL`` sets ``security.protocol``; one set to the empty string counts as unset).
The bootstrap address has exactly one source, ``KAFKA_BOOTSTRAP_SERVERS``.

Settings the design depends on (the partitioner that co-partitions topics, producer
idempotence and ``acks=all`` behind R10, read_committed reads behind exactly-once,
``auto.offset.reset=earliest`` behind redelivery, the classic group protocol behind
the group checks) are pinned: a source that tries to change them is refused at
start-up, not ignored.
Secret values (passwords, JAAS configs, private keys) never appear in a repr or log.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("sagaline.kafka")

ENV_PREFIX = "SAGALINE_KAFKA_"
PROPERTIES_FILE_VAR = "SAGALINE_KAFKA_PROPERTIES_FILE"
BOOTSTRAP_VAR = "KAFKA_BOOTSTRAP_SERVERS"
# Variables under the prefix that configure the local development broker launcher
# (services/kafka_local.py), not clients.
LAUNCHER_VARS = frozenset(
    {"SAGALINE_KAFKA_VERSION", "SAGALINE_KAFKA_PORT", "SAGALINE_KAFKA_START_TIMEOUT"}
)

# Words that mark a property's value as secret (librdkafka names).
# sasl.oauthbearer.config may carry a token or client secret ("token=...").
_SECRET_MARKERS = (
    "password",
    "secret",
    "jaas",
    "key.pem",
    "private",
    "token",
    "oauthbearer.config",
)
_MASK = "*****"

# What every producer and consumer needs for the design to hold; not overridable.
PINNED_PRODUCER: Mapping[str, Any] = {
    # murmur2_random matches the Java client's partitioner, so a saga id maps to the
    # same partition number on every co-partitioned topic whoever produced it.
    "partitioner": "murmur2_random",
    # Idempotence and acks=all: an acknowledged intent is durable (R10).
    "enable.idempotence": True,
    "acks": "all",
}
PINNED_CONSUMER: Mapping[str, Any] = {
    # Commits only after processing; aborted coordinator transactions never seen.
    "enable.auto.commit": False,
    "isolation.level": "read_committed",
    # A group with no committed offset (a new one, or one whose offsets expired while
    # it was down) reads from the start: with "latest" it would skip every command and
    # ledger record already written, never to be redelivered (R15).
    "auto.offset.reset": "earliest",
    # The classic group protocol (librdkafka's default): a group of the consumer
    # protocol (KIP-848) is not in the classic group listing that describe_group
    # reads, so one with members would read as DEAD with none.
    "group.protocol": "classic",
}
# Why each pinned setting is pinned: the refusal at start-up says so.
_WHY_PINNED: Mapping[str, str] = {
    "partitioner": "a saga id must map to the same partition of every co-partitioned topic",
    "enable.idempotence": "an acknowledged intent must be durable (R10)",
    "acks": "an acknowledged intent must be durable (R10)",
    "enable.auto.commit": "offsets are committed only after processing (exactly-once)",
    "isolation.level": "aborted coordinator transactions must never be read (exactly-once)",
    "auto.offset.reset": "a group with no committed offset must not skip what is written (R15)",
    "group.protocol": (
        "a consumer-protocol group is not in the group listing Sagaline reads, so a running "
        "coordinator or participant would read as a group with no members (clients refuse to "
        "start, `sagaline status` and `catalogue withdraw` see nothing consuming)"
    ),
}
# Defaults a deployment may tune (SAGALINE_KAFKA_LINGER_MS=...). linger.ms=0: every
# Sagaline writer waits for its own record's acknowledgement on a saga's critical path
# (an intent before its tool runs, an outcome, the agent's next step), so a linger is
# pure latency, paid about nine times a saga; under load librdkafka still batches
# what queues while earlier requests are in flight (measured in bench/e2e.py: one at
# a time 8.5 -> 19.1 sagas/s, 100 in flight 66.9 -> 105.4).
# max.in.flight.requests.per.connection=1: while one produce request is out, what
# queues behind it goes in the next one, so batches grow with load by themselves
# (a lone record still leaves at once); with 5 in flight nearly every record was a
# request of its own (bench/e2e.py, 100 sagas in flight: 81-85 -> 136-155 sagas/s
# in alternating runs, one at a time unchanged). Order and idempotence hold either way.
PRODUCER_DEFAULTS: Mapping[str, Any] = {
    "linger.ms": 0,
    "max.in.flight.requests.per.connection": 1,
    "compression.type": "lz4",
}
CONSUMER_DEFAULTS: Mapping[str, Any] = {}
# An admin client is short-lived: librdkafka logs, at info level (6), each one's
# "Purging 1 unserved events from background queue" on destroy, a stderr line in
# every command and example. Notices, warnings and errors (5 and below) still show.
ADMIN_DEFAULTS: Mapping[str, Any] = {"log_level": 5}
# Identities Sagaline gives each client itself (a consumer's group and static member
# id, the coordinator producer's transactional id): one for the whole process would be
# dropped for the clients that set theirs and applied to every other one (each ledger
# writer made transactional, each reader's group the same).
PER_CLIENT = ("group.id", "group.instance.id", "transactional.id")
# librdkafka's other names of pinned properties.
_ALIASES: Mapping[str, str] = {"request.required.acks": "acks"}
# The librdkafka properties spelt with an underscore, not a dot: a variable's name
# (``SAGALINE_KAFKA_LOG_LEVEL``) gives them with a dot, which librdkafka refuses.
_UNDERSCORED: Mapping[str, str] = {"log.level": "log_level"}
# librdkafka's other spellings of the pinned values: accepted (the pin is applied).
# librdkafka's spellings of a boolean (any case) count as the pinned boolean they mean.
_SYNONYMS: Mapping[str, str] = {
    "-1": "all",
    "smallest": "earliest",
    "beginning": "earliest",
    "1": "true",
    "0": "false",
}


# (name, deployment's value, client's value) already warned about: once per process.
_warned: set[tuple[str, str, str]] = set()
_warned_lock = threading.Lock()


class KafkaConfigError(ValueError):
    """A client setting from the environment or the properties file is unusable."""


def is_secret(name: str) -> bool:
    """True for properties whose value must never be shown (passwords, keys, JAAS)."""
    lowered = name.lower()
    return any(marker in lowered for marker in _SECRET_MARKERS)


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every secret value masked: what may be logged."""
    return {k: (_MASK if is_secret(k) else v) for k, v in config.items()}


@dataclass(frozen=True)
class ClientConfig:
    """The librdkafka settings shared by every client of this process.

    Build it with :meth:`from_env`; the factories in :mod:`sagaline.kafka` accept a
    bare bootstrap string too and read the rest from the environment then.
    """

    bootstrap: str
    settings: Mapping[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_env(cls, bootstrap: str, env: Mapping[str, str] | None = None) -> ClientConfig:
        """The settings from the properties file and ``SAGALINE_KAFKA_*`` variables."""
        env = os.environ if env is None else env
        merged: dict[str, str] = {}
        path = env.get(PROPERTIES_FILE_VAR, "").strip()
        if path:
            merged.update(read_properties(Path(path)))
        for var, value in env.items():
            if not var.startswith(ENV_PREFIX) or var in LAUNCHER_VARS | {PROPERTIES_FILE_VAR}:
                continue
            name = var[len(ENV_PREFIX) :].lower().replace("_", ".")
            name = _UNDERSCORED.get(name, name)
            if not name or not value:
                # Empty counts as unset, as for every variable (``${VAR:-}`` in
                # compose): not "" for librdkafka, nor over the properties file's value.
                continue
            merged[name] = value
        if "bootstrap.servers" in merged:
            raise KafkaConfigError(
                f"bootstrap.servers is set by {ENV_PREFIX}BOOTSTRAP_SERVERS or the "
                f"properties file; set {BOOTSTRAP_VAR} instead (its one source)"
            )
        for name in PER_CLIENT:
            if name in merged:
                raise KafkaConfigError(
                    f"{name} is set by Sagaline per client (from SAGALINE_TOPIC_PREFIX and "
                    f"the instance); remove it from {ENV_PREFIX}* / {PROPERTIES_FILE_VAR}"
                )
        pinned = {**PINNED_PRODUCER, **PINNED_CONSUMER}
        for name, value in merged.items():
            # librdkafka also takes a topic-level property as "topic.<name>", and
            # "acks" is its alias of request.required.acks: pinned under any name.
            # (A "topic.partitioner" listed after the pinned key won, silently.)
            base = name.removeprefix("topic.")
            base = _ALIASES.get(base, base)
            given = str(value).strip().lower()
            if base in pinned and _SYNONYMS.get(given, given) != str(pinned[base]).lower():
                raise KafkaConfigError(
                    f"{name}={value!r} is not allowed: Sagaline needs {base}="
                    f"{pinned[base]!r} ({_WHY_PINNED[base]}); remove it from "
                    f"{ENV_PREFIX}* / {PROPERTIES_FILE_VAR}"
                )
        return cls(bootstrap, merged)

    def base(self) -> dict[str, Any]:
        """``bootstrap.servers`` plus the deployment's settings (for any client)."""
        return {"bootstrap.servers": self.bootstrap, **self.settings}

    def _warn_overridden(self, overrides: Mapping[str, Any]) -> None:
        """A warning (once per process) for each deployment setting a client sets
        itself to another value: not used there, and not silently."""
        for name, value in overrides.items():
            given = self.settings.get(name)
            if given is None or str(given) == str(value):
                continue
            shown = (_MASK, _MASK) if is_secret(name) else (str(given), str(value))
            key = (name, *shown)
            with _warned_lock:
                if key in _warned:
                    continue
                _warned.add(key)
            log.warning(
                "%s=%s (%s%s or %s) is not used by one of this process's Kafka clients: "
                "Sagaline sets %s=%s for it",
                name,
                shown[0],
                ENV_PREFIX,
                name.upper().replace(".", "_"),
                PROPERTIES_FILE_VAR,
                name,
                shown[1],
            )

    def producer(self, **overrides: Any) -> dict[str, Any]:
        """Settings of a producer: defaults, the deployment's, the call's, the pins."""
        self._warn_overridden(overrides)
        return {**PRODUCER_DEFAULTS, **self.base(), **overrides, **PINNED_PRODUCER}

    def consumer(self, group_id: str, **overrides: Any) -> dict[str, Any]:
        """Settings of a consumer in ``group_id`` (manual commits, committed reads)."""
        self._warn_overridden(overrides)
        return {
            **CONSUMER_DEFAULTS,
            **self.base(),
            "group.id": group_id,
            **overrides,
            **PINNED_CONSUMER,
        }

    def admin(self, **overrides: Any) -> dict[str, Any]:
        """Settings of an admin client."""
        self._warn_overridden(overrides)
        return {**ADMIN_DEFAULTS, **self.base(), **overrides}

    def describe(self) -> str:
        """One line for logs: the bootstrap and every setting, secrets masked."""
        shown = ", ".join(f"{k}={v}" for k, v in sorted(redacted(self.settings).items()))
        return f"{self.bootstrap}" + (f" ({shown})" if shown else "")

    def __repr__(self) -> str:
        return f"ClientConfig({self.describe()!r})"


def read_properties(path: Path) -> dict[str, str]:
    """A Java-style ``.properties`` file (``name=value``, ``#`` comments)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KafkaConfigError(
            f"{PROPERTIES_FILE_VAR}={path} cannot be read: {exc.strerror}"
        ) from None
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        name, sep, value = line.partition("=")
        if not sep or not name.strip():
            # Not the line itself: it may hold a secret ("sasl.password: ..." is valid
            # Java properties syntax, but not ours), and this message is printed.
            raise KafkaConfigError(
                f"{path}:{number}: expected name=value (with '=', not ':' or a space); "
                "the line is not shown, it may hold a secret"
            )
        out[name.strip()] = value.strip()
    return out


def client_config(bootstrap: str | ClientConfig) -> ClientConfig:
    """A :class:`ClientConfig` as given, or built from the environment around a
    bootstrap string (how most callers pass it)."""
    if isinstance(bootstrap, ClientConfig):
        return bootstrap
    return ClientConfig.from_env(bootstrap)


def producer_config(bootstrap: str | ClientConfig, **overrides: Any) -> dict[str, Any]:
    """Every Sagaline producer's librdkafka settings (override per call)."""
    return client_config(bootstrap).producer(**overrides)


def consumer_config(
    bootstrap: str | ClientConfig, group_id: str, **overrides: Any
) -> dict[str, Any]:
    """Every Sagaline consumer's librdkafka settings (override per call)."""
    return client_config(bootstrap).consumer(group_id, **overrides)

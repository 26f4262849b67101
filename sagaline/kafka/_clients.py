"""Client factories: the only place that constructs a Kafka producer, consumer or admin.

Each takes a bootstrap string (the rest of the settings then come from the
environment, see :mod:`sagaline.kafka._config`) or a :class:`ClientConfig`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from sagaline.kafka import _memory
from sagaline.kafka._config import (
    BOOTSTRAP_VAR,
    ENV_PREFIX,
    PROPERTIES_FILE_VAR,
    ClientConfig,
    KafkaConfigError,
    client_config,
    is_secret,
)
from schemas.settings import Settings

log = logging.getLogger("sagaline.kafka")


class BrokerNotConfigured(RuntimeError):
    """A production command was started with no Kafka broker to talk to."""


def require_bootstrap(settings: Settings, command: str = "this command") -> str:
    """The configured bootstrap address; production commands never start a broker."""
    if settings.bootstrap:
        return settings.bootstrap
    raise BrokerNotConfigured(
        f"{command}: no Kafka broker configured. Set {BOOTSTRAP_VAR}=host:port (plus "
        "SAGALINE_KAFKA_* client settings for SASL/SSL, see docs/deploying.md). For "
        "development, start the local broker with `sagaline kafka up` and export the "
        "address it prints."
    )


class BrokerUnreachable(ConnectionError):
    """No Kafka broker answered at the configured address."""


# What a broker that answers says to a client whose security settings it refuses.
_REFUSALS = (KafkaError._AUTHENTICATION, KafkaError._SSL)

BROKER_PROBE_TIMEOUT_S = 30.0  # as long as ensure_topics waits for the broker's metadata


def require_broker_answers(bootstrap: str, who: str, timeout_s: float | None = None) -> None:
    """Raise :class:`BrokerUnreachable` naming ``bootstrap`` and what to do when no
    broker answers there within ``timeout_s`` (default :data:`BROKER_PROBE_TIMEOUT_S`).
    librdkafka's own log of each failed attempt (a line every 50 ms) is kept off
    stderr: its last error is in the message instead."""
    if _memory.is_memory(bootstrap):
        return
    wait_s = BROKER_PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    errors: list[KafkaError] = []
    config = client_config(bootstrap)
    admin = create_admin(config, **_quiet(config), error_cb=errors.append)
    try:
        admin.list_topics(timeout=wait_s)
    except KafkaException as exc:
        failed = exc
        admin.poll(0)  # serves the errors met meanwhile to error_cb
    else:
        return
    finally:
        # Destroyed here, its threads stopped: with a log level the deployment set,
        # librdkafka's lines otherwise went on after the refusal the caller prints.
        del admin
    error = failed.args[0] if failed.args and isinstance(failed.args[0], KafkaError) else None
    if error is None or error.code() not in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT):
        raise failed
    # Each failed attempt is followed by "N/N brokers are down", which says nothing.
    causes = [e for e in errors if e.code() != KafkaError._ALL_BROKERS_DOWN] or errors
    why = causes[-1].str() if causes else error.str()
    refusal = next((e for e in reversed(errors) if e.code() in _REFUSALS), None)
    if refusal is not None:  # it answered, and refused this client's credentials
        raise BrokerUnreachable(
            f"{who}: the Kafka broker at {bootstrap} refused this client"
            f" ({refusal.str()}): check the security settings {ENV_PREFIX}*"
            " (security.protocol, sasl.*, ssl.*; docs/deploying.md) against its listener"
        ) from None
    raise BrokerUnreachable(
        f"{who}: no Kafka broker answered at {bootstrap} within {wait_s:.0f} s ({why}):"
        " start one (`sagaline kafka up` prints its address) or set"
        f" {BOOTSTRAP_VAR} (and the {ENV_PREFIX}* client settings, docs/deploying.md)"
        " to a broker that runs"
    ) from None


def _quiet(config: ClientConfig) -> dict[str, Any]:
    """librdkafka's log off, for a client whose failure the caller reports in one line;
    unless the deployment sets a log level itself (to see that log): its level wins."""
    return {} if "log_level" in config.settings else {"log_level": 0}


def configured_broker(command: str, *, answering: bool = False) -> tuple[Settings, str]:
    """The process settings (from the environment) and the broker they name: what a
    production command starts with. Raises :class:`BrokerNotConfigured` when none is.
    ``answering``: also :class:`BrokerUnreachable` when none answers there (a one-shot
    command, which would otherwise fail after librdkafka's log of every attempt; a
    service rides out a broker that is not up yet instead)."""
    settings = Settings.from_env()
    bootstrap = require_bootstrap(settings, command)
    # Reading the client settings now refuses a bad one at start-up, not at first use;
    # the line says what this process connects with, secrets masked. librdkafka checks
    # every name and value first (a client built and dropped, nothing connected): a
    # misspelt secret's name ("sasl.pasword") is masked by no rule, so it is refused
    # before the line could show its value.
    config = ClientConfig.from_env(bootstrap)
    if not _memory.is_memory(bootstrap):
        # Quiet: it connects as soon as it is built, and with no broker there its
        # failed attempt would be logged before the command could say so in one line
        # (its settings' warnings are logged by the clients the command then makes).
        _built(AdminClient, config.admin(**_quiet(config)))
    log.info("kafka: %s", config.describe())
    if answering:
        require_broker_answers(bootstrap, command)
    return settings, bootstrap


def _built(kind: type[Any], settings: dict[str, Any]) -> Any:
    """``kind(settings)``, with a setting librdkafka refuses at construction (a
    misspelt property, a value it does not take, an SSL file it cannot load) raised as
    :class:`KafkaConfigError`: a setting to fix, which every command prints as an error
    line, not a broker fault (no traceback, no "the broker did not answer")."""
    try:
        return kind(settings)
    except KafkaException as exc:
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if error is None or error.code() != KafkaError._INVALID_ARG:
            raise
        text = error.str()
        for name, value in settings.items():  # never a secret value in the message
            if is_secret(name) and str(value):
                text = text.replace(str(value), "*****")
        raise KafkaConfigError(
            f"the Kafka client settings are refused: {text}; fix the {ENV_PREFIX}* variable "
            f"or the {PROPERTIES_FILE_VAR} line that sets it (docs/deploying.md)"
        ) from None


# A ``memory://NAME`` bootstrap selects the in-process transport (the fast test
# tier, :mod:`sagaline.kafka._memory`): the one seam, so nothing above knows.


def create_producer(bootstrap: str | ClientConfig, **overrides: Any) -> Producer:
    """A producer with Sagaline's settings (``transactional.id`` etc. as overrides)."""
    config = client_config(bootstrap)
    if _memory.is_memory(config.bootstrap):
        broker = _memory.broker_for(config.bootstrap)
        return cast(Producer, _memory.MemoryProducer(broker, config.producer(**overrides)))
    return cast(Producer, _built(Producer, config.producer(**overrides)))


def create_consumer(bootstrap: str | ClientConfig, group_id: str, **overrides: Any) -> Consumer:
    """A consumer in ``group_id`` with Sagaline's settings."""
    config = client_config(bootstrap)
    if _memory.is_memory(config.bootstrap):
        broker = _memory.broker_for(config.bootstrap)
        return cast(
            Consumer, _memory.MemoryConsumer(broker, config.consumer(group_id, **overrides))
        )
    return cast(Consumer, _built(Consumer, config.consumer(group_id, **overrides)))


def create_uncommitted_reader(
    bootstrap: str | ClientConfig, group_id: str, **overrides: Any
) -> Consumer:
    """A consumer like :func:`create_consumer`'s that also reads records of
    transactions still open (or aborted): up to the high watermark, not the last
    stable offset. Only for a reader looking for records no transaction writes (a
    participant's intents and outcomes), which an open coordinator transaction must
    not hide from it."""
    config = client_config(bootstrap)
    settings = {**config.consumer(group_id, **overrides), "isolation.level": "read_uncommitted"}
    if _memory.is_memory(config.bootstrap):
        broker = _memory.broker_for(config.bootstrap)
        return cast(Consumer, _memory.MemoryConsumer(broker, settings))
    return cast(Consumer, _built(Consumer, settings))


def create_admin(bootstrap: str | ClientConfig, **overrides: Any) -> AdminClient:
    """An admin client on the deployment's settings."""
    config = client_config(bootstrap)
    if _memory.is_memory(config.bootstrap):
        broker = _memory.broker_for(config.bootstrap)
        return cast(AdminClient, _memory.MemoryAdmin(broker, config.admin(**overrides)))
    return cast(AdminClient, _built(AdminClient, config.admin(**overrides)))


_RETRY_CODES = (
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._TRANSPORT,
    KafkaError._TIMED_OUT,
)


def raise_if_fatal(error: KafkaError) -> None:
    """Raise a consumer's fatal error (e.g. fenced by a member with the same
    ``group.instance.id`` after a broker restart): such a consumer delivers nothing
    again, so a service that only logged it would sit idle for good (CI saw a
    coordinator do so); raising ends the process for its supervisor to restart.
    The error poll hands over for it has code ``_FATAL`` but ``fatal()`` False (only
    errors of the transactional API carry the flag), so the code counts too."""
    if error.fatal() or error.code() == KafkaError._FATAL:
        raise KafkaException(error)


RebalanceCallback = Callable[[Consumer, list[TopicPartition]], None]


def closing_tolerated(callback: RebalanceCallback) -> RebalanceCallback:
    """``callback`` (``subscribe``'s on_assign/on_revoke/on_lost) cut short, quietly,
    when the consumer's handle is being destroyed: ``close()`` runs the rebalance an
    assignment that arrived just before it (a join completing as a service stops),
    and a consumer call in the callback (``committed``) then fails with ``_DESTROY``.
    confluent-kafka 2.16 hands that error out of ``close()`` as a bare ``KafkaError``,
    no ``BaseException``: no ``except`` catches it and the process dies (a CI worker
    did). Nothing is left to serve once the consumer closes, so nothing is lost."""

    def tolerant(consumer: Consumer, partitions: list[TopicPartition]) -> None:
        try:
            callback(consumer, partitions)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if not isinstance(error, KafkaError) or error.code() != KafkaError._DESTROY:
                raise
            log.info(
                "rebalance of %s left undone: the consumer is closing (%s)",
                [f"{tp.topic}[{tp.partition}]" for tp in partitions],
                error.str(),
            )

    return tolerant


def watermarks(consumer: Consumer, tp: TopicPartition, timeout_s: float = 60.0) -> tuple[int, int]:
    """Low and high watermarks of ``tp``, retried while the partition has no leader
    yet (a topic created a moment ago, a broker restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            return int(low), int(high)
        except KafkaException as exc:
            error = exc.args[0]
            retriable = error.retriable() or error.code() in _RETRY_CODES
            if not retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.2)

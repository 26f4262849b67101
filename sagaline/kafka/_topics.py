"""Topic creation: every topic of a deployment, with its replication settings.

What the topics are (names, partition counts, cleanup policies) is the contract's
business (:mod:`schemas.topics`); this module only makes the broker match it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    ConfigResource,
    NewTopic,
    ResourceType,
)

from sagaline.kafka import _memory
from sagaline.kafka._clients import create_admin
from sagaline.kafka._config import ClientConfig, client_config
from schemas.topics import DEFAULT_PARTITIONS, Replication, TopicNames, TopicSpec, topic_specs

log = logging.getLogger("sagaline.kafka")


class TopicSetupError(RuntimeError):
    """A topic could not be created, or exists with settings that break the design."""


# A topic's error in the metadata that no wait makes go away (others, such as
# LEADER_NOT_AVAILABLE just after creation, clear up). librdkafka marks no metadata
# error retriable, so the codes are listed here.
_REFUSED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED})


def ensure_topics(
    bootstrap: str | ClientConfig,
    names: TopicNames,
    participants: Iterable[str] = (),
    partitions: int = DEFAULT_PARTITIONS,
    *,
    replication: Replication | None = None,
    timeout_s: float = 30.0,
    shared: bool = True,
) -> list[str]:
    """Create every missing topic; existing ones are left alone (idempotent).

    ``replication`` sets the replication factor and ``min.insync.replicas`` of new
    topics (default, and for either left None: the brokers' ``default.replication.factor``
    and ``min.insync.replicas``; services pass ``settings.replication``). With no
    factor set, the brokers' defaults are read before any topic is made, and a
    default factor below the ``min.insync.replicas`` new topics would get is refused
    (no topic made would take an ``acks=all`` write), naming the
    ``SAGALINE_REPLICATION_FACTOR`` to set; brokers that do not describe their
    config (no ``DESCRIBE_CONFIGS`` on the cluster) are not checked, said in an info
    line. Raises :class:`TopicSetupError` naming
    the topic when creation fails for any reason other than "already exists", or
    when a co-partitioned topic already exists with a different partition count
    (co-partitioning would silently break), or when a topic it did not create has a
    ``cleanup.policy`` that loses records (a compacted ledger, incident feed or DLQ
    keeps one record per key; a catalogue, terminal or state changelog without
    ``compact``, or with ``delete`` too and a ``retention.ms`` or ``retention.bytes``
    other than -1, loses entries to retention; a compacted command topic is tolerated),
    or when a topic's replication breaks what ``acks=all`` promises (R10): fewer
    replicas than ``replication.factor`` when set (checked before any topic is made), or a
    ``min.insync.replicas`` above the topic's replicas (every write refused) or below
    ``replication.min_insync``; a replicated topic on ``min.insync.replicas=1`` with
    none configured is only warned about. Policies and ``min.insync.replicas`` are
    read with one DescribeConfigs request, and a topic this client may not describe
    (no ``DESCRIBE_CONFIGS``) is left unchecked, said in an info line. Returns the
    names this call created.

    ``shared=False``: only the participants' command topics are made and checked (the
    coordinator setting up a participant's topic while it runs: the shared topics were
    checked at its start, and a refusal of one of them is no fault of that topic).
    """
    config = client_config(bootstrap)
    replication = replication or Replication()
    specs = topic_specs(names, participants, partitions)
    if not shared:
        wanted = {names.commands(p) for p in participants}
        specs = [s for s in specs if s.name in wanted]
    admin = create_admin(config)
    # Create only what is missing: a service whose topics an admin job created needs
    # DESCRIBE on them, not CREATE (least privilege, docs/deploying.md).
    listing = admin.list_topics(timeout=timeout_s)
    existing = listing.topics
    # A co-partitioned topic that exists with another count is refused before any
    # missing one is made with this call's count: made first, they would be refused
    # in turn once the count is set to the existing topics'.
    # So is a topic with fewer replicas than the deployment asks for.
    _check_co_partitioning(specs, existing)
    few: list[str] = []
    for spec in specs:
        listed = existing.get(spec.name)
        if listed is None or listed.error is not None:
            continue
        if listed.partitions and not _memory.is_memory(config.bootstrap):
            refusal, _ = _replication_verdict(spec.name, _replicas(listed), None, replication)
            few += [refusal] if refusal is not None else []
    _refuse_replication(few)
    missing = [s for s in specs if s.name not in existing]
    if missing and replication.factor is None and not _memory.is_memory(config.bootstrap):
        defaults = _broker_defaults(admin, listing.brokers, timeout_s)
        refusal = None if defaults is None else _default_factor_verdict(*defaults, replication)
        _refuse_replication([refusal] if refusal is not None else [])
    futures = (
        admin.create_topics(
            [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    # -1: the brokers' default.replication.factor (KIP-464)
                    replication_factor=-1 if replication.factor is None else replication.factor,
                    config={**s.config, **replication.topic_config()},
                )
                for s in missing
            ],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        if missing
        else {}
    )
    created: list[str] = []
    unlisted: list[str] = []  # "already exists", yet not listed: created meanwhile, or hidden
    answer_by = time.monotonic() + timeout_s  # one wait for them all, not one each
    for name, future in futures.items():
        try:
            future.result(timeout=max(0.0, answer_by - time.monotonic()))
            created.append(name)
        except TimeoutError as exc:
            raise TopicSetupError(
                f"cannot create topic {name!r} on {config.bootstrap}: no answer from the "
                f"broker within {timeout_s:.0f} s (is it reachable and healthy? it may "
                "still create the topic: run again to check)"
            ) from exc
        except KafkaException as exc:
            err: Any = exc.args[0] if exc.args else None
            if getattr(err, "code", lambda: None)() == KafkaError.TOPIC_ALREADY_EXISTS:
                unlisted.append(name)
                continue
            raise TopicSetupError(
                f"cannot create topic {name!r} on {config.bootstrap}: {exc}"
            ) from exc
    # Metadata propagates asynchronously after CreateTopics: poll until every topic
    # is visible with all its partitions, then check the co-partitioning.
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = admin.list_topics(timeout=timeout_s)
        errors = {
            s.name: t.error
            for s in specs
            if (t := metadata.topics.get(s.name)) is not None and t.error is not None
        }
        for name, error in errors.items():
            if error.code() in _REFUSED:
                raise TopicSetupError(
                    f"topic {name!r} on {config.bootstrap} is refused to this client: {error} "
                    "(docs/deploying.md lists the ACLs each service needs)"
                )
        invisible = [
            s.name
            for s in specs
            if (t := metadata.topics.get(s.name)) is None or t.error is not None or not t.partitions
        ]
        if not invisible:
            break
        if time.monotonic() > deadline:
            why = [f"{name}: {errors[name]}" for name in invisible if name in errors]
            why += [
                f"{name}: the broker says it exists but does not list it (no DESCRIBE on "
                "it for this client? docs/deploying.md)"
                for name in invisible
                if name in unlisted and name not in errors
            ]
            raise TopicSetupError(
                f"topics {invisible} are not visible on {config.bootstrap} {timeout_s:.0f} s "
                "after creation" + (f" ({'; '.join(why)})" if why else "")
            )
        time.sleep(0.1)
    _check_co_partitioning(specs, metadata.topics)
    if not _memory.is_memory(config.bootstrap):
        # A compacted command topic is tolerated: the participant never prunes its
        # journal then (docs/operating.md, "The command journal").
        commands = f"{names.prefix}sagaline.commands."
        policed = {
            s.name for s in specs if s.name not in created and not s.name.startswith(commands)
        }
        replicas = {s.name: _replicas(metadata.topics[s.name]) for s in specs}
        _check_configs(admin, specs, policed, replicas, replication, timeout_s)
    return sorted(created)


def command_topic_participants(
    bootstrap: str | ClientConfig, names: TopicNames, *, timeout_s: float = 30.0
) -> set[str]:
    """The participants whose command topics (``names.commands(p)``) exist, as this
    client sees them (one metadata request; a topic it may not describe is not
    listed). Raises ``KafkaException`` when the broker does not answer."""
    prefix = f"{names.prefix}sagaline.commands."
    listed = create_admin(client_config(bootstrap)).list_topics(timeout=timeout_s).topics
    return {name[len(prefix) :] for name in listed if name.startswith(prefix) and name != prefix}


def _replicas(topic: Any) -> int:
    """A listed topic's replication factor: its fewest replicas over its partitions
    (it has some: listed without any, it is not looked at)."""
    return min(len(p.replicas) for p in topic.partitions.values())


# Topics already warned about (replicated, on min.insync.replicas=1): once per process,
# not again each time the coordinator creates a new participant's command topic.
_warned: set[str] = set()


def _replication_verdict(
    topic: str, replicas: int, min_insync: int | None, wanted: Replication
) -> tuple[str | None, str | None]:
    """What an existing topic's replication means for ``acks=all`` writes (R10):
    ``(why it is refused, why it is warned about)``, each None when it is not.
    ``min_insync`` is the topic's effective ``min.insync.replicas``, None when the
    broker did not say (then only the replication factor is judged)."""
    if wanted.factor is not None and replicas < wanted.factor:
        return (
            f"topic {topic!r} has replication factor {replicas}, below "
            f"SAGALINE_REPLICATION_FACTOR={wanted.factor}: an acknowledged record is on "
            "fewer brokers than the deployment asks for; add replicas "
            "(kafka-reassign-partitions.sh) or recreate the topic, or set "
            "SAGALINE_REPLICATION_FACTOR to what it has",
            None,
        )
    if min_insync is None:
        return None, None
    if min_insync > replicas:
        return (
            f"topic {topic!r} has min.insync.replicas={min_insync}, above its replication "
            f"factor {replicas}: the broker refuses every acks=all write to it "
            f"(NOT_ENOUGH_REPLICAS); give it at least {min_insync} replicas "
            "(kafka-reassign-partitions.sh; a topic that holds no records yet, such as one "
            "made by a start without SAGALINE_REPLICATION_FACTOR, can be deleted and made "
            "again by a start with SAGALINE_REPLICATION_FACTOR set to the cluster's size, "
            "at most 3), or lower its min.insync.replicas (kafka-configs.sh --alter "
            f"--add-config min.insync.replicas=N) to at most {replicas}, which leaves an "
            "acknowledged record on fewer brokers",
            None,
        )
    if wanted.min_insync is not None and min_insync < wanted.min_insync:
        return (
            f"topic {topic!r} has min.insync.replicas={min_insync}, below "
            f"SAGALINE_MIN_INSYNC_REPLICAS={wanted.min_insync}: an acks=all write is "
            "acknowledged with fewer copies than the deployment asks for; set it "
            "(kafka-configs.sh --alter --add-config "
            f"min.insync.replicas={wanted.min_insync})",
            None,
        )
    if wanted.min_insync is None and min_insync < 2 <= replicas:
        return None, (
            f"topic {topic!r} has {replicas} replicas but min.insync.replicas={min_insync}: "
            "an acks=all write is acknowledged once its leader alone has it when the other "
            "replicas lag, and lost with that broker; set SAGALINE_MIN_INSYNC_REPLICAS "
            "(2 with 3 replicas) and the topic's min.insync.replicas (docs/deploying.md, "
            "Replication)"
        )
    return None, None


def _broker_defaults(
    admin: Any, brokers: dict[int, Any], timeout_s: float
) -> tuple[int, int, int] | None:
    """``(brokers up, default.replication.factor, min.insync.replicas)`` of the
    cluster (``brokers``: the ids listed in its metadata; the defaults are one
    broker's), or None, said in an info line, when a broker does not say."""
    if not brokers:
        return None
    resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
    try:
        futures = admin.describe_configs([resource], request_timeout=timeout_s)
        entries = futures[resource].result(timeout=timeout_s)
        named = {n: entries.get(n) for n in ("default.replication.factor", "min.insync.replicas")}
        unsaid = [n for n, entry in named.items() if entry is None or not entry.value]
        if unsaid:
            raise ValueError(f"broker {resource.name} does not report {', '.join(unsaid)}")
        factor, min_insync = (int(entry.value) for entry in named.values())
    except (KafkaException, TimeoutError, ValueError) as exc:
        log.info(
            "the brokers' default.replication.factor and min.insync.replicas not checked "
            "before creating topics (no DESCRIBE_CONFIGS on the cluster for this client?): %s",
            str(exc) or "no answer",
        )
        return None
    return len(brokers), factor, min_insync


def _default_factor_verdict(
    brokers: int, default_factor: int, broker_min_insync: int, wanted: Replication
) -> str | None:
    """Why topics made with the brokers' ``default_factor`` (no
    ``SAGALINE_REPLICATION_FACTOR``) would take no ``acks=all`` write, or None: their
    ``min.insync.replicas`` (``wanted``'s, else the brokers') is above it."""
    min_insync = broker_min_insync if wanted.min_insync is None else wanted.min_insync
    if default_factor >= min_insync:
        return None
    whose = (
        f"the brokers' min.insync.replicas={min_insync}"
        if wanted.min_insync is None
        else f"SAGALINE_MIN_INSYNC_REPLICAS={min_insync}"
    )
    why = (
        "SAGALINE_REPLICATION_FACTOR is unset, so new topics would get the brokers' "
        f"default.replication.factor={default_factor}, below {whose}: the brokers would "
        "refuse every acks=all write to them (NOT_ENOUGH_REPLICAS); no topic was made"
    )
    if brokers < min_insync:
        return (
            f"{why}, and the cluster has {brokers} broker(s) up, fewer than that: start "
            "more brokers, or lower min.insync.replicas"
        )
    factor = max(min_insync, min(3, brokers))
    return (
        f"{why}; set SAGALINE_REPLICATION_FACTOR={factor} (the cluster has {brokers} "
        "brokers up), or the brokers' default.replication.factor"
    )


def _refuse_replication(refusals: list[str]) -> None:
    if refusals:
        raise TopicSetupError("; ".join(refusals) + " (docs/deploying.md, Replication)")


def _check_co_partitioning(specs: list[TopicSpec], listed: dict[str, Any]) -> None:
    """Raise :class:`TopicSetupError` when the co-partitioned topics of ``listed``
    (name to topic metadata) have another partition count than their spec's: naming
    the count to set when they all have one, every topic's when they differ among
    themselves (then no setting fixes them)."""
    counts = {
        s.name: len(t.partitions)
        for s in specs
        if s.co_partitioned
        and (t := listed.get(s.name)) is not None
        and t.error is None
        and t.partitions
    }
    if len(set(counts.values())) > 1:
        raise TopicSetupError(
            ", ".join(f"topic {n!r} has {c} partitions" for n, c in counts.items())
            + ": co-partitioned topics must match, and these do not match each other (a "
            "saga's records are on other partition numbers in each), so no "
            "SAGALINE_PARTITIONS fixes them; recreate the topics that are off "
            "(docs/operating.md, Topics)"
        )
    for spec in specs:
        actual = counts.get(spec.name, spec.partitions)
        if actual != spec.partitions:
            raise TopicSetupError(
                f"topic {spec.name!r} has {actual} partitions, expected "
                f"{spec.partitions}: co-partitioned topics must match; recreate it or set "
                f"SAGALINE_PARTITIONS={actual}"
            )


def _loses_records(actual: str, expected: str, deletes_by_age_or_size: bool = True) -> bool:
    """Whether a topic on ``actual`` drops what the design keeps on ``expected``: a
    topic meant to keep every record compacted (one per key left), or one meant
    compacted without compaction, or compacted and ``delete`` too while its
    ``retention.ms`` or ``retention.bytes`` is set (``deletes_by_age_or_size``): every
    entry deleted with age, at retention, the latest of a key too."""
    has = {p.strip().lower() for p in actual.split(",")}
    if "compact" in {p.strip().lower() for p in expected.split(",")}:
        return "compact" not in has or ("delete" in has and deletes_by_age_or_size)
    return "compact" in has


def _deletes_by_age_or_size(entries: dict[str, Any]) -> bool:
    """Whether a topic's ``retention.ms`` or ``retention.bytes`` (as described) deletes
    segments: either not -1, or not said (then assumed to)."""
    for name in ("retention.ms", "retention.bytes"):
        entry = entries.get(name)
        if entry is None or entry.value is None or str(entry.value).strip() != "-1":
            return True
    return False


def _check_configs(
    admin: Any,
    specs: list[TopicSpec],
    policed: set[str],
    replicas: dict[str, int],
    replication: Replication,
    timeout_s: float,
) -> None:
    """Raise :class:`TopicSetupError` for a topic of ``policed`` whose
    ``cleanup.policy`` loses records its spec's keeps, or for any topic whose
    ``min.insync.replicas`` breaks ``acks=all`` (:func:`_replication_verdict`); a topic
    the broker does not describe is only named in a log line."""
    resources = {s.name: ConfigResource(ResourceType.TOPIC, s.name) for s in specs}
    unchecked: list[str] = []
    try:
        futures = admin.describe_configs(list(resources.values()), request_timeout=timeout_s)
    except KafkaException as exc:
        log.info("cleanup.policy and min.insync.replicas of the topics not checked: %s", exc)
        return
    wrong: list[str] = []
    refusals: list[str] = []
    for spec in specs:
        try:
            entries = futures[resources[spec.name]].result(timeout=timeout_s)
        except (KafkaException, TimeoutError) as exc:
            unchecked.append(f"{spec.name} ({str(exc) or 'no answer'})")
            continue
        isr = entries.get("min.insync.replicas")
        min_insync = None if isr is None or isr.value is None else int(isr.value)
        refusal, warning = _replication_verdict(
            spec.name, replicas[spec.name], min_insync, replication
        )
        if refusal is not None:
            refusals.append(refusal)
        if warning is not None and spec.name not in _warned:
            _warned.add(spec.name)
            log.warning("%s", warning)
        entry = entries.get("cleanup.policy")
        expected = spec.config.get("cleanup.policy")
        if spec.name not in policed or entry is None or entry.value is None or expected is None:
            continue
        if _loses_records(str(entry.value), expected, _deletes_by_age_or_size(entries)):
            kept = ""
            if "delete" in str(entry.value) and "compact" in str(entry.value):
                ms, size = (entries.get(n) for n in ("retention.ms", "retention.bytes"))
                kept = (
                    f" (with retention.ms={None if ms is None else ms.value}, "
                    f"retention.bytes={None if size is None else size.value}: the latest "
                    "record of a key is deleted too)"
                )
            wrong.append(
                f"topic {spec.name!r} has cleanup.policy={entry.value}{kept}, expected "
                f"cleanup.policy={expected}"
            )
    if unchecked:
        log.info(
            "cleanup.policy and min.insync.replicas not checked (no DESCRIBE_CONFIGS for "
            "this client?): %s",
            "; ".join(unchecked),
        )
    _refuse_replication(refusals)
    if wrong:
        raise TopicSetupError(
            "; ".join(wrong) + ": a compacted events, incidents or DLQ topic keeps one "
            "record per key, and a state, terminal or catalogue topic without compact, or "
            "with delete and a retention.ms or retention.bytes other than -1, loses entries "
            "to retention; set it (kafka-configs.sh --alter --add-config "
            "cleanup.policy=...) or recreate the topic (docs/operating.md, Topics)"
        )


def topic_max_message_bytes(
    bootstrap: str | ClientConfig, topic: str, *, timeout_s: float = 30.0
) -> int | None:
    """The largest record batch ``topic`` takes: its ``max.message.bytes`` (its own,
    or the broker's ``message.max.bytes`` it inherits). None on the in-process
    transport, which has no such limit. Raises ``KafkaException`` when the broker does
    not answer or refuses to say (DESCRIBE_CONFIGS not granted on the topic)."""
    answer = topics_max_message_bytes(bootstrap, [topic], timeout_s=timeout_s)[topic]
    if isinstance(answer, KafkaException):
        raise answer
    return answer


def topics_max_message_bytes(
    bootstrap: str | ClientConfig, topics: Iterable[str], *, timeout_s: float = 30.0
) -> dict[str, int | KafkaException | None]:
    """``max.message.bytes`` of each of ``topics``, in one DescribeConfigs request: per
    topic its limit, None when it has none (the in-process transport), or the
    ``KafkaException`` that says why the broker did not tell (no answer,
    DESCRIBE_CONFIGS not granted on that topic)."""
    names = list(dict.fromkeys(topics))
    config = client_config(bootstrap)
    if _memory.is_memory(config.bootstrap):
        return dict.fromkeys(names)
    admin = create_admin(config)
    resources = {name: ConfigResource(ResourceType.TOPIC, name) for name in names}
    answers: dict[str, int | KafkaException | None] = {}
    try:
        futures = admin.describe_configs(list(resources.values()), request_timeout=timeout_s)
    except KafkaException as exc:
        return dict.fromkeys(names, exc)
    for name, resource in resources.items():
        try:
            entries = futures[resource].result(timeout=timeout_s)
        except KafkaException as exc:
            answers[name] = exc
            continue
        except TimeoutError as exc:
            answers[name] = KafkaException(KafkaError(KafkaError._TIMED_OUT, str(exc)))
            continue
        entry = entries.get("max.message.bytes")
        answers[name] = None if entry is None or entry.value is None else int(entry.value)
    return answers


def topic_retention(
    bootstrap: str | ClientConfig, topic: str, *, timeout_s: float = 30.0
) -> tuple[int, int] | None:
    """How long ``topic`` keeps a record at most past its timestamp, as the broker
    says: ``(retention.ms, segment.ms)``, each the topic's own or the broker default
    it inherits. ``retention.ms`` is -1 when nothing is ever deleted for its age (it
    is -1, or ``cleanup.policy`` has no ``delete``). Kafka deletes whole segments, and
    only once a segment's newest record is older than ``retention.ms``, so a record
    can outlive ``retention.ms`` by up to ``segment.ms``. None on the in-process
    transport (it never deletes, and has no such settings). Raises ``KafkaException``
    when the broker does not answer or refuses to say (DESCRIBE_CONFIGS not granted)."""
    config = client_config(bootstrap)
    if _memory.is_memory(config.bootstrap):
        return None
    admin = create_admin(config)
    resource = ConfigResource(ResourceType.TOPIC, topic)
    futures = admin.describe_configs([resource], request_timeout=timeout_s)
    try:
        entries = futures[resource].result(timeout=timeout_s)
    except TimeoutError as exc:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, str(exc))) from exc

    def value(name: str) -> str:
        entry = entries.get(name)
        if entry is None or entry.value is None:
            raise KafkaException(
                KafkaError(KafkaError._INVALID_ARG, f"{topic} does not report {name}")
            )
        return str(entry.value)

    policies = {p.strip() for p in value("cleanup.policy").split(",")}
    retention_ms = int(value("retention.ms")) if "delete" in policies else -1
    return (-1 if retention_ms < 0 else retention_ms), int(value("segment.ms"))

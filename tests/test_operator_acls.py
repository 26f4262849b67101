"""The operator commands on a broker that enforces ACLs.

A dedicated local broker (its own state dir, stopped at the end) runs KRaft's
``StandardAuthorizer`` behind a SASL listener; its PLAINTEXT listener is the super
user that sets the stage (topics, catalogue entries, a running participant's group
member, ACLs). The operator connects through SASL with exactly the grants
``docs/security.md`` lists for ``catalogue withdraw``, or all but one of them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)

from participants.published import entry_key, fold
from participants.readiness import coordinator_group, participant_group
from sagaline.kafka import (
    ClientConfig,
    LedgerReader,
    create_admin,
    create_consumer,
    create_producer,
    ensure_topics,
)
from schemas.settings import Settings
from services import kafka_local
from services.cli import main

# One worker of a parallel run takes the whole module: its fixture starts a broker.
pytestmark = [pytest.mark.kafka, pytest.mark.xdist_group("acl-broker")]


class AclBroker:
    def __init__(
        self, state: Path, superuser: ClientConfig, sasl: kafka_local.SaslListener
    ) -> None:
        self.state = state
        self.superuser = superuser  # PLAINTEXT: User:ANONYMOUS, the super user
        self.sasl = sasl

    def grant(self, principal: str, *grants: tuple[ResourceType, str, AclOperation]) -> None:
        bindings = [
            AclBinding(
                kind,
                name,
                ResourcePatternType.PREFIXED if name.endswith("-") else ResourcePatternType.LITERAL,
                f"User:{principal}",
                "*",
                operation,
                AclPermissionType.ALLOW,
            )
            for kind, name, operation in grants
        ]
        admin = create_admin(self.superuser)  # kept alive until the futures resolve
        for done in admin.create_acls(bindings).values():
            done.result()


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclBroker]:
    # Its ports are picked free and bound by the JVM seconds later: on a busy machine
    # another process can take one meanwhile (PortInUseError, seen in a CI run beside
    # two CPU hogs). A fresh state dir picks other ports.
    for attempt in range(3):
        state = tmp_path_factory.mktemp("acl-broker")
        try:
            up = kafka_local.ensure_running(state, sasl=True, acls=True)
            break
        except kafka_local.ToolMissingError as missing:
            pytest.skip(f"no Java/Maven for a second local broker: {missing}")
        except kafka_local.PortInUseError:
            if attempt == 2:
                raise
    listener = kafka_local.sasl_listener(state)
    assert listener is not None
    try:
        yield AclBroker(state, ClientConfig(up.bootstrap), listener)
    finally:
        kafka_local.down(state)


def _entry(participant: str, tool: str) -> bytes:
    contract = {"tool": tool, "participant": participant, "reversibility": "REVERSIBLE"}
    return orjson.dumps({"participant": participant, "contract": contract, "secret_paths": []})


def _published(superuser: ClientConfig, topic: str) -> list[str]:
    current = fold((k, v) for k, v, _h in LedgerReader(superuser).records(topic))
    return sorted(current.tools)


def test_withdraw_refuses_when_the_operator_cannot_see_the_participants_group(
    acl_broker: AclBroker,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    superuser = acl_broker.superuser
    settings = Settings(bootstrap=superuser.bootstrap, topic_prefix=unique_prefix, partitions=1)
    topic = settings.topics.catalogue
    ensure_topics(superuser, settings.topics, [], 1)
    producer = create_producer(superuser)
    for tool in ("hold", "audit"):
        producer.produce(topic, key=entry_key("legacy", tool), value=_entry("legacy", tool))
    assert producer.flush(30) == 0
    group = participant_group(settings, "legacy")
    # What docs/security.md lists for `catalogue withdraw`, except Describe on the
    # participant's group.
    acl_broker.grant(
        "operator",
        (ResourceType.TOPIC, topic, AclOperation.READ),
        (ResourceType.TOPIC, topic, AclOperation.WRITE),
        (ResourceType.GROUP, "sagaline-reader-", AclOperation.READ),
    )
    for var in [v for v in os.environ if v.startswith("SAGALINE_KAFKA_")]:
        monkeypatch.delenv(var)
    for name, value in acl_broker.sasl.client_env("operator").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)

    # The participant still runs: its group has a member (the super user's consumer).
    running = create_consumer(superuser, group)
    try:
        running.subscribe([topic])
        for _ in range(600):  # a bound on polls, not a deadline
            running.poll(0.5)
            if running.assignment():
                break
        assert running.assignment()

        # The broker hides the group from the operator: refused, not read as stopped.
        assert main(["catalogue", "withdraw", "legacy"]) == 2
        err = capsys.readouterr().err
        assert f"Describe on group {group}" in err and "nothing withdrawn" in err
        assert _published(superuser, topic) == ["audit", "hold"]

        # With the grant, the operator sees the participant running.
        acl_broker.grant("operator", (ResourceType.GROUP, group, AclOperation.DESCRIBE))
        assert main(["catalogue", "withdraw", "legacy"]) == 1
        assert "is consuming" in capsys.readouterr().err
        assert _published(superuser, topic) == ["audit", "hold"]
    finally:
        running.close()  # leaves the group at once

    # Stopped: those grants are all withdraw needs.
    assert main(["catalogue", "withdraw", "legacy"]) == 0
    assert "withdrew legacy/audit" in capsys.readouterr().out
    assert _published(superuser, topic) == []


def _joined(superuser: ClientConfig, group: str, topic: str) -> Consumer:
    """A member of ``group`` (a running process, as the broker sees it)."""
    consumer = create_consumer(superuser, group)
    consumer.subscribe([topic])
    for _ in range(600):  # a bound on polls, not a deadline
        consumer.poll(0.5)
        if consumer.assignment():
            return consumer
    consumer.close()
    raise AssertionError(f"{group} was never assigned {topic}")


def test_status_says_which_group_it_may_not_see_instead_of_not_consuming(
    acl_broker: AclBroker,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    superuser = acl_broker.superuser
    settings = Settings(bootstrap=superuser.bootstrap, topic_prefix=unique_prefix, partitions=1)
    topic = settings.topics.catalogue
    ensure_topics(superuser, settings.topics, [], 1)
    producer = create_producer(superuser)
    producer.produce(topic, key=entry_key("payments", "pay"), value=_entry("payments", "pay"))
    assert producer.flush(30) == 0
    coordinator, payments = coordinator_group(settings), participant_group(settings, "payments")
    # `sagaline status` as docs/security.md lists it, except Describe on the
    # participant's group.
    acl_broker.grant(
        "agent",
        (ResourceType.TOPIC, topic, AclOperation.READ),
        (ResourceType.GROUP, "sagaline-reader-", AclOperation.READ),
        (ResourceType.GROUP, coordinator, AclOperation.DESCRIBE),
    )
    for var in [v for v in os.environ if v.startswith("SAGALINE_KAFKA_")]:
        monkeypatch.delenv(var)
    for name, value in acl_broker.sasl.client_env("agent").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)

    running = [_joined(superuser, g, topic) for g in (coordinator, payments)]
    try:
        # Both run; the one it may not see is not reported as stopped.
        assert main(["status"]) == 2
        out = capsys.readouterr().out
        assert re.search(r"coordinator +consuming", out), out
        assert re.search(rf"participant payments +UNKNOWN .*Describe on group {payments}", out)
        assert main(["status", "--json"]) == 2
        rows = {row["role"]: row for row in json.loads(capsys.readouterr().out)}
        assert rows["participant payments"]["consuming"] is None
        assert rows["coordinator"]["consuming"] is True

        acl_broker.grant("agent", (ResourceType.GROUP, payments, AclOperation.DESCRIBE))
        assert main(["status"]) == 0
        assert re.search(r"participant payments +consuming", capsys.readouterr().out)
    finally:
        for consumer in running:
            consumer.close()


def test_a_catalogue_the_operator_may_not_read_is_not_taken_for_an_empty_one(
    acl_broker: AclBroker,
    unique_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    superuser = acl_broker.superuser
    settings = Settings(bootstrap=superuser.bootstrap, topic_prefix=unique_prefix, partitions=1)
    topic = settings.topics.catalogue
    ensure_topics(superuser, settings.topics, [], 1)
    producer = create_producer(superuser)
    producer.produce(topic, key=entry_key("payments", "pay"), value=_entry("payments", "pay"))
    assert producer.flush(30) == 0
    coordinator = coordinator_group(settings)
    # A principal with everything `status` needs but Read on the catalogue topic.
    acl_broker.grant(
        "participant",
        (ResourceType.GROUP, "sagaline-reader-", AclOperation.READ),
        (ResourceType.GROUP, coordinator, AclOperation.DESCRIBE),
        (ResourceType.GROUP, "sagaline-participant-", AclOperation.DESCRIBE),
    )
    for var in [v for v in os.environ if v.startswith("SAGALINE_KAFKA_")]:
        monkeypatch.delenv(var)
    for name, value in acl_broker.sasl.client_env("participant").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)

    running = _joined(superuser, coordinator, topic)  # the coordinator runs; payments not
    try:
        # Not "every process consumes" from the coordinator alone: payments is down.
        assert main(["status"]) == 2
        err = capsys.readouterr().err
        assert f"not authorized to describe topic {topic!r}" in err, err
        # Not "nothing is published" (exit 1, as if already withdrawn).
        assert main(["catalogue", "withdraw", "payments"]) == 2
        err = capsys.readouterr().err
        assert f"not authorized to describe topic {topic!r}" in err, err
    finally:
        running.close()
    assert _published(superuser, topic) == ["pay"]


def test_a_broker_enforcing_acls_is_not_reused_as_an_open_one(acl_broker: AclBroker) -> None:
    with pytest.raises(kafka_local.KafkaLauncherError, match="with an ACL authorizer"):
        kafka_local.ensure_running(acl_broker.state, sasl=True)

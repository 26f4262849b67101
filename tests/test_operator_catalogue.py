"""What an operator sees of, and does to, the published catalogue (``sagaline.catalogue``):
``sagaline status`` names the participants that still publish tools, and ``sagaline
catalogue withdraw`` takes a retired participant's tools out of it."""

from __future__ import annotations

import re

import orjson
import pytest

from participants.published import entry_key, fold
from participants.readiness import participant_group
from sagaline.kafka import LedgerReader, create_consumer, create_producer, ensure_topics
from schemas.settings import Settings
from services.cli import main

pytestmark = pytest.mark.kafka


def _entry(participant: str, tool: str) -> bytes:
    contract = {
        "tool": tool,
        "participant": participant,
        "reversibility": "REVERSIBLE",
    }
    return orjson.dumps({"participant": participant, "contract": contract, "secret_paths": []})


def _publish(bootstrap: str, topic: str, *records: tuple[bytes, bytes | None]) -> None:
    producer = create_producer(bootstrap)
    for key, value in records:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


@pytest.fixture
def deployment(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_PARTITIONS", "1")
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], 1)
    return settings


def _published(settings: Settings) -> dict[str, list[str]]:
    reader = LedgerReader(settings.bootstrap or "")
    current = fold((k, v) for k, v, _h in reader.records(settings.topics.catalogue))
    return {tool: current.owners(tool) for tool in sorted(current.tools)}


def test_status_leaves_out_a_participant_whose_tools_were_withdrawn(
    deployment: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = deployment.topics.catalogue
    bootstrap = deployment.bootstrap or ""
    _publish(
        bootstrap,
        topic,
        (b"hold", _entry("legacy", "hold")),
        (entry_key("legacy", "hold"), _entry("legacy", "hold")),
        (b"pay", _entry("payments", "pay")),
        (entry_key("payments", "pay"), _entry("payments", "pay")),
        # legacy was retired: both of its keys tombstoned
        (b"hold", None),
        (entry_key("legacy", "hold"), None),
    )
    assert main(["status"]) == 1  # nothing runs here
    out = capsys.readouterr().out
    assert re.search(r"participant payments +NOT consuming", out)
    assert "legacy" not in out


def test_catalogue_withdraw_takes_a_retired_participants_tools_out(
    deployment: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = deployment.topics.catalogue
    bootstrap = deployment.bootstrap or ""
    _publish(
        bootstrap,
        topic,
        (b"hold", _entry("legacy", "hold")),
        (entry_key("legacy", "hold"), _entry("legacy", "hold")),
        (entry_key("legacy", "audit"), _entry("legacy", "audit")),
        (b"pay", _entry("payments", "pay")),
        (entry_key("payments", "pay"), _entry("payments", "pay")),
    )
    # A tool it never published: one line, exit 1, nothing written.
    assert main(["catalogue", "withdraw", "legacy", "--tool", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and "audit, hold" in err
    assert _published(deployment) == {"audit": ["legacy"], "hold": ["legacy"], "pay": ["payments"]}

    assert main(["catalogue", "withdraw", "legacy", "--tool", "audit"]) == 0
    assert _published(deployment) == {"hold": ["legacy"], "pay": ["payments"]}

    # Still consuming: refused, nothing written.
    consumer = create_consumer(bootstrap, participant_group(deployment, "legacy"))
    try:
        consumer.subscribe([topic])
        for _ in range(600):  # a bound on polls, not a deadline
            consumer.poll(0.5)
            if consumer.assignment():
                break
        assert consumer.assignment()
        assert main(["catalogue", "withdraw", "legacy"]) == 1
        assert "is consuming" in capsys.readouterr().err
        assert _published(deployment) == {"hold": ["legacy"], "pay": ["payments"]}
    finally:
        consumer.close()

    assert main(["catalogue", "withdraw", "legacy"]) == 0
    assert "withdrew legacy/hold" in capsys.readouterr().out
    assert _published(deployment) == {"pay": ["payments"]}
    assert main(["catalogue", "withdraw", "legacy"]) == 1  # nothing left to withdraw
    assert "publishes no tools" in capsys.readouterr().err
    assert main(["status"]) == 1
    assert "legacy" not in capsys.readouterr().out


def test_withdraw_of_one_tool_leaves_an_entry_this_version_cannot_read(
    deployment: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newer participant version's entry (a contract field this CLI does not know)
    is still that participant's tool: withdrawn only when named, or with all of them."""
    topic = deployment.topics.catalogue
    bootstrap = deployment.bootstrap or ""
    newer = orjson.loads(_entry("legacy", "refund"))
    newer["contract"]["field_of_a_later_version"] = 1
    _publish(
        bootstrap,
        topic,
        (entry_key("legacy", "audit"), _entry("legacy", "audit")),
        (entry_key("legacy", "refund"), orjson.dumps(newer)),
    )
    assert main(["catalogue", "withdraw", "legacy", "--tool", "audit"]) == 0
    assert capsys.readouterr().out.splitlines() == ["withdrew legacy/audit"]
    assert _latest(deployment) == {"legacy/audit": False, "legacy/refund": True}

    assert main(["catalogue", "withdraw", "legacy", "--tool", "refund"]) == 0
    assert capsys.readouterr().out.splitlines() == ["withdrew legacy/refund"]
    assert _latest(deployment) == {"legacy/audit": False, "legacy/refund": False}


def _latest(settings: Settings) -> dict[str, bool]:
    """Every key of the catalogue topic: whether it is live."""
    reader = LedgerReader(settings.bootstrap or "")
    current = fold((k, v) for k, v, _h in reader.records(settings.topics.catalogue))
    return {key: value is not None for key, value in sorted(current.latest.items())}


def test_withdraw_takes_out_the_bare_key_of_an_entry_this_version_cannot_read(
    deployment: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tool-name key (read by agents of earlier versions) that names the retired
    participant is tombstoned with its ``participant/tool`` key even when its contract
    is one this CLI cannot read: left live, those agents kept calling the retired
    participant's tool."""
    topic = deployment.topics.catalogue
    bootstrap = deployment.bootstrap or ""
    newer = orjson.loads(_entry("legacy", "refund"))
    newer["contract"]["field_of_a_later_version"] = 1
    body = orjson.dumps(newer)
    _publish(bootstrap, topic, (b"refund", body), (entry_key("legacy", "refund"), body))
    assert main(["catalogue", "withdraw", "legacy"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "withdrew legacy/refund" in out
    assert "withdrew refund (the key agents of earlier versions read)" in out
    assert _latest(deployment) == {"legacy/refund": False, "refund": False}

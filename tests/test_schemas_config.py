"""Topic names, settings and the Kafka message mapping, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from sagaline.kafka import consumer_config, producer_config
from schemas.errors import MalformedRecord
from schemas.examples import example_records
from schemas.settings import Settings, SettingsError
from schemas.signing import Signer
from schemas.topics import TopicNames, topic_specs
from schemas.wire import dlq_message, from_message, read_dead_letter, to_message


def test_topic_names_follow_the_architecture_table() -> None:
    names = TopicNames()
    assert names.events == "sagaline.events"
    assert names.state == "sagaline.coordinator.state"
    assert names.terminal == "sagaline.terminal"
    assert names.incidents == "sagaline.incidents"
    assert names.dlq == "sagaline.dlq"
    assert names.commands("payments") == "sagaline.commands.payments"


def test_prefix_isolates_every_topic() -> None:
    names = TopicNames("t1.")
    specs = topic_specs(names, ["payments"])
    assert all(s.name.startswith("t1.sagaline.") for s in specs)


def test_co_partitioned_topics_share_one_partition_count() -> None:
    specs = topic_specs(TopicNames(), ["payments", "mail"], partitions=4)
    co = {s.name: s.partitions for s in specs if s.co_partitioned}
    assert set(co) == {
        "sagaline.events",
        "sagaline.coordinator.state",
        "sagaline.terminal",
        "sagaline.incidents",
        "sagaline.commands.payments",
        "sagaline.commands.mail",
    }
    assert set(co.values()) == {4}


def test_state_and_terminal_are_compacted_and_the_rest_delete() -> None:
    policies = {s.name: s.config["cleanup.policy"] for s in topic_specs(TopicNames(), ["p"])}
    assert policies.pop("sagaline.catalogue", "compact") == "compact"
    assert policies == {
        "sagaline.events": "delete",
        "sagaline.coordinator.state": "compact",
        "sagaline.terminal": "compact",
        "sagaline.incidents": "delete",
        "sagaline.dlq": "delete",
        "sagaline.commands.p": "delete",
    }


def test_unusable_participant_name_is_refused() -> None:
    with pytest.raises(ValueError, match="participant name"):
        TopicNames().commands("a/b")


def test_a_prefix_that_makes_a_command_topic_unusable_is_named_not_the_participant() -> None:
    """A long SAGALINE_TOPIC_PREFIX pushed the command topic past Kafka's 249
    characters and the error said the participant's name ('refunds') was unusable."""
    long_prefix = "p" * 230 + "."
    with pytest.raises(ValueError) as raised:
        TopicNames(long_prefix).commands("refunds")
    text = str(raised.value)
    assert "SAGALINE_TOPIC_PREFIX" in text and "249" in text, text
    assert "participant name 'refunds' is not usable" not in text, text
    with pytest.raises(ValueError, match="SAGALINE_TOPIC_PREFIX"):
        TopicNames("team a.").commands("refunds")  # a space: no topic name holds one
    with pytest.raises(ValueError, match="participant name 'a/b'"):
        TopicNames(long_prefix).commands("a/b")  # the name is unusable whatever the prefix


def test_settings_defaults_run_the_demo() -> None:
    settings = Settings.from_env({})
    assert settings == Settings(
        bootstrap=None,
        topic_prefix="",
        partitions=6,
        hmac_key=None,
        tenant_id="default",
        state_dir=Path(".sagaline"),
    )
    assert not settings.signer().enabled


def test_settings_read_sagaline_variables() -> None:
    settings = Settings.from_env(
        {
            "KAFKA_BOOTSTRAP_SERVERS": "k:9092",
            "SAGALINE_TOPIC_PREFIX": "x.",
            "SAGALINE_PARTITIONS": "3",
            "SAGALINE_HMAC_KEY": "secret",
            "SAGALINE_TENANT_ID": "acme",
            "SAGALINE_STATE_DIR": "/var/lib/sagaline",
        }
    )
    assert settings.bootstrap == "k:9092"
    assert settings.topics.events == "x.sagaline.events"
    assert settings.partitions == 3
    assert settings.hmac_key == b"secret"
    assert settings.signer().enabled
    assert settings.tenant_id == "acme"
    assert settings.state_dir == Path("/var/lib/sagaline")


@pytest.mark.parametrize("value", ["six", "0"])
def test_bad_partition_count_is_a_settings_error_naming_the_variable(value: str) -> None:
    with pytest.raises(SettingsError, match="SAGALINE_PARTITIONS"):
        Settings.from_env({"SAGALINE_PARTITIONS": value})


def test_producer_config_co_partitions_and_is_idempotent() -> None:
    config = producer_config("k:1", **{"linger.ms": 0})
    assert config["partitioner"] == "murmur2_random"
    assert config["enable.idempotence"] is True
    assert config["acks"] == "all"
    assert config["linger.ms"] == 0


def test_consumer_config_commits_manually_and_reads_committed() -> None:
    config = consumer_config("k:1", "g")
    assert config["enable.auto.commit"] is False
    assert config["isolation.level"] == "read_committed"
    assert config["auto.offset.reset"] == "earliest"


def test_message_is_keyed_by_saga_id() -> None:
    record = example_records(saga_id="saga-k")[0]
    key, _value, headers = to_message(record, Signer(None))
    assert key == b"saga-k"
    assert headers == []


def test_message_keyed_by_another_saga_is_refused() -> None:
    record = example_records(saga_id="saga-k")[0]
    _key, value, headers = to_message(record, Signer(None))
    with pytest.raises(MalformedRecord, match="keyed b'saga-x'"):
        from_message(b"saga-x", value, headers, Signer(None))


def test_message_without_a_key_is_refused() -> None:
    """A record produced with no key lands on a random partition, away from the rest
    of its saga (the coordinator owning that partition decides it against no state,
    or starts the saga there): as malformed as one keyed by another saga."""
    record = example_records(saga_id="saga-k")[0]
    _key, value, _headers = to_message(record, Signer(None))
    with pytest.raises(MalformedRecord, match="no key"):
        from_message(None, value, [], Signer(None))


def test_tombstone_on_a_record_topic_is_malformed() -> None:
    with pytest.raises(MalformedRecord, match="no value"):
        from_message(b"k", None, None, Signer(None))


def test_dlq_message_keeps_key_value_and_headers_byte_for_byte_and_adds_the_reason() -> None:
    headers = [("sagaline-sig", b"abcd"), ("trace", b"t-1")]
    key, value, out = dlq_message(
        b"saga-1", b"\xc3\x01junk", headers, "malformed", "bad magic", "sagaline.events", 2, 41
    )
    assert (key, value) == (b"saga-1", b"\xc3\x01junk")
    assert out[:2] == headers
    letter = read_dead_letter(out)
    assert (letter.reason, letter.detail, letter.source_topic, letter.partition, letter.offset) == (
        "malformed",
        "bad magic",
        "sagaline.events",
        2,
        41,
    )


@pytest.mark.parametrize(
    ("header", "value"), [("sagaline-dlq-partition", b"two"), ("sagaline-dlq-offset", b"")]
)
def test_a_dlq_record_with_an_unreadable_header_is_malformed(header: str, value: bytes) -> None:
    """read_dead_letter raised ValueError (int('two')), not the CodecError its caller
    catches: one such record on the DLQ under the saga's key ended
    `sagaline approve --wait` in a traceback instead of being passed over."""
    _key, _value, out = dlq_message(b"s", b"v", None, "malformed", "x", "sagaline.events", 2, 41)
    out = [(name, v) for name, v in out if name != header] + [(header, value)]
    with pytest.raises(MalformedRecord, match=header):
        read_dead_letter(out)


def test_a_dlq_omitted_header_that_is_not_utf8_is_read_like_the_other_texts() -> None:
    """It raised UnicodeDecodeError (the detail and reason are read with replacement)."""
    _key, _value, out = dlq_message(b"s", b"v", None, "malformed", "x", "sagaline.events", 2, 41)
    out.append(("sagaline-dlq-omitted", b"too large \xff"))
    assert read_dead_letter(out).omitted == "too large \ufffd"


def test_env_vars_lists_exactly_what_from_env_reads() -> None:
    """ENV_VARS is the documented list; a variable outside it changes nothing."""
    from schemas.limits import MIN_RECORD_BYTES
    from schemas.settings import ENV_VARS

    shaped = {
        "SAGALINE_OLD_SECRET_KEYS": "s0=7",  # id=secret pairs
        "SAGALINE_MAX_RECORD_BYTES": str(MIN_RECORD_BYTES + 7),  # has a floor
    }
    every = {name: "1" for name in ENV_VARS} | {"SAGALINE_TOPIC_PREFIX": "p."} | shaped
    assert Settings.from_env(every) != Settings.from_env({})
    for name in ENV_VARS:
        # min.insync.replicas 7 needs 7 replicas to be valid at all.
        base = {"SAGALINE_REPLICATION_FACTOR": "7"} if "MIN_INSYNC" in name else {}
        if name.startswith("SAGALINE_SIGNING_KEY"):  # only with a trust file
            base = {"SAGALINE_TRUST_FILE": "trust.json"}
        if name in ("SAGALINE_SECRET_KEY_ID", "SAGALINE_OLD_SECRET_KEYS"):  # only with a key
            base = {"SAGALINE_SECRET_KEY": "secret"}
        if name == "SAGALINE_HMAC_KEY_ID":
            base = {"SAGALINE_HMAC_KEY": "key"}
        value = shaped.get(name, "7")
        assert Settings.from_env({**base, name: value}) != Settings.from_env(base), name
    assert Settings.from_env({"SAGALINE_NOT_A_SETTING": "x"}) == Settings.from_env({})


def test_public_surface_resolves_and_includes_the_wire_api() -> None:
    import schemas

    missing = [name for name in schemas.__all__ if not hasattr(schemas, name)]
    assert missing == []
    for name in ("encode", "decode", "Signer", "Settings", "TopicNames", "to_message"):
        assert name in schemas.__all__

"""The published catalogue as an agent sees it, on the real broker (R7).

Participants publish each tool's contract on the compacted ``sagaline.catalogue``,
keyed by tool name. Until compaction runs (segments roll daily) the topic holds every
version a participant ever published, so a client must take the *latest* one: the
coordinator decides from the contract the client snapshots into ``StepScheduled``, and
a tool that became IRREVERSIBLE must not run without approval because an agent read
its first declaration.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from participants import Reversibility, compensable, tool, wrap
from participants.client import AmbiguousTool, SagaClient, UnknownTool
from participants.published import entry_key
from participants.runtime import ParticipantRuntime
from sagaline.kafka import LedgerWriter, ensure_topics
from schemas.settings import Settings

pytestmark = pytest.mark.kafka


class MailerV1:
    @tool(description="Send a message")
    @compensable(by="retract")
    def send(self, to: str) -> str:
        return f"msg-{to}"

    def retract(self) -> None:
        return None


class MailerV2:
    """The same tool, redeclared: a sent message can no longer be taken back."""

    @tool(description="Send a message")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send(self, to: str) -> str:
        return f"msg-{to}"


@pytest.fixture
def settings(kafka_bootstrap: str, unique_prefix: str, tmp_path: Path) -> Settings:
    settings = Settings(
        bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1, state_dir=tmp_path
    )
    ensure_topics(kafka_bootstrap, settings.topics, ["mailer"], 1)
    return settings


def publish(settings: Settings, participant: object, name: str = "mailer") -> None:
    """What a participant runtime does as it starts: publish its catalogue."""
    runtime = ParticipantRuntime(
        wrap(participant, name=name),
        settings,
        settings.bootstrap,
        state_dir=settings.state_dir / f"{name}-{type(participant).__name__}",
    )
    runtime.publish_catalogue()
    runtime.journal.close()


@pytest.fixture
def clients(settings: Settings) -> Iterator[list[SagaClient]]:
    made: list[SagaClient] = []
    yield made
    for client in made:
        client.close()


def new_client(settings: Settings, made: list[SagaClient], **kwargs: object) -> SagaClient:
    client = SagaClient(settings, settings.bootstrap, **kwargs)  # type: ignore[arg-type]
    made.append(client)
    return client


def test_a_catalogue_topic_has_one_partition_so_offsets_order_its_versions(
    settings: Settings,
) -> None:
    """'Latest' is offset order, which is only a total order on one partition."""
    from sagaline.kafka import LedgerReader

    assert LedgerReader(settings.bootstrap).partition_count(settings.topics.catalogue) == 1


def test_a_republished_contract_is_seen_new_by_a_new_client_R7(
    settings: Settings, clients: list[SagaClient]
) -> None:
    publish(settings, MailerV1())
    publish(settings, MailerV2())

    contract = new_client(settings, clients).contract("send")

    assert contract.reversibility is Reversibility.IRREVERSIBLE, (
        f"a new client took the first published contract of 'send' "
        f"({contract.reversibility.value}), not the latest (IRREVERSIBLE)"
    )
    assert contract.compensation is None


def test_a_running_client_takes_the_new_contract_on_refresh_R7(
    settings: Settings, clients: list[SagaClient]
) -> None:
    publish(settings, MailerV1())
    client = new_client(settings, clients)
    assert client.contract("send").reversibility is Reversibility.COMPENSATABLE

    publish(settings, MailerV2())
    client.refresh_catalogue()

    assert client.contract("send").reversibility is Reversibility.IRREVERSIBLE


def test_a_running_client_rereads_a_cached_contract_older_than_its_bound_R7(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """No explicit refresh: an entry older than ``catalogue_max_age_s`` (0 here, so
    every one) is read again before a step is scheduled with it."""
    publish(settings, MailerV1())
    client = new_client(settings, clients, catalogue_max_age_s=0.0)
    assert client.contract("send").reversibility is Reversibility.COMPENSATABLE

    publish(settings, MailerV2())

    assert client.contract("send").reversibility is Reversibility.IRREVERSIBLE


def test_a_tombstone_removes_the_tool(settings: Settings, clients: list[SagaClient]) -> None:
    publish(settings, MailerV1())
    client = new_client(settings, clients)
    assert client.contract("send").tool == "send"

    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        writer.write(settings.topics.catalogue, entry_key("mailer", "send"), None)
    finally:
        writer.close()
    client.refresh_catalogue()

    with pytest.raises(UnknownTool, match="'send'"):
        client.contract("send")
    with pytest.raises(UnknownTool, match="'send'"):
        new_client(settings, clients).contract("send")


def test_a_local_catalogue_takes_precedence_over_the_published_one(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """As documented: the client runs a local tool itself, so its own declaration is
    the one that applies, whatever another process published under the name."""
    publish(settings, MailerV2())
    client = new_client(
        settings, clients, catalogues=[wrap(MailerV1(), name="mailer")], catalogue_max_age_s=0.0
    )
    client.refresh_catalogue()

    assert client.contract("send").reversibility is Reversibility.COMPENSATABLE


class CountingMailerV2(MailerV2):
    def __init__(self) -> None:
        self.sent: list[str] = []

    @tool(description="Send a message")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send(self, to: str) -> str:
        self.sent.append(to)
        return f"msg-{to}"


def test_a_participant_refuses_its_irreversible_tool_scheduled_with_an_outdated_contract_R7(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """An agent read ``send`` as COMPENSATABLE; the participant now declares it
    IRREVERSIBLE. The step reaches it without an approval: it must not run (R7), it
    is a business rejection that says why, and the agent's next read takes the new
    contract."""
    from participants.client import BusinessRejected
    from tests.system import System

    mailer = CountingMailerV2()
    system = System(kafka_bootstrap, unique_prefix, tmp_path, [wrap(mailer, name="mailer")])
    publish(system.settings, MailerV1())  # what the agent reads: the old declaration
    agent = SagaClient(
        system.settings, kafka_bootstrap, call_timeout_s=60, catalogue_max_age_s=3600.0
    )
    assert agent.contract("send").reversibility is Reversibility.COMPENSATABLE
    with system:  # the participant starts and publishes the new declaration
        system.client.close()
        system.client = agent.start()
        with pytest.raises(BusinessRejected) as refused, agent.saga("notify", "agent:t") as saga:
            saga.call("send", to="ops@example.com")

        assert mailer.sent == [], "an IRREVERSIBLE tool ran without approval (R7)"
        assert "IRREVERSIBLE" in str(refused.value) and "approval" in str(refused.value)
        receipt = saga.wait(60)
        assert receipt.status.value != "COMPLETED"
        assert agent.contract("send").reversibility is Reversibility.IRREVERSIBLE


class Notifier:
    """Another participant that declares a tool named ``send`` too."""

    @tool(description="Send a notification")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send(self, to: str) -> str:
        return f"note-{to}"


class Pinger:
    @tool(description="Ping", read_only=True)
    def ping(self) -> str:
        return "pong"


def test_a_tool_name_two_participants_publish_is_refused_naming_both(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """Not whichever restarted last (before compaction: first; after: last): a call by
    name cannot say which one runs it, so the client schedules nothing."""
    publish(settings, MailerV1(), "mailer")
    publish(settings, Notifier(), "notifier")
    publish(settings, MailerV1(), "mailer")  # a restart changes nothing

    for client in (new_client(settings, clients), new_client(settings, clients)):
        with pytest.raises(AmbiguousTool, match="'mailer', 'notifier'") as refused:
            client.contract("send")
        assert refused.value.participants == ["mailer", "notifier"]


def test_a_misspelled_tool_name_is_refused_with_the_close_name_and_how_to_serve_a_tool(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """An agent's typo (`sned`) says what it probably meant, and, were it a tool of its
    own, the public way to make one known: pass it to `sagaline.connect(...)`."""
    publish(settings, MailerV1())
    with pytest.raises(UnknownTool) as raised:
        new_client(settings, clients).contract("sned")
    message = str(raised.value)
    assert message.startswith("no participant declares a tool named 'sned'")
    assert "did you mean 'send'?" in message
    assert "sagaline.connect(sned, ...)" in message
    assert "sagaline participant run" in message
    assert "local=" not in message  # a SagaClient argument, not the public way


def test_an_unknown_tool_name_with_no_close_one_lists_the_known_tools(
    settings: Settings, clients: list[SagaClient]
) -> None:
    publish(settings, MailerV1())
    with pytest.raises(UnknownTool) as raised:
        new_client(settings, clients).contract("teleport")
    message = str(raised.value)
    assert "did you mean" not in message
    assert "known tools: 'send'" in message
    assert "sagaline.connect(teleport, ...)" in message


def test_a_tool_moved_to_another_participant_is_not_ambiguous(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """The participant that stops serving a tool withdraws it as it starts."""
    publish(settings, MailerV1(), "mailer")
    publish(settings, Pinger(), "mailer")  # redeployed without send
    assert isinstance(new_client(settings, clients).contract("ping").read_only, bool)
    with pytest.raises(UnknownTool):
        new_client(settings, clients).contract("send")

    publish(settings, Notifier(), "notifier")

    contract = new_client(settings, clients).contract("send")
    assert contract.participant == "notifier"
    assert contract.reversibility is Reversibility.IRREVERSIBLE


def test_an_entry_keyed_by_tool_name_from_an_earlier_version_is_still_read(
    settings: Settings, clients: list[SagaClient]
) -> None:
    contract = wrap(MailerV1(), name="old_mailer")["send"].contract("old_mailer")
    body = orjson.dumps({"participant": "old_mailer", "contract": contract.model_dump(mode="json")})
    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        writer.write(settings.topics.catalogue, b"send", body)
    finally:
        writer.close()

    assert new_client(settings, clients).contract("send").participant == "old_mailer"


def test_two_given_catalogues_declaring_one_tool_name_are_refused(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """As the plan check's AMBIGUOUS_TOOL: the later catalogue silently won before."""
    client = new_client(
        settings,
        clients,
        catalogues=[wrap(MailerV1(), name="mailer"), wrap(Notifier(), name="notifier")],
    )

    with pytest.raises(AmbiguousTool, match="'mailer', 'notifier'"):
        client.contract("send")


def test_a_tool_whose_latest_entry_cannot_be_read_is_refused_not_taken_from_an_older_one(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """Nor from another participant's entry: the unreadable one may be a second
    declaration of the name."""
    publish(settings, Notifier(), "notifier")
    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        writer.write(settings.topics.catalogue, entry_key("mailer", "send"), b"{not json")
    finally:
        writer.close()

    with pytest.raises(UnknownTool, match="cannot be read"):
        new_client(settings, clients).contract("send")


def test_an_entry_whose_secret_paths_are_not_a_list_of_names_is_refused(
    settings: Settings, clients: list[SagaClient]
) -> None:
    """``"secret_paths": "to"`` was read as the paths 't' and 'o', so the argument
    ``to`` it declares secret would reach the ledger in clear; a list holding a
    non-name failed every call of the tool. Such an entry cannot be read: refused."""
    contract = wrap(MailerV1(), name="mailer")["send"].contract("mailer")
    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        for paths in ("to", [1]):
            body = orjson.dumps(
                {
                    "participant": "mailer",
                    "contract": contract.model_dump(mode="json"),
                    "secret_paths": paths,
                }
            )
            writer.write(settings.topics.catalogue, entry_key("mailer", "send"), body)
            with pytest.raises(UnknownTool, match="cannot be read"):
                new_client(settings, clients).contract("send")
    finally:
        writer.close()


@pytest.mark.parametrize(("field", "value"), [("tool", "refund"), ("participant", "payments")])
def test_an_entry_whose_contract_names_another_tool_or_participant_is_refused(
    settings: Settings, clients: list[SagaClient], field: str, value: str
) -> None:
    """Under ``mailer/send`` a contract of tool ``refund`` (or of participant
    ``payments``) was taken as ``send``'s: a call of ``send`` was scheduled as that
    contract's tool, on that contract's participant. Only the entry's top-level
    participant was compared with its key (and, with identities, its signature)."""
    contract = wrap(MailerV1(), name="mailer")["send"].contract("mailer").model_dump(mode="json")
    contract[field] = value
    body = orjson.dumps({"participant": "mailer", "contract": contract, "secret_paths": []})
    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        writer.write(settings.topics.catalogue, entry_key("mailer", "send"), body)
    finally:
        writer.close()

    with pytest.raises(UnknownTool, match="cannot be read"):
        new_client(settings, clients).contract("send")


def test_a_participant_that_cannot_read_the_catalogue_still_publishes(
    settings: Settings, clients: list[SagaClient], caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment whose ACLs grant the participant Write but not Read on the topic
    (as docs/security.md did) must not stop it from starting."""

    class NoRead:
        def records(self, topic: str) -> Iterator[tuple[bytes, bytes, None]]:
            raise PermissionError(f"TOPIC_AUTHORIZATION_FAILED: {topic}")

    runtime = ParticipantRuntime(
        wrap(MailerV2(), name="mailer"), settings, settings.bootstrap, state_dir=settings.state_dir
    )
    runtime._reader = NoRead()  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="sagaline.participant"):
        runtime.publish_catalogue()
    runtime.journal.close()

    assert "grant this participant Read" in caplog.text
    assert new_client(settings, clients).contract("send").participant == "mailer"


def test_an_unreadable_entry_older_than_a_readable_declaration_is_skipped_saying_so(
    settings: Settings, clients: list[SagaClient], caplog: pytest.LogCaptureFixture
) -> None:
    """A stale key (a participant that no longer exists left an entry this version
    cannot read) refused the tool for good, though its participant had published it
    since; it is now skipped with a warning naming the key. An unreadable entry
    published after the readable one may be a redeclaration (or the tool moved to
    another participant), so it is still refused."""
    writer = LedgerWriter(settings.bootstrap, settings.topics, settings.signer())
    try:
        writer.write(settings.topics.catalogue, entry_key("gone", "send"), b"{not json")
        publish(settings, Notifier(), "notifier")

        with caplog.at_level("WARNING", logger="sagaline.client"):
            contract = new_client(settings, clients).contract("send")
        assert contract.participant == "notifier"
        assert contract.reversibility is Reversibility.IRREVERSIBLE
        assert "gone/send" in caplog.text and "sagaline catalogue withdraw gone" in caplog.text

        writer.write(settings.topics.catalogue, entry_key("gone", "send"), b"{still not json")
    finally:
        writer.close()
    with pytest.raises(UnknownTool, match="cannot be read"):
        new_client(settings, clients).contract("send")

"""The shell keeps in-flight states as their changelog bytes plus their next timer
(``coordinator.shell._PackedStates``): a restore from the real broker stores bytes,
schedules timers from the ``sagaline-next-due`` header without decoding, still reads
records written before the header existed, honours markers, and parks a saga whose
bytes turn out unreadable when it is first needed. A batch decodes each saga it
touches once and the core changes that copy in place; nothing of a failed decision
reaches memory or the changelog."""

from __future__ import annotations

from typing import Any

import pytest
from coordinator_ledger import Harness, Ledger
from pydantic import BaseModel

import coordinator.shell as shell
from coordinator import decide as core_decide
from coordinator.shell import PARKED_REASON, Coordinator, _due_headers, _Pending
from coordinator.state import (
    MarkerKind,
    SagaMarker,
    SagaState,
    SagaStatus,
    StepStatus,
    is_marker,
    load_changelog,
    terminal_marker,
)
from sagaline.kafka import LedgerReader, Producer, ensure_topics, producer_config
from schemas import FailureKind, IncidentRaised, StepIntentRecorded
from schemas.limits import PARKED_INCIDENT
from schemas.settings import Settings
from schemas.wire import read_dead_letter, to_message
from tests.coordinator_turns import turn_until


def _waiting(saga_id: str) -> SagaState:
    """A saga unwinding an accepted compensation: it has a completion timer."""
    ledger = Ledger(saga_id=saga_id)
    h = Harness(ledger)
    h.feed(
        ledger.started(),
        ledger.scheduled("refund", completion_within_ms=5_000),
        ledger.committed("refund"),
        ledger.scheduled("boom"),
        ledger.failed("boom", kind=FailureKind.BUSINESS_REJECTION),
        ledger.comp_accepted("refund"),
    )
    assert h.s.next_due_at() is not None
    return h.s


def test_restore_keeps_bytes_schedules_timers_and_parks_unreadable_states_on_use(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=2)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    headed, old, ended = _waiting("saga-headed"), _waiting("saga-old"), _waiting("saga-ended")
    due = headed.next_due_at()
    assert due is not None
    producer = Producer(producer_config(kafka_bootstrap))
    records = [
        ("saga-headed", headed.to_bytes(), _due_headers(due)),
        ("saga-old", old.to_bytes(), []),  # written before the header existed
        ("saga-garbled", b'{"saga_id": 3', _due_headers(due + 1)),
        ("saga-ended", ended.to_bytes(), _due_headers(due)),
        ("saga-ended", terminal_marker(ended).to_bytes(), []),  # it ended later
    ]
    for key, value, headers in records:
        producer.produce(settings.topics.state, key=key.encode(), value=value, headers=headers)
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="packed-test")
    assert coordinator._restore(list(range(settings.partitions))) == 4

    assert coordinator.in_flight == 3  # the garbled one too: it was not decoded
    assert sorted(coordinator._timers) == sorted(
        [(due, "saga-headed"), (old.next_due_at() or 0, "saga-old"), (due + 1, "saga-garbled")]
    )
    assert coordinator.state_of("saga-headed") == headed
    assert coordinator.state_of("saga-old") == old
    marker = coordinator.marker_of("saga-ended")
    assert marker is not None and marker.marker is MarkerKind.TERMINAL
    assert coordinator.state_of("saga-ended") is None
    assert set(coordinator._due_sagas(due + 1)) == {"saga-headed", "saga-old", "saga-garbled"}

    # The garbled saga is found when it is first needed: parked (by the batch, as any
    # other: a parked marker for the changelog and a saga-parked incident), not lost.
    pending = _Pending()
    current = coordinator._current("saga-garbled", pending, due + 1)
    assert isinstance(current, SagaMarker) and current.marker is MarkerKind.PARKED
    assert pending.states["saga-garbled"] is current and "unreadable" in current.reason
    # The unreadable value itself to the DLQ first: the parked marker replaces it.
    assert [m[0] for m in pending.loose] == [
        settings.topics.dlq,
        settings.topics.events,
        settings.topics.incidents,
    ]
    assert pending.loose[0][1:3] == (b"saga-garbled", b'{"saga_id": 3')


def test_a_decision_that_raises_half_way_parks_its_saga_and_writes_none_of_its_changes(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core decides on the batch's decoded state in place (``in_place``): a
    decision that changed it and then raised must leave no trace of the change, in
    memory or in the changelog; its saga is parked and a neighbour in the same
    batches goes on. Records are read in batches of (up to) two, so a batch decides
    on what the previous one committed (in the background) and left in memory, and
    the record after the failed one is, most likely, in the same batch."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, ["svc"], settings.partitions)
    good, bad = Ledger(saga_id="saga-good"), Ledger(saga_id="saga-bad")
    records = [
        good.started(),
        bad.started(),
        good.scheduled("hold"),
        bad.scheduled("hold"),
        bad.intent("hold"),  # its decision changes the state, then raises
        bad.committed("hold"),  # the saga is parked: to the DLQ
        good.intent("hold"),
        good.committed("hold"),
    ]

    def decide(state: Any, record: Any, now: int, *args: Any, **kw: Any) -> Any:
        if record.saga_id == "saga-bad" and isinstance(record, StepIntentRecorded):
            assert kw.get("in_place") and state is not None
            state.status = SagaStatus.COMPENSATING
            state.steps.clear()
            raise RuntimeError("a bug half-way through a decision")
        return core_decide(state, record, now, *args, **kw)

    monkeypatch.setattr(shell, "decide", decide)
    producer = Producer(producer_config(kafka_bootstrap))
    signer = settings.signer()
    for record in records:
        key, value, headers = to_message(record, signer)
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="inplace", batch_size=2)
    ends = LedgerReader(kafka_bootstrap).end_offsets(settings.topics.events)
    seen: dict[str, Any] = {}

    def done() -> bool:  # what memory holds once every record is committed
        if coordinator.positions().get(0, -1) < ends[0]:
            return False
        seen.update(
            parked=coordinator.marker_of("saga-bad"),
            bad=coordinator.state_of("saga-bad"),
            held=coordinator.state_of("saga-good"),
        )
        return True

    coordinator.run(until=done)  # closing it drops what it held

    parked, held = seen["parked"], seen["held"]
    assert parked is not None and parked.marker is MarkerKind.PARKED
    assert "half-way" in parked.reason
    assert seen["bad"] is None
    assert held is not None and held.steps["hold"].status is StepStatus.COMMITTED
    latest: dict[bytes, bytes | None] = {}
    for k, v, _h in LedgerReader(kafka_bootstrap).records(settings.topics.state):
        if k is not None:
            latest[k] = v
    assert latest[b"saga-bad"] == parked.to_bytes()  # never the half-changed state
    assert SagaState.from_bytes(latest[b"saga-good"] or b"") == held
    dead = [
        read_dead_letter(h).reason
        for k, _v, h in LedgerReader(kafka_bootstrap).records(settings.topics.dlq)
        if k == b"saga-bad"
    ]
    assert dead == [PARKED_REASON, PARKED_REASON]  # the raising record, then the next


def test_a_decision_that_raises_a_validation_error_parks_its_saga_without_the_values_it_quotes(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked saga's reason goes to its marker, to a saga-parked incident on the
    ledger and to the incident feed. pydantic's message quotes each bad field's input
    (a step's arguments, in clear): the reason names the fields and the error types
    only, as for an unreadable changelog value."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, ["svc"], settings.partitions)
    bad = Ledger(saga_id="saga-quotes")
    records = [bad.started(), bad.scheduled("hold"), bad.intent("hold")]

    class Card(BaseModel):
        number: int

    def decide(state: Any, record: Any, now: int, *args: Any, **kw: Any) -> Any:
        if isinstance(record, StepIntentRecorded):
            Card.model_validate({"number": "4111-1111-1111-1111"})  # raises, quoting it
        return core_decide(state, record, now, *args, **kw)

    monkeypatch.setattr(shell, "decide", decide)
    producer = Producer(producer_config(kafka_bootstrap))
    signer = settings.signer()
    for record in records:
        key, value, headers = to_message(record, signer)
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="quotes")
    ends = LedgerReader(kafka_bootstrap).end_offsets(settings.topics.events)
    seen: dict[str, Any] = {}

    def done() -> bool:
        if coordinator.positions().get(0, -1) < ends[0]:
            return False
        seen["parked"] = coordinator.marker_of("saga-quotes")
        return True

    coordinator.run(until=done)

    parked = seen["parked"]
    assert parked is not None and parked.marker is MarkerKind.PARKED
    assert "ValidationError" in parked.reason and "number (int_parsing)" in parked.reason
    assert "4111" not in parked.reason


def test_a_saga_whose_changelog_value_is_unreadable_is_parked_as_any_other_with_an_incident(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Parked like a saga whose decision raises: a durable parked marker on the
    changelog and one ``saga-parked`` incident on the ledger (which the agent's waiting
    call turns into ``SagaParked``), its record to the DLQ; before, only memory knew,
    nobody was told and the agent waited out its timeout."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, ["svc"], settings.partitions)
    garbled = Ledger(saga_id="saga-garbled")
    producer = Producer(producer_config(kafka_bootstrap))
    # One garbled with the timer header (decoded when first needed), one a garbled
    # marker (decoded at restore).
    producer.produce(
        settings.topics.state,
        key=b"saga-garbled",
        value=b'{"saga_id": 3',
        headers=_due_headers(None),
    )
    producer.produce(settings.topics.state, key=b"saga-torn", value=b'{"marker":"TERM')
    torn = Ledger(saga_id="saga-torn")
    signer = settings.signer()
    for record in (garbled.scheduled("hold"), torn.scheduled("hold")):
        key, value, headers = to_message(record, signer)
        producer.produce(settings.topics.events, key=key, value=value, headers=headers)
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="garbled")
    ends = LedgerReader(kafka_bootstrap).end_offsets(settings.topics.events)
    coordinator.run(until=lambda: coordinator.positions().get(0, -1) >= ends[0])

    latest: dict[bytes, bytes | None] = {}
    for k, v, _h in LedgerReader(kafka_bootstrap).records(settings.topics.state):
        if k is not None:
            latest[k] = v
    for saga_id in ("saga-garbled", "saga-torn"):
        value = latest[saga_id.encode()] or b""
        assert is_marker(value), (saga_id, value)  # not the unreadable value any more
        marker = load_changelog(value)
        assert isinstance(marker, SagaMarker) and marker.marker is MarkerKind.PARKED, saga_id
        assert "unreadable" in marker.reason
        kinds = [
            r.kind
            for r in LedgerReader(kafka_bootstrap).saga_records(
                settings.topics.events, saga_id, signer
            )
            if isinstance(r, IncidentRaised)
        ]
        assert kinds == [PARKED_INCIDENT], (saga_id, kinds)


def test_a_saga_parked_from_a_timer_with_an_unreadable_state_keeps_its_tenant_or_says_unknown(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """No record of the saga in the batch, and its state does not decode: its tenant
    (and generation) come from the head of its changelog value when that is intact (a
    torn record), so the incident and the parked marker are its tenant's, whose
    operators see and resolve it. When nothing says (garbled from the first byte),
    the tenant is an explicit unknown one, never ``default`` (a real tenant, whose
    operators would see another tenant's saga while its own were refused)."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    torn = _waiting("saga-torn")
    due = torn.next_due_at()
    assert due is not None and torn.tenant_id != "default"
    producer = Producer(producer_config(kafka_bootstrap))
    for key, value in (("saga-torn", torn.to_bytes()[:160]), ("saga-garbled", b"\x00garbled")):
        producer.produce(
            settings.topics.state, key=key.encode(), value=value, headers=_due_headers(due)
        )
    assert producer.flush(30) == 0

    one = Coordinator(settings, kafka_bootstrap, instance_id="torn", clock=lambda: due + 1)
    one._join()

    def parked() -> bool:
        one._settle()
        return all(one.marker_of(s) is not None for s in ("saga-torn", "saga-garbled"))

    turn_until(one, parked)
    markers = {s: one.marker_of(s) for s in ("saga-torn", "saga-garbled")}
    one._consumer.close()

    def incident(saga_id: str) -> IncidentRaised:
        [raised] = [
            r
            for r in LedgerReader(kafka_bootstrap).saga_records(
                settings.topics.events, saga_id, settings.signer()
            )
            if isinstance(r, IncidentRaised)
        ]
        return raised

    raised = incident("saga-torn")
    assert (raised.envelope.tenant_id, raised.envelope.generation) == (
        torn.tenant_id,
        torn.generation,
    )
    marker = markers["saga-torn"]
    assert marker is not None and marker.tenant_id == torn.tenant_id

    from coordinator.state import UNKNOWN_TENANT

    assert incident("saga-garbled").envelope.tenant_id == UNKNOWN_TENANT != "default"
    marker = markers["saga-garbled"]
    assert marker is not None and marker.tenant_id == UNKNOWN_TENANT


def test_restore_skips_a_state_record_whose_key_is_not_utf8_and_restores_the_rest(
    kafka_bootstrap: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-written or corrupted record on the state topic whose key is not UTF-8
    stopped the restore with a UnicodeDecodeError: the coordinator could not start,
    and no saga moved. It is skipped with a logged error; the others are restored."""
    from tests.raw_headers import produce_raw

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    good = _waiting("saga-good")
    due = good.next_due_at()
    assert due is not None
    produce_raw(kafka_bootstrap, settings.topics.state, b"\xff\xfe", good.to_bytes(), [])
    producer = Producer(producer_config(kafka_bootstrap))
    producer.produce(
        settings.topics.state, key=b"saga-good", value=good.to_bytes(), headers=_due_headers(due)
    )
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="bad-key-test")
    assert coordinator._restore([0]) == 1
    assert coordinator.state_of("saga-good") == good
    assert coordinator._timers == [(due, "saga-good")]
    assert "not UTF-8" in caplog.text


def test_restore_reads_a_state_record_whose_header_name_is_not_utf8_from_its_value(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A state record with a header name that is not UTF-8 stopped the restore (the
    headers were read directly, and confluent-kafka raises SystemError for them): the
    coordinator could not start. Its headers are taken as none, so its state is
    decoded for its timer, as a record written before the header existed."""
    from tests.raw_headers import produce_raw

    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    odd = _waiting("saga-odd-header")
    due = odd.next_due_at()
    assert due is not None
    [(name, value)] = _due_headers(due)
    headers = [(b"\xff", b"x"), (name.encode(), value)]
    produce_raw(kafka_bootstrap, settings.topics.state, b"saga-odd-header", odd.to_bytes(), headers)

    coordinator = Coordinator(settings, kafka_bootstrap, instance_id="bad-header-test")
    assert coordinator._restore([0]) == 1
    assert coordinator.state_of("saga-odd-header") == odd
    assert coordinator._timers == [(due, "saga-odd-header")]


def test_rebalances_do_not_pile_up_timer_entries_of_the_sagas_restored_again() -> None:
    """Each assignment restores its partitions' sagas and schedules their timers; the
    entries of the sagas it had before (revoked, then assigned again: every eager
    rebalance does so) stayed in the heap until due. A timer a day away (an approval's
    expiry) got one more entry per rebalance: a group that rebalances often (a member
    flapping) grew the coordinator's heap by its in-flight sagas every time."""
    import uuid

    from sagaline.kafka import TopicPartition, create_producer

    transport = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=transport, topic_prefix="rebalanced.", partitions=2)
    ensure_topics(transport, settings.topics, [], settings.partitions)
    waiting = _waiting("saga-waits")
    due = waiting.next_due_at()
    producer = create_producer(transport)
    producer.produce(
        settings.topics.state,
        key=b"saga-waits",
        value=waiting.to_bytes(),
        headers=_due_headers(due),
        partition=0,
    )
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, transport, instance_id="rebalanced")
    partitions = [TopicPartition(settings.topics.events, n) for n in range(2)]
    consumer = coordinator._consumer
    for _ in range(5):
        coordinator._on_assign(consumer, partitions)
        coordinator._on_revoke(consumer, partitions)
    coordinator._on_assign(consumer, partitions)
    assert coordinator.state_of("saga-waits") == waiting
    assert coordinator._timers == [(due, "saga-waits")]
    coordinator._consumer.close()


def test_an_unreadable_state_without_the_timer_header_is_parked_though_no_record_comes(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A state value the restore decodes (one written before the ``sagaline-next-due``
    header existed) and cannot read has no known timer. It was kept to be parked when
    a record of its saga came; a saga waiting on its own timer (a retry, an approval's
    expiry, a reversal window) gets none, so it stayed in memory for good, decided by
    nobody, with no incident and no parked marker. It is parked in the first batch
    after the restore."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    torn = _waiting("saga-torn-old")
    producer = Producer(producer_config(kafka_bootstrap))
    producer.produce(settings.topics.state, key=b"saga-torn-old", value=torn.to_bytes()[:160])
    assert producer.flush(30) == 0

    one = Coordinator(settings, kafka_bootstrap, instance_id="torn-old", carry_ms=0, linger_ms=0)
    one._join()
    try:
        for _ in range(50):  # loop turns (up to 0.2 s each), not a deadline
            one._process_batch(one._next_batch())
            one._settle()
            if one.marker_of("saga-torn-old") is not None:
                break
        marker = one.marker_of("saga-torn-old")
    finally:
        one._consumer.close()
    assert marker is not None and marker.marker is MarkerKind.PARKED, "never parked"
    assert "unreadable" in marker.reason and marker.tenant_id == torn.tenant_id
    kinds = [
        r.kind
        for r in LedgerReader(kafka_bootstrap).saga_records(
            settings.topics.events, "saga-torn-old", settings.signer()
        )
        if isinstance(r, IncidentRaised)
    ]
    assert kinds == [PARKED_INCIDENT]


SECRET = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"


def test_an_unreadable_state_is_reported_without_the_values_it_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Why a changelog value does not decode is logged and put in the saga-parked
    incident (on the ledger and the incident feed) and the parked marker: pydantic's
    own message quotes each bad field's input (``input_value=...``), which may be a
    step's arguments or the end of a torn value, i.e. secrets in clear in a log and
    on topics. Only where and what kind of error is reported."""
    import re
    import uuid

    from sagaline.kafka import TopicPartition, create_producer

    transport = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=transport, topic_prefix="secret.", partitions=1)
    ensure_topics(transport, settings.topics, [], settings.partitions)
    waiting = _waiting("saga-secret")
    value = waiting.to_bytes()
    # A step's arguments of the wrong type (as a list), and a value torn right after them.
    wrong, count = re.subn(rb'"args":"[^"]*"', f'"args":["{SECRET}"]'.encode(), value, count=1)
    assert count == 1
    torn = value.replace(b'"args":"', f'"args":"{SECRET}'.encode(), 1)
    torn = torn[: torn.index(SECRET.encode()) + len(SECRET)]
    producer = create_producer(transport)
    for saga_id, garbled, headers in (
        ("saga-secret", wrong, _due_headers(waiting.next_due_at())),  # parked on use
        ("saga-torn-secret", torn, []),  # decoded (and logged) by the restore
    ):
        producer.produce(
            settings.topics.state, key=saga_id.encode(), value=garbled, headers=headers
        )
    assert producer.flush(30) == 0

    coordinator = Coordinator(settings, transport, instance_id="secret")
    partitions = [TopicPartition(settings.topics.events, 0)]
    with caplog.at_level("INFO"):
        coordinator._on_assign(coordinator._consumer, partitions)
        pending = _Pending()
        for saga_id in ("saga-secret", "saga-torn-secret"):
            marker = coordinator._current(saga_id, pending, 1)
            assert isinstance(marker, SagaMarker) and marker.marker is MarkerKind.PARKED
    coordinator._consumer.close()

    reason = pending.states["saga-secret"]
    assert isinstance(reason, SagaMarker)
    assert "steps.refund.args" in reason.reason  # where, and what kind of error
    written = [marker.to_bytes() for marker in pending.states.values()]
    # Each unreadable value goes to the DLQ byte for byte (as the state topic holds it,
    # like any DLQ copy of a record): nothing the coordinator writes of its own quotes it.
    copies = [m[2] for m in pending.loose if m[0] == settings.topics.dlq]
    assert copies == [wrong, torn]
    written += [m[2] or b"" for m in pending.loose if m[0] != settings.topics.dlq]
    assert len(written) == 6  # two markers, two incidents each
    for data in written:
        assert SECRET.encode() not in data, data
    assert "unreadable" in caplog.text and SECRET not in caplog.text, caplog.text


class _Commits(shell.NoMetrics):
    def __init__(self) -> None:
        self.commits = 0

    def transaction_committed(self, seconds: float, records: int) -> None:
        self.commits += 1


def test_a_timer_header_naming_no_timer_of_the_state_is_dropped_not_fired_every_turn() -> None:
    """A restore schedules a saga's timer from its changelog record's
    ``sagaline-next-due`` header without decoding the state. A header naming a time at
    which the state has no timer (corrupt, or written by hand) made the tick at that
    time change nothing; the saga was scheduled at the same time again, so every loop
    turn fired it and committed an empty transaction (a busy loop). Its real timer is
    scheduled instead, once."""
    import uuid

    transport = f"memory://{uuid.uuid4().hex[:12]}"
    settings = Settings(bootstrap=transport, topic_prefix="header.", partitions=1)
    ensure_topics(transport, settings.topics, [], settings.partitions)
    waiting = _waiting("saga-wrong-header")
    due = waiting.next_due_at()
    assert due is not None
    wrong = due - 10_000  # no timer of the saga is due then
    from sagaline.kafka import create_producer

    producer = create_producer(transport)
    producer.produce(
        settings.topics.state,
        key=b"saga-wrong-header",
        value=waiting.to_bytes(),
        headers=_due_headers(wrong),
    )
    assert producer.flush(30) == 0

    metrics = _Commits()
    one = Coordinator(
        settings, transport, instance_id="header", clock=lambda: wrong + 1, metrics=metrics
    )
    one._join()

    def ticked() -> bool:
        one._settle()
        return metrics.commits >= 1  # the tick at the header's time

    try:
        turn_until(one, ticked)
        ticks = metrics.commits
        for _ in range(5):  # loop turns with nothing to do
            one._process_batch(one._next_batch())
            one._settle()
        timers, state = list(one._timers), one.state_of("saga-wrong-header")
    finally:
        one._consumer.close()
    assert metrics.commits == ticks, f"{metrics.commits - ticks} more empty transactions"
    assert timers == [(due, "saga-wrong-header")]  # its real timer
    assert state == waiting


def test_an_unreadable_changelog_value_is_dead_lettered_before_its_parked_marker_replaces_it(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A changelog value the coordinator cannot read (torn, or written by a newer
    version: ``docs/operating.md`` warns that a rolled-back coordinator parks such
    sagas) was replaced on the compacted changelog by the saga's parked marker and
    copied nowhere: once compacted, the state was gone for good, though R16 says bad
    input is never lost. It goes to the DLQ byte for byte, under its key, with its
    source topic and partition, before the marker is written; re-produced onto the
    changelog (after upgrading again), it is the saga's state again."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, [], settings.partitions)
    newer, old = _waiting("saga-newer"), _waiting("saga-torn-old")
    due = newer.next_due_at()
    assert due is not None
    # A newer version's state (a field this one does not know) with the timer header,
    # parked when its timer comes; a torn one without it, parked at once.
    newer_value = newer.to_bytes()[:-1] + b',"added_later":1}'
    torn_value = old.to_bytes()[:160]
    producer = Producer(producer_config(kafka_bootstrap))
    producer.produce(
        settings.topics.state, key=b"saga-newer", value=newer_value, headers=_due_headers(due)
    )
    producer.produce(settings.topics.state, key=b"saga-torn-old", value=torn_value)
    assert producer.flush(30) == 0

    one = Coordinator(settings, kafka_bootstrap, instance_id="dead-state", clock=lambda: due + 1)
    one._join()

    def parked() -> bool:
        one._settle()
        return all(one.marker_of(s) is not None for s in ("saga-newer", "saga-torn-old"))

    try:
        turn_until(one, parked)
    finally:
        one._consumer.close()
    dead = {
        k: (v, read_dead_letter(h))
        for k, v, h in LedgerReader(kafka_bootstrap).records(settings.topics.dlq)
    }
    for key, value in ((b"saga-newer", newer_value), (b"saga-torn-old", torn_value)):
        assert key in dead, f"{key!r}'s unreadable changelog value is in no DLQ record"
        copied, letter = dead[key]
        assert copied == value
        assert (letter.reason, letter.source_topic, letter.partition) == (
            shell.UNREADABLE_STATE_REASON,
            settings.topics.state,
            0,
        )
        assert "unreadable" in letter.detail

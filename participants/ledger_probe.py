"""What a command already caused on the ledger, for replicas that share no journal.

Two replicas of a participant each keep their own SQLite journal. When a command
partition moves from one to the other (a replica joins, leaves or crashes), the new
owner may receive a command the old owner already took: its journal has never seen
it, but the ledger has. Every record a runtime appends for a command carries a
deterministic event id derived from the command's (``intent``, ``outcome``), so
"did anyone act on this command?" is answered by the records on the saga's ledger
partition whose ``causation_id`` is the command's event id.

The probe reads only that one partition, from the command's own timestamp (less
:data:`CLOCK_SKEW_MS` for producer clocks that disagree) to its current end (the high
watermark: records of a coordinator transaction still open are read too, so an
intent appended behind one is not missed), and
decodes only records with the saga's key. So its cost is one partition's records
since the command was sent: small while the participant keeps up.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from sagaline.kafka import (
    ClientConfig,
    KafkaError,
    KafkaException,
    TopicPartition,
    create_uncommitted_reader,
    headers_of,
    watermarks,
)
from schemas import Record
from schemas.errors import CodecError, SchemaMismatch, UnknownFingerprint
from schemas.partitioning import partition_for
from schemas.signing import Signer
from schemas.wire import from_message

__all__ = ["CLOCK_SKEW_MS", "LedgerProbe", "LedgerProbeError"]

CLOCK_SKEW_MS = 30_000
"""How far a replica's clock may lag the coordinator's: the scan starts this much
before the command's timestamp, so an intent stamped by a slower clock is found."""


class LedgerProbeError(RuntimeError):
    """The ledger could not be read to its end; the command is not run blind."""


class LedgerProbe:
    """Finds the records on ``topic`` (the ledger) caused by a given command."""

    def __init__(
        self,
        bootstrap: str | ClientConfig,
        topic: str,
        signer: Signer,
        *,
        clock_skew_ms: int = CLOCK_SKEW_MS,
        timeout_s: float = 60.0,
    ) -> None:
        self.topic = topic
        self._signer = signer
        self._skew = clock_skew_ms
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._partitions: int | None = None
        # No group membership, no commits: a plain reader of assigned partitions, up
        # to the high watermark. Uncommitted reads: the coordinator writes the ledger
        # in transactions, and under read_committed an intent appended after one began
        # stays past the last stable offset (the end a committed reader sees) until it
        # commits; a probe stopping there would miss it and run the tool again. What
        # it looks for (a participant's intents and outcomes) no transaction writes.
        self._consumer = create_uncommitted_reader(
            bootstrap,
            f"sagaline-probe-{uuid.uuid4().hex[:8]}",
            **{"enable.partition.eof": True},
        )

    def caused_by(self, command: Record) -> list[Record]:
        """Every decodable record on the ledger whose causation is ``command``.

        Broker trouble (a leader moving, a broker restarting) is retried until the
        probe's timeout: failing here would send a good command to the DLQ. Past it,
        :class:`LedgerProbeError`.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                return self._caused_by(command)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if getattr(error, "fatal", lambda: False)() or time.monotonic() > deadline:
                    raise LedgerProbeError(
                        f"could not read the ledger {self.topic} for command "
                        f"{command.event_id}: {exc}"
                    ) from exc
                time.sleep(0.2)  # back off before asking the broker again

    def _caused_by(self, command: Record) -> list[Record]:
        key = command.saga_id.encode()
        with self._lock:
            partition = partition_for(key, self._partition_count())
            since = max(0, command.envelope.occurred_at - self._skew)
            found = self._consumer.offsets_for_times(
                [TopicPartition(self.topic, partition, since)], timeout=self._timeout_s
            )
            if found[0].error is not None:
                # A partition's failure (a leader moving) comes back in its ``error``,
                # with no offset: not "nothing since the command", so ask again.
                raise KafkaException(found[0].error)
            start = found[0].offset
            _low, high = watermarks(
                self._consumer, TopicPartition(self.topic, partition), self._timeout_s
            )
            if start < 0 or start >= high:
                return []  # nothing written since the command was sent
            return self._scan(partition, start, high, key, command.event_id)

    def _scan(self, partition: int, start: int, high: int, key: bytes, cause: str) -> list[Record]:
        out: list[Record] = []
        self._consumer.assign([TopicPartition(self.topic, partition, start)])
        deadline = time.monotonic() + self._timeout_s
        try:
            while True:
                msg: Any = self._consumer.poll(0.5)
                if msg is None:
                    if time.monotonic() > deadline:
                        raise LedgerProbeError(
                            f"could not read {self.topic}[{partition}] up to offset {high} "
                            f"within {self._timeout_s:.0f} s (is the broker reachable?)"
                        )
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return out
                    continue
                if msg.key() == key:
                    try:
                        record = from_message(msg.key(), msg.value(), headers_of(msg), self._signer)
                    except (UnknownFingerprint, SchemaMismatch) as exc:
                        # Signed, but written under a schema this version cannot read
                        # (a replica already on a later contract version): it may be
                        # this command's intent or outcome, so "nothing found" would
                        # be a guess. Not run blind: tried again until a replica that
                        # reads it (upgraded) owns the partition.
                        if self._maybe_a_replicas(msg):
                            raise LedgerProbeError(
                                f"{self.topic}[{partition}]@{msg.offset()} holds a record "
                                f"of saga {key.decode('utf-8', 'replace')!r} this participant "
                                f"cannot read ({exc.reason}: {exc}); it may be this command's "
                                "intent or outcome, written by a newer version: upgrade this "
                                "replica"
                            ) from exc
                        record = None  # signed by another identity: not this command's
                    except CodecError:
                        record = None  # garbage or forged: the coordinator DLQs it
                    if (
                        record is not None
                        and record.envelope.causation_id == cause
                        and self._maybe_ours(record)
                    ):
                        out.append(record)
                if msg.offset() >= high - 1:
                    return out
        finally:
            self._consumer.unassign()

    def _maybe_ours(self, record: Record) -> bool:
        """Whether a verified record can be a replica's answer to the command: with
        identities, only one this participant's own identity wrote (its producer is
        bound to the signing key). Another participant may write intents and outcomes
        too, for its own steps; one under this command's ids is a forgery the
        coordinator refuses, and re-sending it would leave the step unanswered."""
        own = self._signer.signs_as
        return own is None or record.envelope.producer == own

    def _maybe_a_replicas(self, msg: Any) -> bool:
        """Whether a verified record could come from a replica of this participant:
        with identities, only when this participant's own identity signed it (no one
        else may write its intents and outcomes); with a shared key or none, any."""
        own = self._signer.signs_as
        if own is None:
            return True
        writer = self._signer.verify(msg.key(), msg.value(), headers_of(msg))
        return writer is not None and writer.name == own

    def _partition_count(self) -> int:
        if self._partitions is None:
            meta = self._consumer.list_topics(self.topic, timeout=self._timeout_s)
            topic = meta.topics.get(self.topic)
            if topic is None or topic.error is not None or not topic.partitions:
                raise LedgerProbeError(f"the ledger topic {self.topic!r} does not exist")
            self._partitions = len(topic.partitions)
        return self._partitions

    def close(self) -> None:
        with self._lock:
            self._consumer.close()

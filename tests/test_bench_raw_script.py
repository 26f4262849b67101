"""The raw floor's script (``bench/e2e.py``) is built from a real saga's trace, in an
order where each record comes after what caused it, whatever the timestamps say.

One at a time, hops take a millisecond or two, so a participant's intent often
carries the same millisecond as the command that caused it; ordered by timestamp and
then by (partition, offset) across two topics, the intent came first, its trigger
fell back to an unrelated record, and the floor's copiers stalled (a pair printed the
floor as nan). These build such traces by hand: no broker, no processes.
"""

from __future__ import annotations

from types import SimpleNamespace

from bench.e2e import Traced, causal_order, script_from_trace

PREFIX = "t."
TOPICS = SimpleNamespace(prefix=PREFIX)


def _rec(
    kind: str, event_id: str, cause: str | None, producer: str, topic: str, ts: int, offset: int
) -> Traced:
    # Every record of a saga is on the same partition number of each topic.
    return Traced(kind, event_id, cause, producer, f"{PREFIX}sagaline.{topic}", ts, (3, offset))


def _one_step_saga() -> list[Traced]:
    """Start, one step that commits, the end, the terminal record: sorted as
    ``read_traces`` sorts them, by (timestamp, partition/offset). The command and the
    intent share millisecond 101, and the command's offset on its topic (7) is above
    the intent's on the events topic (2), so the command sorts after the intent."""
    records = [
        _rec("SagaStarted", "s", None, "agent-1", "events", 100, 0),
        _rec("StepScheduled", "sch", None, "agent-1", "events", 100, 1),
        _rec("ExecuteStep", "ex", "sch", "sagaline-coordinator", "commands.p", 101, 7),
        _rec("StepIntentRecorded", "in", "ex", "p", "events", 101, 2),
        _rec("StepCommitted", "ok", "ex", "p", "events", 102, 3),
        _rec("SagaEndRequested", "end", None, "agent-1", "events", 103, 4),
        _rec("SagaTerminal", "term", "end", "sagaline-coordinator", "events", 104, 5),
        _rec("SagaTerminal", "term", "end", "sagaline-coordinator", "terminal", 104, 0),
    ]
    return sorted(records, key=lambda r: (r.ts, r.offset_key))


def test_a_command_comes_before_the_intent_it_caused_even_on_a_timestamp_tie() -> None:
    by_time = _one_step_saga()
    assert [r.event_id for r in by_time].index("in") < [r.event_id for r in by_time].index("ex")

    ordered = [r.event_id for r in causal_order(by_time)]

    assert ordered.index("ex") < ordered.index("in")
    assert sorted(ordered) == sorted(r.event_id for r in by_time)  # nothing lost or doubled


def test_the_events_records_keep_their_partition_order_against_skewed_clocks() -> None:
    records = _one_step_saga()
    # The participant's clock is a millisecond behind: its commit carries an earlier
    # timestamp than the intent it follows on the partition.
    records[4] = _rec("StepCommitted", "ok", "ex", "p", "events", 100, 3)
    by_time = sorted(records, key=lambda r: (r.ts, r.offset_key))

    events = [r.event_id for r in causal_order(by_time) if r.topic.endswith("events")]

    assert events == ["s", "sch", "in", "ok", "end", "term"]


def test_every_trigger_of_the_script_points_at_an_earlier_record() -> None:
    script, done = script_from_trace(_one_step_saga(), TOPICS)

    assert all(trigger < index for index, (_role, _kind, trigger) in enumerate(script))
    roles = [(role, kind) for role, kind, _trigger in script]
    intent = roles.index(("p", "events"))
    command = roles.index(("coordinator", "commands.p"))
    assert script[intent][2] == command  # the intent is copied when the command arrives
    assert script[done] == ("coordinator", "events", script[done][2])

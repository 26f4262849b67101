"""The coordinator enforces its own SAGALINE_MAX_STEPS: a writer that skipped the saga
client's count (a forged record, a buggy or older client) cannot grow a saga past it.
Run on both transports."""

from __future__ import annotations

import dataclasses

from coordinator.shell import Coordinator
from schemas.limits import Limits
from tests.coordinator_turns import append, executes, one_saga, turn_until


def test_a_step_past_the_coordinators_max_steps_is_rejected_not_run(
    transport: str, unique_prefix: str
) -> None:
    settings, ledger, first, participant = one_saga(transport, unique_prefix, "saga-many")
    settings = dataclasses.replace(settings, limits=Limits(max_steps=2))
    one = Coordinator(settings, transport, instance_id="max-steps-1", carry_ms=0)
    one._join()
    append(
        settings,
        transport,
        ledger.started(),
        first,
        ledger.scheduled("charge", tool="reserve", depends_on=[]),
        ledger.scheduled("ship", tool="reserve", depends_on=[]),
    )

    def decided() -> bool:  # "ship" scheduled, or refused
        state = one.state_of("saga-many")
        return state is not None and ("ship" in state.steps or state.rejected_count > 0)

    turn_until(one, decided)
    state = one.state_of("saga-many")
    assert state is not None
    assert list(state.steps) == ["reserve", "charge"]
    [note] = state.recent_rejections
    assert note.reason == "too-many-steps", note
    assert executes(settings, transport, participant) == ["reserve", "charge"]
    one._consumer.close()

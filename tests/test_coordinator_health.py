"""The coordinator's ``/healthz`` answer (``Coordinator.health``) as an operator and
the compose healthchecks read it: 200 only once the loop really serves, i.e. it has
joined its group and restored its partitions' sagas from the changelog
(docs/operating.md). It said ``ok`` as soon as it had subscribed, before joining its
group and while the restore was still reading the changelog, so dependants started
against a coordinator that decided nothing yet. Real broker: the group and the
restore are the broker's."""

from __future__ import annotations

import threading

import pytest

from coordinator.shell import Coordinator
from tests.coordinator_turns import append, executes, one_saga
from tests.system import wait_until

pytestmark = pytest.mark.kafka


def test_healthz_says_restoring_until_the_changelog_is_restored_then_ok(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    bootstrap = kafka_bootstrap
    settings, ledger, first, participant = one_saga(bootstrap, unique_prefix, "saga-health")
    append(settings, bootstrap, ledger.started(), first)
    coordinator = Coordinator(settings, bootstrap, instance_id="health-1", carry_ms=0, linger_ms=0)
    assert coordinator.health() is not None  # not yet running

    in_restore = threading.Event()
    release = threading.Event()
    restore = coordinator._restore

    def held_restore(numbers: list[int]) -> int:
        in_restore.set()
        release.wait(120)
        return restore(numbers)

    coordinator._restore = held_restore  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def run() -> None:
        try:
            coordinator.run()
        except BaseException as exc:  # the test reports it
            failed.append(exc)

    thread = threading.Thread(target=run, name="coordinator")
    thread.start()
    try:
        assert in_restore.wait(120), f"the coordinator never got its partition: {failed}"
        why = coordinator.health()
        assert why is not None and "restoring" in why, why
        release.set()
        wait_until(lambda: coordinator.health() is None, 120, "the coordinator to serve")
        wait_until(lambda: executes(settings, bootstrap, participant) == ["reserve"], 60)
    finally:
        release.set()
        coordinator.stop()
        thread.join(120)
    assert not failed, failed
    assert coordinator.health() == "stopping"

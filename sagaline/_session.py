"""``sagaline.connect``: the client, the tools' runtime and (for development) the
coordinator, in one ``with``.

Without it a first saga means creating topics, starting a participant runtime per
catalogue in a thread, a coordinator, and a client that knows the contracts; this
does exactly that, against the configured broker, and stops all of it on exit.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from participants.catalogue import Catalogue, wrap
from participants.client import ENDED_SAGAS_KEPT, SagaClient
from participants.runtime import ParticipantRuntime
from sagaline.kafka import InstanceClaimed, ensure_topics, require_broker_answers
from sagaline.kafka._claims import broker_list_key
from schemas.settings import Settings

log = logging.getLogger("sagaline.connect")

__all__ = ["StartError", "connect"]

_START_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 30.0  # as long as ensure_topics waits for the broker's metadata


class StartError(RuntimeError):
    """A runtime or the coordinator started by ``connect`` did not come up."""


@contextmanager
def connect(
    *tools: Any,
    name: str | None = None,
    coordinator: bool = False,
    settings: Settings | None = None,
    bootstrap: str | None = None,
    call_timeout_s: float = 60.0,
    ended_sagas_kept: int = ENDED_SAGAS_KEPT,
) -> Iterator[SagaClient]:
    """Serve ``tools`` and yield a started :class:`SagaClient`.

    - ``tools``: none (a client of tools served elsewhere), ``Catalogue`` objects
      (each served under its own name), and/or participant objects and plain
      functions, wrapped together as one catalogue
      called ``name`` (checked by ``wrap()``: a bad declaration fails here). A
      participant name another session or runtime on this machine serves on the same
      broker address and topic prefix with the participant's name as instance id (of
      this process or another, e.g. `sagaline participant run`: the two runtimes
      would fence each other) is refused with :class:`StartError`.
    - ``coordinator``: also run a coordinator in this process. For development and
      tests; in production run ``sagaline coordinator run`` (the client then checks
      that one is consuming, and says what to start if not). Sessions of one process
      on the same broker (its list of brokers in any order or case) and topics share
      one coordinator: started by the first,
      stopped when the last one ends (two would fence each other); one that died is
      started again by the next session that asks for it, and serves them all.
      Another process on this machine asking for one on the same broker address and
      topics while this one runs gets :class:`StartError` (connect it with
      ``coordinator=False``); a process that was killed holds nothing back.
    - ``settings`` / ``bootstrap``: default to the environment
      (``SAGALINE_*``, ``KAFKA_BOOTSTRAP_SERVERS``); with no broker configured the
      project's local development broker is used (started if needed).
    - ``call_timeout_s`` / ``ended_sagas_kept``: passed to the :class:`SagaClient`.

    A coordinator or runtime that fails while starting raises :class:`StartError`
    (from its cause) at once; everything started so far is stopped.
    """
    # The declarations first: a bad one fails before a broker is chosen or started.
    catalogues = _catalogues(tools, name)
    if settings is None:
        settings = Settings.from_env()
    if bootstrap is None:
        bootstrap = settings.bootstrap
    if bootstrap is None:
        from services.broker import resolve_bootstrap

        bootstrap = resolve_bootstrap()
    _require_broker(bootstrap)
    ensure_topics(
        bootstrap,
        settings.topics,
        [c.name for c in catalogues],
        settings.partitions,
        replication=settings.replication,
    )

    stoppers: list[Any] = []
    threads: list[threading.Thread] = []
    client: SagaClient | None = None
    shared = ExitStack()
    try:
        if coordinator:
            shared.enter_context(_coordinator(settings, bootstrap))
        for catalogue in catalogues:
            # The runtime claims its static group member (the participant's name as
            # instance id) as it starts: a twin in another session, or a `participant
            # run` of it on this machine, would fence it, or be fenced.
            runtime = ParticipantRuntime(catalogue, settings, bootstrap, instance_id=catalogue.name)
            stoppers.append(runtime)
            _start(
                runtime.run,
                f"sagaline-participant-{catalogue.name}",
                f"participant {catalogue.name!r} did not start serving"
                f" {settings.topics.commands(catalogue.name)}",
                threads,
                functools.partial(_served_elsewhere, catalogue.name, bootstrap),
            )
        client = SagaClient(
            settings,
            bootstrap,
            catalogues=catalogues,
            call_timeout_s=call_timeout_s,
            ended_sagas_kept=ended_sagas_kept,
        )
        client.start()
        yield client
    except BaseException:
        # What ends the session must not hide why it ended, nor leave anything running.
        _stop(client, stoppers, threads, shared, raising=False)
        raise
    _stop(client, stoppers, threads, shared, raising=True)


def _stop(
    client: SagaClient | None,
    stoppers: list[Any],
    threads: list[threading.Thread],
    shared: ExitStack,
    *,
    raising: bool,
) -> None:
    """Close the client, stop the runtimes, then the coordinator: each step also when
    one before it failed. The first failure is raised when ``raising`` (the block
    ended normally), else logged (an error of the block's is on its way)."""
    steps: list[Callable[[], object]] = [client.close] if client is not None else []
    steps += [stopper.stop for stopper in reversed(stoppers)]
    steps += [functools.partial(thread.join, 30) for thread in threads]
    steps.append(shared.close)
    failures: list[Exception] = []
    for step in steps:
        try:
            step()
        except Exception as exc:
            failures.append(exc)
    for failure in failures[1:] if raising else failures:
        log.error("sagaline.connect: while stopping the session: %s", failure, exc_info=failure)
    if failures and raising:
        raise failures[0]


def _require_broker(bootstrap: str) -> None:
    """Raise ``ConnectionError`` (``BrokerUnreachable``) naming ``bootstrap`` and what
    to do when no broker answers there, without librdkafka's log of each attempt."""
    require_broker_answers(bootstrap, "sagaline.connect", _PROBE_TIMEOUT_S)


class _Running:
    """A coordinator a session started, and how many sessions use it."""

    def __init__(self, core: Any, thread: threading.Thread) -> None:
        self.core = core
        self.thread = thread
        self.users = 0


# The coordinators this process's sessions run, by broker and ledger topic: one each.
# A second one would have the same static member and transactional id, and fence the
# first (whose thread dies on _FENCED); the first session, once the second ended,
# would be left with none. Held while one starts or stops (a session waits for it).
# Another process's is refused by the coordinator's own claim on its instance id
# (``sagaline.kafka.InstanceClaimed``), for the same reason.
_coordinators: dict[tuple[str, str], _Running] = {}
_coordinators_lock = threading.Lock()


@contextmanager
def _coordinator(settings: Settings, bootstrap: str) -> Iterator[None]:
    """The coordinator of ``settings``' topics, run in this process while a session
    uses it: started by the first session, stopped when the last one ends."""
    # By its broker list as the coordinator's claim keys it: the same brokers spelled
    # otherwise are this coordinator's, whose claim would refuse a second one.
    key = (broker_list_key(bootstrap), settings.topics.events)
    with _coordinators_lock:
        running = _coordinators.get(key)
        if running is None or not running.thread.is_alive():
            from coordinator.shell import Coordinator

            # A stable instance id: a restarted development process takes its
            # partitions back at once (static membership). The coordinator claims it
            # on this machine while it runs: another process's is refused.
            core = Coordinator(settings, bootstrap, instance_id="dev-coordinator")
            threads: list[threading.Thread] = []
            try:
                _start(
                    core.run,
                    "sagaline-coordinator",
                    f"the coordinator did not start consuming {settings.topics.events}",
                    threads,
                    lambda holder, path: (
                        f"sagaline.connect: {holder} runs the development coordinator"
                        f" of {settings.topics.events} on {bootstrap} (lock {path}); a"
                        " second one would fence it. Connect here with"
                        " coordinator=False (its coordinator serves this process's sagas"
                        " too, while it runs), or run `sagaline coordinator run` and"
                        " connect every process with coordinator=False"
                    ),
                )
            except BaseException:
                core.stop()
                for thread in threads:
                    thread.join(30)
                raise
            if running is None:
                running = _coordinators[key] = _Running(core, threads[0])
            else:
                # A dead one is replaced in place: the sessions that used it use this
                # one, and it stops with the last of them, not with this session.
                running.core, running.thread = core, threads[0]
        running.users += 1
    try:
        yield
    finally:
        with _coordinators_lock:
            running.users -= 1
            if running.users == 0:
                del _coordinators[key]
                running.core.stop()
                running.thread.join(30)


def _served_elsewhere(name: str, bootstrap: str, holder: str, path: str) -> str:
    return (
        f"sagaline.connect: participant {name!r} is already served on {bootstrap} by"
        f" {holder} (lock {path}); a second runtime with its instance id would fence"
        " the first. Serve its tools in one session: connect here without them (a"
        " client of the tools served there)"
    )


def _start(
    run: Callable[..., None],
    name: str,
    failure: str,
    threads: list[threading.Thread],
    refusal: Callable[[str, str], str],
) -> None:
    """Run ``run(ready=...)`` in a daemon thread (added to ``threads``, joined at the
    session's end) and return once it serves. Raises
    :class:`StartError` (``failure``, and why) as soon as it ends before serving,
    not after the whole start timeout; once it served, its end is logged: nothing
    else in the session would say that what it served is gone. Refused because
    another client on this machine holds its instance id (:class:`InstanceClaimed`),
    the :class:`StartError` says ``refusal(holder, lock path)``."""
    ready = threading.Event()
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            run(ready=ready)
        except BaseException as exc:
            if ready.is_set():
                log.exception("%s stopped: what it served is no longer served here", name)
            failed.append(exc)
        finally:
            ready.set()  # it serves, or never will: the start need not wait any more

    thread = threading.Thread(target=serve, name=name, daemon=True)
    thread.start()
    threads.append(thread)
    if not ready.wait(_START_TIMEOUT_S):
        raise StartError(f"{failure} within {_START_TIMEOUT_S:.0f} s")
    if failed and isinstance(failed[0], InstanceClaimed):
        raise StartError(refusal(failed[0].holder, failed[0].path)) from None
    if failed:
        raise StartError(f"{failure}: {type(failed[0]).__name__}: {failed[0]}") from failed[0]
    if not thread.is_alive():
        raise StartError(f"{failure}: it returned before serving")


def _catalogues(tools: tuple[Any, ...], name: str | None) -> list[Catalogue]:
    ready = [t for t in tools if isinstance(t, Catalogue)]
    loose = [t for t in tools if not isinstance(t, Catalogue)]
    if loose:
        ready.append(wrap(*loose, name=name))
    return ready  # none: a client for tools that other processes serve

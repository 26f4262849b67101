"""``sagaline mcp proxy`` on the real broker, driven by the ``mcp`` SDK's own client
session over stdio, in front of a real upstream MCP server (tests/mcp_upstream.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import pytest

pytest.importorskip("mcp")

import mcp_types as types
from mcp import ClientSession, StdioServerParameters, stdio_client

from coordinator.shell import Coordinator
from participants.client import ClientStopped, SagaClient
from participants.declarations import CompensationContext
from sagaline.agents.declaration import (
    DeclarationError,
    UpstreamTool,
    check,
    parse_declaration,
)
from sagaline.kafka import LedgerReader, ensure_topics
from sagaline.ops.actions import OperatorChannel, grant_approval
from schemas import ApprovalRequested, SagaOutcome, SagaTerminal, StepReconciled
from schemas.settings import Settings
from tests.system import wait_until

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "mcp_upstream.py"
RECEIPT = "sagaline://saga/receipt"


def _declaration(tmp_path: Path) -> Path:
    text = (ROOT / "tests" / "fixtures" / "mcp_desk.yaml").read_text()
    text = text.replace("command: python", f"command: {sys.executable}")
    text = text.replace("args: [tests/mcp_upstream.py]", f"args: [{UPSTREAM}]")
    path = tmp_path / "desk.yaml"
    path.write_text(text)
    return path


class World:
    """The coordinator (in this process), the environment of the proxy, the desk."""

    def __init__(self, bootstrap: str, prefix: str, tmp_path: Path) -> None:
        self.settings = Settings(
            bootstrap=bootstrap, topic_prefix=prefix, partitions=1, state_dir=tmp_path / "state"
        )
        self.bootstrap = bootstrap
        self.desk = tmp_path / "desk.json"
        self.declaration = _declaration(tmp_path)
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "SAGALINE_TOPIC_PREFIX": prefix,
            "SAGALINE_PARTITIONS": "1",
            "SAGALINE_STATE_DIR": str(tmp_path / "state"),
            "DESK_STATE": str(self.desk),
            "PYTHONPATH": str(ROOT),
        }

    def state(self) -> dict[str, Any]:
        loaded: dict[str, Any] = json.loads(self.desk.read_text())
        return loaded

    def log(self) -> list[str]:
        return [tool for tool, _args in self.state()["log"]]

    @asynccontextmanager
    async def proxy(self, *, elicit: Any = None) -> AsyncIterator[ClientSession]:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "services.cli", "mcp", "proxy", str(self.declaration)],
            env=self.env,
            cwd=str(ROOT),
        )
        async with (
            stdio_client(params) as (read, write),
            ClientSession(read, write, elicitation_callback=elicit) as session,
        ):
            await session.initialize()
            yield session


@pytest.fixture
def world(kafka_bootstrap: str, unique_prefix: str, tmp_path: Path) -> Iterator[World]:
    world = World(kafka_bootstrap, unique_prefix, tmp_path)
    ensure_topics(kafka_bootstrap, world.settings.topics, ["desk-proxy"], 1)
    coordinator = Coordinator(world.settings, kafka_bootstrap)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    yield world
    coordinator.stop()
    thread.join(30)


def _text(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def _receipt(session: ClientSession) -> dict[str, Any]:
    read = await session.read_resource(RECEIPT)
    content = read.contents[0]
    assert isinstance(content, types.TextResourceContents)
    loaded: dict[str, Any] = json.loads(content.text)
    return loaded


pytestmark = pytest.mark.kafka


def test_tools_are_relisted_with_annotations_and_reversibility(world: World) -> None:
    async def run() -> tuple[dict[str, types.Tool], types.CallToolResult]:
        async with world.proxy() as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            plan = await session.call_tool(
                "saga_check_plan",
                {
                    "calls": [
                        {"tool": "send_email", "args": {"to": "a", "body": "b"}},
                        {"tool": "charge", "args": {"amount": 1}},
                    ]
                },
            )
            return tools, plan

    tools, plan = asyncio.run(run())
    # R17: the irreversible email before a charge that can still fail is flagged.
    assert plan.is_error and "IRREVERSIBLE" in _text(plan) and "NOT OK" in _text(plan)
    assert set(tools) == {
        "create_ticket",
        "charge",
        "send_email",
        "list_tickets",
        "saga_commit",
        "saga_abort",
        "saga_check_plan",
    }  # delete_ticket, refund, find_ticket are internal: only the proxy calls them
    assert tools["list_tickets"].annotations.read_only_hint is True  # type: ignore[union-attr]
    assert tools["send_email"].annotations.destructive_hint is True  # type: ignore[union-attr]
    assert "IRREVERSIBLE" in (tools["send_email"].description or "")
    assert "undone by delete_ticket" in (tools["create_ticket"].description or "")
    # The idempotency key is the proxy's to fill, not the model's.
    assert "request_id" not in tools["create_ticket"].input_schema["properties"]


def test_a_failing_call_compensates_upstream_in_reverse_order_R1_R2(world: World) -> None:
    async def run() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with world.proxy() as session:
            made = await session.call_tool("create_ticket", {"title": "printer on fire"})
            assert made.structured_content == {"id": "T-1", "title": "printer on fire"}
            paid = await session.call_tool("charge", {"amount": 40})
            assert paid.structured_content == {"charge_id": "CH-1", "amount": 40}
            listed = await session.call_tool("list_tickets", {})  # read-only: passed through
            assert listed.structured_content == {"result": ["T-1"]}
            failed = await session.call_tool("charge", {"amount": 5000})
            return failed, await _receipt(session)

    failed, receipt = asyncio.run(run())
    assert failed.is_error and "card declined for 5000" in _text(failed)
    assert "aborted" in _text(failed)
    # The upstream's own state: compensations ran, newest first, once each.
    assert world.log() == [
        "create_ticket",
        "charge",
        "charge",
        "refund",
        "delete_ticket",
    ]
    state = world.state()
    assert state["tickets"] == {} and state["refunds"] == ["CH-1"]
    assert receipt["status"] == "COMPENSATED"
    assert [(s["tool"], s["disposition"]) for s in receipt["steps"]] == [
        ("create_ticket", "COMPENSATED"),
        ("charge", "COMPENSATED"),
        ("charge", "NOT_COMMITTED"),
    ]


def test_an_irreversible_call_asks_through_elicitation_R7(world: World) -> None:
    asked: list[str] = []

    async def approve(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"approve": True})

    async def run() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with world.proxy(elicit=approve) as session:
            await session.call_tool("create_ticket", {"title": "refund me"})
            sent = await session.call_tool("send_email", {"to": "ann@example.com", "body": "hi"})
            await session.call_tool("saga_commit", {})
            return sent, await _receipt(session)

    sent, receipt = asyncio.run(run())
    assert not sent.is_error
    assert sent.structured_content == {"result": "sent to ann@example.com"}
    assert len(asked) == 1 and "IRREVERSIBLE" in asked[0]
    assert receipt["status"] == "COMPLETED"
    assert [(a["decision"], a["by"][:8]) for a in receipt["approvals"]] == [("GRANTED", "mcp-user")]
    assert world.state()["emails"] == [{"to": "ann@example.com", "body": "hi"}]


def test_without_elicitation_an_irreversible_call_awaits_approval_and_the_saga_stays_open_R7(
    world: World,
) -> None:
    async def run() -> dict[str, Any]:
        async with world.proxy() as session:
            await session.call_tool("create_ticket", {"title": "keep me"})
            waiting = await session.call_tool("send_email", {"to": "bob@example.com", "body": "x"})
            assert not waiting.is_error
            status = waiting.structured_content
            assert status is not None and status["status"] == "awaiting_approval"
            assert _text(waiting).startswith("awaiting approval")
            assert world.state()["emails"] == []  # not sent, and nothing was undone
            assert list(world.state()["tickets"]) == ["T-1"]
            request = next(
                r
                for r in LedgerReader(world.bootstrap).saga_records(
                    world.settings.topics.events,
                    status["saga_id"],
                    world.settings.signer(),
                )
                if isinstance(r, ApprovalRequested)
            )
            channel = OperatorChannel.from_settings(world.settings, world.bootstrap)
            grant_approval(channel, request, operator="ops:carol")
            channel.close()
            await session.call_tool("saga_commit", {})
            return await _receipt(session)

    receipt = asyncio.run(run())
    assert receipt["status"] == "COMPLETED"
    assert world.state()["emails"] == [{"to": "bob@example.com", "body": "x"}]


def test_a_write_after_a_step_awaiting_approval_is_refused_not_taken_for_unknown_R7(
    world: World,
) -> None:
    """Each step follows the one before it, so a write made while an IRREVERSIBLE step
    waits for a person (the agent was told the saga stays open) waited behind it: no
    outcome within the client's wait, told "the outcome is unknown: it may have
    happened" (it had not), and the whole saga aborted, every effect undone. It is
    refused at once, nothing called, saying what it waits for; once the step is
    approved and done, writes go on."""

    async def run() -> tuple[types.CallToolResult, types.CallToolResult, dict[str, Any]]:
        async with world.proxy() as session:
            await session.call_tool("create_ticket", {"title": "keep me"})
            waiting = await session.call_tool("send_email", {"to": "bob@example.com", "body": "x"})
            status = waiting.structured_content
            assert status is not None and status["status"] == "awaiting_approval", waiting
            blocked = await session.call_tool("charge", {"amount": 40})
            events = world.settings.topics.events
            signer = world.settings.signer()
            request = next(
                r
                for r in LedgerReader(world.bootstrap).saga_records(
                    events, status["saga_id"], signer
                )
                if isinstance(r, ApprovalRequested)
            )
            channel = OperatorChannel.from_settings(world.settings, world.bootstrap)
            grant_approval(channel, request, operator="ops:carol")
            channel.close()
            wait_until(lambda: world.state()["emails"], what="the approved email")
            paid = await session.call_tool("charge", {"amount": 40})
            await session.call_tool("saga_commit", {})
            return blocked, paid, await _receipt(session)

    blocked, paid, receipt = asyncio.run(run())
    assert world.log() == ["create_ticket", "send_email", "charge"]  # nothing undone
    assert blocked.is_error and "nothing was called" in _text(blocked), _text(blocked)
    assert "02-send_email" in _text(blocked), _text(blocked)
    assert paid.structured_content == {"charge_id": "CH-1", "amount": 40}, _text(paid)
    assert receipt["status"] == "COMPLETED"


def _proxy_pids() -> list[int]:
    """The proxy processes this test started (children of this process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"proxy" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_a_proxy_killed_mid_saga_continues_it_after_a_restart(world: World) -> None:
    async def first_life() -> None:
        with suppress(BaseException):  # the session dies with its server
            async with world.proxy() as session:
                await session.call_tool("create_ticket", {"title": "survive"})
                await session.call_tool("charge", {"amount": 70})
                (pid,) = _proxy_pids()
                os.kill(pid, signal.SIGKILL)
                await session.call_tool("list_tickets", {})

    async def second_life() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with world.proxy() as session:
            failed = await session.call_tool("charge", {"amount": 9999})
            return failed, await _receipt(session)

    asyncio.run(first_life())
    failed, receipt = asyncio.run(second_life())
    assert failed.is_error
    # Nothing lost (both earlier effects undone), nothing run twice.
    assert world.log() == ["create_ticket", "charge", "charge", "refund", "delete_ticket"]
    assert receipt["status"] == "COMPENSATED"
    assert [s["tool"] for s in receipt["steps"]] == ["create_ticket", "charge", "charge"]


async def _a_second_proxy_while_the_first_serves(
    world: World, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], int, types.CallToolResult]:
    """A second proxy (in ``env``) started while the first serves with its saga open:
    the second's run, the first's pid, and the first's saga_commit after it."""

    def second() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", "mcp", "proxy", str(world.declaration)],
            env=env,
            cwd=str(ROOT),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )

    async with world.proxy() as session:
        # The first proxy serves (its saga open) before the second starts.
        opened = await session.call_tool("create_ticket", {"title": "mine"})
        assert not opened.is_error, _text(opened)
        (pid,) = _proxy_pids()
        refused = await asyncio.to_thread(second)
        still = await session.call_tool("saga_commit", {})
        return refused, pid, still


def test_a_second_proxy_for_the_same_participant_and_state_is_refused_not_sharing_its_saga(
    world: World,
) -> None:
    """Two proxies for one participant with one state directory kept their open sagas
    in the same mcp-session.json and overwrote each other's saga id: a restart of
    either continued the other's saga (its writes, its commit). The second is refused
    at start (exit 2, naming the running one's pid); a restart after the first is
    gone (even killed: the test above) is not held up."""
    refused, pid, committed = asyncio.run(_a_second_proxy_while_the_first_serves(world, world.env))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"pid {pid}" in refused.stderr and "already" in refused.stderr, refused.stderr[-2000:]
    assert json.loads(_text(committed))["status"] == "COMPLETED", _text(committed)

    async def restarted() -> dict[str, Any]:
        async with world.proxy() as session:
            return await _receipt(session)

    assert asyncio.run(restarted())["status"] == "NO_SAGA"


def test_a_second_proxy_for_the_same_participant_with_its_own_state_is_refused_at_once(
    world: World, tmp_path: Path
) -> None:
    """A second proxy for one participant with another state directory passed the
    state lock, and its runtime joined as the first's static group member: the two
    fenced each other's consumer (the first one's tools stopped being served, with no
    word of why). It exits 2 at once now, naming the first proxy's pid; the first
    serves on."""
    env = {**world.env, "SAGALINE_STATE_DIR": str(tmp_path / "other-state")}
    refused, pid, committed = asyncio.run(_a_second_proxy_while_the_first_serves(world, env))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert f"another process (pid {pid})" in refused.stderr, refused.stderr[-2000:]
    assert "already served" in refused.stderr, refused.stderr[-2000:]
    assert json.loads(_text(committed))["status"] == "COMPLETED", _text(committed)


def _proxy_start(
    kafka_bootstrap: str,
    prefix: str,
    tmp_path: Path,
    *,
    code: str = "",
    partitions: int = 1,
    state_dir: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``sagaline mcp proxy`` run to its end with no agent (stdin closed), after
    ``code`` (run first in the same process: a fault put in its way)."""
    run = "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", f"{code}\n{run}", "mcp", "proxy", str(_declaration(tmp_path))],
        env={
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "SAGALINE_TOPIC_PREFIX": prefix,
            "SAGALINE_PARTITIONS": str(partitions),
            "SAGALINE_STATE_DIR": str(state_dir or tmp_path / "state"),
            "DESK_STATE": str(tmp_path / "desk.json"),
            "PYTHONPATH": str(ROOT),
        },
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_proxy_whose_participant_runtime_cannot_start_says_why_in_one_line(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The participant runtime refused at start (here: the topics have 1 partition and
    SAGALINE_PARTITIONS says 2) was a RuntimeError's traceback, exit 1, where
    `participant run` says the same refusal in one line with exit 2. The proxy says it
    in one line now, naming the setting to fix, exit 2."""
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=unique_prefix, partitions=1)
    ensure_topics(kafka_bootstrap, settings.topics, ["desk-proxy"], 1)
    done = _proxy_start(kafka_bootstrap, unique_prefix, tmp_path, partitions=2)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sagaline mcp proxy: cannot start: "), done.stderr[-3000:]
    assert "SAGALINE_PARTITIONS=1" in last, done.stderr[-3000:]


class _RuntimeThatDoesNotStart:
    """A participant runtime whose start hangs (a broker that accepts connections and
    never answers) until it is stopped."""

    def __init__(self, released: threading.Event) -> None:
        self.released = released

    def run(self, *, ready: threading.Event) -> None:
        self.released.wait()  # never sets ready: its start has not ended

    def stop(self) -> None:
        self.released.set()


def test_a_participant_runtime_that_does_not_start_in_time_is_said_in_one_line(
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A runtime not serving after the start wait was a RuntimeError's traceback,
    exit 1, where the proxy's other start failures are one line with exit 2. Now one
    line too, exit 2, naming what did not start and what to check."""
    from sagaline.agents import mcp_proxy

    released = threading.Event()
    monkeypatch.setattr(
        mcp_proxy, "ParticipantRuntime", lambda *a: _RuntimeThatDoesNotStart(released)
    )
    monkeypatch.setattr(mcp_proxy, "RUNTIME_START_WAIT_S", 0.05)  # its start never ends
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DESK_STATE", str(tmp_path / "desk.json"))
    try:
        code = mcp_proxy.main(_declaration(tmp_path))
    finally:
        released.set()  # the fake's start ends, whatever happened
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "sagaline mcp proxy: cannot start: the participant runtime of desk-proxy did not start"
    ), last
    assert kafka_bootstrap in last and f"{unique_prefix}sagaline.commands.desk-proxy" in last, last


def test_a_proxy_whose_saga_client_cannot_start_says_why_in_one_line(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The saga client's start refused by the broker (here: no Describe on the ledger
    for this principal, as a credential without that ACL gets) was a traceback, exit
    1. One line now, naming the topic and the ACLs to grant, exit 2; the runtime
    started before it is stopped (the process ends)."""
    code = (
        "from participants.client import SagaClient\n"
        "from sagaline.kafka import TopicNotAuthorized\n"
        "def refused(self):\n"
        "    raise TopicNotAuthorized(f'topic {self.topics.events!r}: Topic authorization"
        " failed')\n"
        "SagaClient._end_positions = refused"
    )
    done = _proxy_start(kafka_bootstrap, unique_prefix, tmp_path, code=code)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sagaline mcp proxy: cannot start: the saga client"), last
    assert f"{unique_prefix}sagaline.events" in last and "authorization" in last, last


def test_a_bug_in_the_saga_clients_start_keeps_its_traceback(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Only a start the broker or the topics refuse is one line with exit 2: a
    RuntimeError of the client's start that is no such refusal (a bug) was said as
    "cannot start: <its message>", exit 2, its type and traceback gone. It keeps
    them, for its report."""
    code = (
        "from participants.client import SagaClient\n"
        "def broken(self):\n"
        "    raise RuntimeError('dictionary changed size during iteration')\n"
        "SagaClient._end_positions = broken"
    )
    done = _proxy_start(kafka_bootstrap, unique_prefix, tmp_path, code=code)
    assert done.returncode != 2, done.stderr[-3000:]
    assert "Traceback" in done.stderr and "_end_positions" in done.stderr, done.stderr[-3000:]
    assert "cannot start" not in done.stderr, done.stderr[-3000:]


def test_a_proxy_whose_state_directory_cannot_be_used_says_so_in_one_line(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """SAGALINE_STATE_DIR naming a file (a typo, a volume mounted wrong): the proxy
    ended with NotADirectoryError's traceback, exit 1, where `participant run` says
    "cannot use DIR (SAGALINE_STATE_DIR): Not a directory", exit 2. So does the proxy."""
    not_a_dir = tmp_path / "state-file"
    not_a_dir.write_text("")
    done = _proxy_start(kafka_bootstrap, unique_prefix, tmp_path, state_dir=not_a_dir)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sagaline mcp proxy: cannot start: cannot use "), last
    assert f"{not_a_dir / 'desk-proxy'} (SAGALINE_STATE_DIR)" in last, last


def test_a_proxy_whose_command_journal_cannot_be_opened_says_so_in_one_line(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The command journal SQLite cannot open (here a directory in its place): a
    sqlite3 traceback, exit 1, where `participant run` names the file, exit 2."""
    journal = tmp_path / "state" / "desk-proxy" / "commands.sqlite"
    journal.mkdir(parents=True)
    done = _proxy_start(kafka_bootstrap, unique_prefix, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"sagaline mcp proxy: cannot start: cannot open the command journal {journal}"
    ), last


def test_a_proxy_with_identity_keys_says_in_one_line_why_it_cannot_sign(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """The proxy writes as the saga's agent and as the participant serving its tools;
    one identity key signs for one identity of one role. With a participant's key its
    runtime started and its saga client's records were all refused (each call waited
    its whole timeout); now it is refused at start, in one line, exit 2."""
    from schemas.trust import Role
    from tests.trust_kit import TrustKit

    kit = TrustKit(tmp_path / "trust")
    kid = kit.add("desk-proxy", Role.PARTICIPANT)
    env = {
        "SAGALINE_TRUST_FILE": str(kit.trust_file),
        "SAGALINE_SIGNING_KEY": str(kit.key_files[kid]),
    }
    done = _proxy_start(
        kafka_bootstrap, unique_prefix, tmp_path, code=f"import os; os.environ.update({env!r})"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sagaline mcp proxy: cannot start: SAGALINE_TRUST_FILE is set"), last
    assert "'desk-proxy'" in last and "two processes" in last, last
    assert not (tmp_path / "state" / "desk-proxy" / "commands.sqlite").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_an_upstream_over_streamable_http_is_compensated_the_same_way(
    world: World, tmp_path: Path
) -> None:
    port = _free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(UPSTREAM)],
        env={**world.env, "DESK_HTTP_PORT": str(port)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert upstream.stderr is not None
        for line in upstream.stderr:  # uvicorn says when it listens
            if "running on" in line.lower() or "startup complete" in line.lower():
                break
        else:
            pytest.fail(f"the HTTP upstream exited {upstream.wait()}")
        text = world.declaration.read_text()
        start = text.index("  desk:\n")
        end = text.index("tools:")
        world.declaration.write_text(
            text[:start] + f"  desk: {{url: 'http://127.0.0.1:{port}/mcp'}}\n" + text[end:]
        )

        async def run() -> types.CallToolResult:
            async with world.proxy() as session:
                await session.call_tool("create_ticket", {"title": "over http"})
                return await session.call_tool("charge", {"amount": 4000})

        failed = asyncio.run(run())
    finally:
        upstream.terminate()
        upstream.wait(30)
    assert failed.is_error
    assert world.log() == ["create_ticket", "charge", "delete_ticket"]
    assert world.state()["tickets"] == {}


def test_a_proxy_killed_during_an_upstream_call_reconciles_it_by_lookup_R11(
    world: World,
) -> None:
    """The upstream acted but the proxy died before the answer: after the restart the
    step is looked up by its idempotency key (find_ticket), not run again."""
    # A generous deadline: the call must be in flight, not timed out, when killed.
    world.declaration.write_text(
        world.declaration.read_text().replace(
            "    resources: [tickets]\n", "    resources: [tickets]\n    deadline: 600\n"
        )
    )

    async def first_life() -> None:
        with suppress(BaseException):  # the session dies with its server
            async with world.proxy() as session:
                call = asyncio.ensure_future(
                    session.call_tool("create_ticket", {"title": "hang on"})
                )
                await asyncio.to_thread(
                    wait_until,
                    lambda: world.desk.exists() and world.state()["tickets"],
                    120,
                    "the upstream created the ticket",
                )
                (pid,) = _proxy_pids()
                os.kill(pid, signal.SIGKILL)
                await call

    async def second_life() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with world.proxy() as session:
            failed = await session.call_tool("charge", {"amount": 9999})
            return failed, await _receipt(session)

    asyncio.run(first_life())
    failed, receipt = asyncio.run(second_life())
    assert failed.is_error
    # Created once (reconciled, not re-run), then undone by its looked-up result.
    assert world.log() == ["create_ticket", "charge", "delete_ticket"]
    assert world.state()["tickets"] == {}
    assert receipt["status"] == "COMPENSATED"
    steps = {s["tool"]: s for s in receipt["steps"]}
    assert steps["create_ticket"]["disposition"] == "COMPENSATED"
    records = LedgerReader(world.bootstrap).saga_records(
        world.settings.topics.events, receipt["saga_id"], world.settings.signer()
    )
    reconciled = [r for r in records if isinstance(r, StepReconciled)]
    assert [(r.step_id, r.outcome.value) for r in reconciled] == [("01-create_ticket", "COMMITTED")]


def test_a_saga_that_ended_while_the_proxy_was_down_is_not_continued(world: World) -> None:
    async def first_life() -> str:
        with suppress(BaseException):
            async with world.proxy() as session:
                # Waits for approval: nothing committed, so an abort ends it at once.
                await session.call_tool("send_email", {"to": "x@example.com", "body": "?"})
                opened = await _receipt(session)
                assert opened["status"] == "OPEN"
                (pid,) = _proxy_pids()
                os.kill(pid, signal.SIGKILL)
                await session.call_tool("list_tickets", {})
        return str(opened["saga_id"])

    saga_id = asyncio.run(first_life())
    # Someone ends it meanwhile (an abort on the ledger, as any client could).
    client = SagaClient(world.settings, world.bootstrap)
    client.start()
    try:
        client.saga("helpdesk", "agent:helpdesk", saga_id=saga_id).end(
            SagaOutcome.ABORT, "operator gave up"
        )
        wait_until(
            lambda: any(
                isinstance(r, SagaTerminal)
                for r in LedgerReader(world.bootstrap).saga_records(
                    world.settings.topics.events, saga_id, world.settings.signer()
                )
            ),
            120,
            "the saga to end",
        )
    finally:
        client.close()

    async def second_life() -> tuple[dict[str, Any], dict[str, Any]]:
        async with world.proxy() as session:
            before = await _receipt(session)  # the ended saga's receipt
            await session.call_tool("create_ticket", {"title": "fresh"})
            return before, await _receipt(session)

    before, after = asyncio.run(second_life())
    assert (before["saga_id"], before["status"]) == (saga_id, "COMPENSATED")
    assert after["status"] == "OPEN" and after["saga_id"] != saga_id  # a new saga
    assert world.log() == ["create_ticket"]  # the email was never sent


# ------------------------------------------------------------ the declaration


def test_a_typo_in_the_declaration_is_refused_naming_tool_and_name(
    world: World, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        world.declaration.read_text().replace("{tool: delete_ticket,", "{tool: delete_tiket,")
    )
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "mcp", "proxy", str(bad)],
        env=world.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert (
        "tool 'create_ticket': compensation names 'delete_tiket', which upstream 'desk'"
        " does not list; did you mean 'delete_ticket'?"
    ) in done.stderr


DESK = [
    UpstreamTool(
        "create_ticket",
        "desk",
        {"properties": {"title": {}, "request_id": {}}},
        {"properties": {"id": {}, "title": {}}},
    ),
    UpstreamTool(
        "delete_ticket", "desk", {"properties": {"ticket_id": {}}, "required": ["ticket_id"]}
    ),
    UpstreamTool("send_email", "desk", {"properties": {"to": {}, "body": {}}}),
]


def _decl(tools: dict[str, Any], source: str = "declaration", **extra: Any) -> Any:
    data = {"upstreams": {"desk": {"command": "x"}}, "tools": tools, **extra}
    return parse_declaration(data, source)


def test_a_write_tool_without_mapping_is_refused() -> None:
    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}}
            }
        }
    )
    assert check(decl, DESK) == [
        "upstream 'desk' tool 'send_email' has no declaration: add it under tools: with"
        " compensation:, reversibility: IRREVERSIBLE or read_only: true, or list it under"
        " internal:"
    ]


def test_arguments_that_cannot_be_built_are_refused() -> None:
    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.ident}"}}
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        }
    )
    assert check(decl, DESK) == [
        "tool 'create_ticket': compensation delete_ticket: {result.ident} names 'ident',"
        " which the output schema of create_ticket does not have"
    ]


def test_unknown_keys_and_template_roots_are_refused() -> None:
    with pytest.raises(DeclarationError) as err:
        _decl(
            {
                "send_email": {"reversibilty": "IRREVERSIBLE"},
                "create_ticket": {
                    "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{reslt.id}"}}
                },
            }
        )
    message = str(err.value)
    assert "tool 'send_email': unknown key 'reversibilty'; did you mean 'reversibility'?" in message
    assert "template {reslt.id} names 'reslt'" in message and "did you mean 'result'?" in message


def test_a_lookup_built_from_more_than_the_idempotency_key_is_refused() -> None:
    """A lookup runs with the idempotency key alone (no input, result or saga id): a
    template naming them would fail at reconciliation ({input.title}) or send the
    upstream an empty value ({saga_id}), and the committed call would be taken for
    one that never ran, its effect never undone."""
    find = UpstreamTool(
        "find_ticket", "desk", {"properties": {"request_id": {}, "title": {}, "saga": {}}}
    )
    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}},
                "lookup": {
                    "tool": "find_ticket",
                    "args": {
                        "request_id": "{idempotency_key}",
                        "title": "{input.title}",
                        "saga": "{saga_id}",
                    },
                },
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        }
    )
    problems = check(decl, [*DESK, find])
    assert any("lookup find_ticket" in p and "{input.title}" in p for p in problems), problems
    assert any("lookup find_ticket" in p and "{saga_id}" in p for p in problems), problems
    assert not any("{idempotency_key} cannot" in p for p in problems), problems


def test_an_argument_named_like_a_saga_call_option_is_refused_not_obeyed(world: World) -> None:
    """``timeout_s`` (like ``step_id``, ``depends_on``) is an option of ``saga.call``,
    no upstream argument: sent by the model, it must not silently set the step's
    wait (nor reach saga.call at all); the call is refused and nothing runs."""

    async def run() -> types.CallToolResult:
        async with world.proxy() as session:
            await session.call_tool("create_ticket", {"title": "printer on fire"})
            return await session.call_tool("charge", {"amount": 40, "timeout_s": 30})

    refused = asyncio.run(run())
    assert refused.is_error and "timeout_s" in _text(refused), _text(refused)
    assert "charge" not in world.log()


def test_a_call_refused_before_anything_is_written_leaves_the_saga_usable(world: World) -> None:
    """Arguments the saga client refuses before writing anything (here over
    SAGALINE_MAX_ARGS_BYTES) ran nothing and have nothing to undo: the agent gets a
    tool error to correct, and the saga goes on with its earlier effects kept, instead
    of being aborted and every earlier effect compensated."""

    async def run() -> tuple[types.CallToolResult, dict[str, Any]]:
        async with world.proxy() as session:
            await session.call_tool("create_ticket", {"title": "keep me"})
            refused = await session.call_tool("create_ticket", {"title": "x" * 300_000})
            await session.call_tool("charge", {"amount": 40})
            await session.call_tool("saga_commit", {})
            return refused, await _receipt(session)

    refused, receipt = asyncio.run(run())
    assert world.log() == ["create_ticket", "charge"]  # nothing undone
    assert refused.is_error and "max_args_bytes" in _text(refused).lower(), _text(refused)
    assert "nothing was called" in _text(refused), _text(refused)
    assert receipt["status"] == "COMPLETED"
    assert [s["tool"] for s in receipt["steps"]] == ["create_ticket", "charge"]


def test_arguments_that_do_not_fit_the_tool_are_a_tool_error_not_an_aborted_saga(
    world: World,
) -> None:
    """A model that names an argument the tool does not take, or leaves out a
    required one, made the proxy schedule the step; the participant refused it (a
    business rejection) and the whole saga was aborted, every earlier effect undone.
    Nothing ran: the agent gets a tool error to correct and the saga goes on."""

    async def run() -> tuple[list[types.CallToolResult], dict[str, Any]]:
        async with world.proxy() as session:
            await session.call_tool("create_ticket", {"title": "keep me"})
            bad = [
                await session.call_tool("create_ticket", {"title": "t", "priority": "high"}),
                await session.call_tool("charge", {}),
            ]
            await session.call_tool("charge", {"amount": 40})
            await session.call_tool("saga_commit", {})
            return bad, await _receipt(session)

    bad, receipt = asyncio.run(run())
    assert world.log() == ["create_ticket", "charge"]  # nothing undone
    assert all(r.is_error and "nothing was called" in _text(r) for r in bad), [
        _text(r) for r in bad
    ]
    assert "priority" in _text(bad[0]) and "amount" in _text(bad[1])
    assert receipt["status"] == "COMPLETED"
    assert [s["tool"] for s in receipt["steps"]] == ["create_ticket", "charge"]


# ------------------------------------------------- the proxy's saga handling, in-process
# A fake saga client stands in for the ledger: these tests pin what the proxy does
# with each answer saga.call can give, which the broker cannot be made to give at will.


class FakeSaga:
    def __init__(self, saga_id: str, answer: BaseException | None) -> None:
        self.saga_id = saga_id
        self.answer = answer
        self.results: dict[str, Any] = {}
        self.calls: list[str] = []
        self.approval_wait_ran_out: list[bool] = []
        self.release = threading.Event()  # what would end a real wait: a record
        self.ended: list[SagaOutcome] = []
        self.attached_on_loop: list[bool] = []
        self.wakers: list[Any] = []  # the async waits on the saga, woken with release
        self.waits_in_threads: list[str] = []  # sync waits the proxy ran (in threads)

    def __enter__(self) -> FakeSaga:
        return self

    def attach(self) -> FakeSaga:
        # As the real one: reads the saga's records from the ledger, a blocking read.
        if self.saga_id in FakeClient.missing:
            from participants.client import InvalidSagaId

            raise InvalidSagaId(f"no saga {self.saga_id} on the ledger")
        try:
            asyncio.get_running_loop()
            self.attached_on_loop.append(True)
        except RuntimeError:
            self.attached_on_loop.append(False)
        return self

    def call(self, name: str, *, step_id: str, **args: Any) -> Any:
        self.calls.append(step_id)
        if self.answer is not None:
            raise self.answer
        return {"ok": step_id}

    def approval_request(self, step_id: str, timeout_s: float) -> None:
        # As the real one: waits up to timeout_s for the step's approval request or
        # end, records that never come for a step never written; then None.
        self.approval_wait_ran_out.append(not self.release.wait(timeout_s))

    async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
        return self.call(name, step_id=step_id, **args)

    async def aapproval_request(self, step_id: str, timeout_s: float) -> None:
        # As approval_request, as a future woken by the saga's records, not a thread.
        self.approval_wait_ran_out.append(not await self.released(timeout_s))

    async def await_terminal(self, timeout_s: float) -> Any:
        return await asyncio.to_thread(self.wait, timeout_s)

    async def released(self, timeout_s: float) -> bool:
        """Whether release came within timeout_s: an async wait, as the real client's."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with suppress(RuntimeError):  # its loop has closed since
                loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))

        self.wakers.append(wake)
        if self.release.is_set():
            wake()
        try:
            await asyncio.wait_for(woken, timeout_s)
        except TimeoutError:
            return False
        return True

    def let_go(self) -> None:
        """End every wait on the saga (sync and async)."""
        self.release.set()
        for wake in list(self.wakers):
            wake()

    def end(self, outcome: SagaOutcome, reason: str) -> None:
        self.ended.append(outcome)
        self.let_go()  # its terminal record ends every wait on the saga

    def wait(self, timeout_s: float) -> Any:
        from types import SimpleNamespace

        if not self.ended:  # as the real one: no receipt before the saga is ended
            raise TimeoutError(f"saga {self.saga_id} is not terminal after {timeout_s} s")
        text = json.dumps({"saga_id": self.saga_id, "status": "COMPENSATED"})
        return SimpleNamespace(model_dump_json=lambda indent: text)


class FakeClient:
    bootstrap = "unused:1"
    missing = frozenset({"s-gone"})  # saga ids with no start on the ledger

    def __init__(
        self, answer: BaseException | None = None, saga_type: type[FakeSaga] = FakeSaga
    ) -> None:
        self.answer = answer
        self.saga_type = saga_type  # what each of its sagas is
        self.sagas: list[FakeSaga] = []

    def saga(self, workflow: str, principal: str, *, saga_id: str | None = None) -> FakeSaga:
        saga = self.saga_type(saga_id or f"s-{len(self.sagas) + 1}", self.answer)
        self.sagas.append(saga)
        return saga


class AwaitsApproval(FakeSaga):
    """An IRREVERSIBLE step's saga: its approval is requested at once, and the step's
    wait lasts until a person answers (release), as the real client's does."""

    def call(self, name: str, *, step_id: str, **args: Any) -> Any:
        self.calls.append(step_id)
        self.waits_in_threads.append(step_id)
        self.release.wait(120)  # waits for a person, as the real call does
        return {"ok": step_id}

    def approval_request(self, step_id: str, timeout_s: float) -> Any:
        from types import SimpleNamespace

        self.waits_in_threads.append(f"approval of {step_id}")
        return SimpleNamespace(approval_id="ap-1", step_id=step_id)

    async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
        self.calls.append(step_id)
        await self.released(120)  # waits for a person, as the real call does
        return {"ok": step_id}

    async def aapproval_request(self, step_id: str, timeout_s: float) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(approval_id="ap-1", step_id=step_id)

    async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
        from participants.client import ApprovalPending

        if not self.release.is_set():  # the person has not answered
            where = {"saga_id": self.saga_id, "step_id": step_id, "tool": "send_email"}
            raise ApprovalPending("waits for approval ap-1", approval_id="ap-1", **where)
        return {"ok": step_id}


def _fake_proxy(
    tmp_path: Path,
    client: FakeClient,
    approval_wait_s: float = 600.0,
    settings: Settings | None = None,
    source: str = "declaration",
) -> Any:
    from sagaline.agents.mcp_proxy import McpProxy, Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}}
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        },
        source,
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = list(DESK)
    settings = settings or Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    catalogue = build_catalogue(decl, upstreams)
    return McpProxy(
        decl,
        upstreams,
        catalogue,
        client,
        settings,
        approval_wait_s=approval_wait_s,  # type: ignore[arg-type]
    )


def _no_elicitation() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(session=SimpleNamespace(client_capabilities=None))


def _params(name: str, args: dict[str, Any]) -> types.CallToolRequestParams:
    return types.CallToolRequestParams(name=name, arguments=args)


def _call(proxy: Any, name: str, args: dict[str, Any]) -> types.CallToolResult:
    params = _params(name, args)
    result: types.CallToolResult = asyncio.run(proxy._call_tool(_no_elicitation(), params))
    return result


def _resource(uri: str) -> types.ReadResourceRequestParams:
    return types.ReadResourceRequestParams(uri=uri)


def _fake_receipt(proxy: Any) -> dict[str, Any]:
    read = asyncio.run(proxy._read_resource(None, _resource(RECEIPT)))
    content = read.contents[0]
    assert isinstance(content, types.TextResourceContents)
    loaded: dict[str, Any] = json.loads(content.text)
    return loaded


def test_an_irreversible_call_refused_before_it_is_written_does_not_wait_for_an_approval(
    tmp_path: Path,
) -> None:
    """saga.call refuses the call (nothing written, so no approval can be asked): the
    proxy must answer at once, not wait approval_wait_s (600 s) for the request."""
    from participants.client import CallRefused

    refused = CallRefused(
        "arguments of send_email are 99999 bytes as JSON, over the limit",
        limit="max_args_bytes",
        size=99999,
        saga_id="s-1",
        step_id="01-send_email",
        tool="send_email",
    )
    client = FakeClient(refused)
    proxy = _fake_proxy(tmp_path, client)
    result = _call(proxy, "send_email", {"to": "a", "body": "x"})
    (saga,) = client.sagas
    assert True not in saga.approval_wait_ran_out, (
        "answered only after the wait for an approval that cannot come"
    )
    assert result.is_error and "over the limit" in _text(result), _text(result)


def test_steps_awaiting_approval_hold_no_thread_each_so_the_proxy_keeps_serving_R7(
    tmp_path: Path,
) -> None:
    """Without elicitation an IRREVERSIBLE call answers "awaiting approval" at once,
    but its step's wait goes on until a person answers (or the client's call
    timeout). Each such wait, and each wait for an approval request, was a thread of
    the event loop's default executor (min(32, CPUs + 4) of them), which every saga
    start, end and restart also needs: a few approvals nobody had answered yet took
    them all, and the proxy stopped answering. The waits are futures, not threads."""
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> list[types.CallToolResult]:
        try:
            results = []
            for name, args in [
                ("send_email", {"to": "c@example.com", "body": "b"}),
                ("saga_check_plan", {"calls": []}),
            ]:
                params = types.CallToolRequestParams(name=name, arguments=args)
                results.append(await proxy._call_tool(_no_elicitation(), params))
            return results
        finally:
            for saga in client.sagas:
                saga.let_go()

    waiting, served = asyncio.run(run())
    (saga,) = client.sagas
    assert (waiting.structured_content or {}).get("status") == "awaiting_approval", _text(waiting)
    assert served.content, "the session does not serve while the approval is awaited"
    assert saga.calls == ["01-send_email"]
    assert saga.waits_in_threads == [], "waits held a thread each"


def test_an_approval_given_after_the_steps_wait_ran_out_returns_the_steps_outcome_R7(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The person answers the elicitation after the step's own wait (the client's call
    timeout, 60 s; the form may stay up to 600 s) ran out with ApprovalPending. The
    approval is granted and the step runs, so the agent must get its outcome, not
    "awaiting approval ... it runs once approved" for a call already approved."""
    from types import SimpleNamespace

    import sagaline.ops.actions as actions
    from participants.client import ApprovalPending

    granted: list[str] = []
    monkeypatch.setattr(
        actions.OperatorChannel,
        "from_settings",
        classmethod(
            lambda cls, *a: SimpleNamespace(close=lambda: None, producer_for=lambda *a: None)
        ),
    )
    monkeypatch.setattr(
        actions, "grant_approval", lambda channel, request, **kw: granted.append(request.step_id)
    )
    asked = asyncio.Event()
    ran_out = asyncio.Event()

    class WaitRunsOut(AwaitsApproval):
        async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
            self.calls.append(step_id)
            await asyncio.wait_for(asked.wait(), 120)
            ran_out.set()  # the task ends with this raise, before the person answers
            raise ApprovalPending(
                "waits for approval ap-1",
                saga_id=self.saga_id,
                step_id=step_id,
                tool=name,
                approval_id="ap-1",
            )

        async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
            return {"ok": step_id} if step_id in granted else None

    async def elicit_form(message: str, schema: Any) -> Any:
        asked.set()
        await asyncio.wait_for(ran_out.wait(), 120)  # answered after the step's wait
        return SimpleNamespace(action="accept", content={"approve": True})

    ctx = SimpleNamespace(
        session=SimpleNamespace(
            client_capabilities=SimpleNamespace(elicitation=object()),
            client_params=None,
            elicit_form=elicit_form,
        )
    )
    client = FakeClient(saga_type=WaitRunsOut)
    proxy = _fake_proxy(tmp_path, client)
    params = types.CallToolRequestParams(name="send_email", arguments={"to": "a", "body": "b"})
    result = asyncio.run(proxy._call_tool(ctx, params))
    assert granted == ["01-send_email"]
    assert result.structured_content == {"ok": "01-send_email"}, _text(result)


def test_an_approval_denied_while_the_agent_waited_aborts_the_saga_at_the_next_write_R7(
    tmp_path: Path,
) -> None:
    """The step left awaiting approval is denied by a person (`sagaline deny`): the
    next write is not run behind it; it says so and the saga is aborted, as for a
    failed write, and the write after that starts a new saga."""
    from participants.client import ApprovalDeniedError

    class Denied(AwaitsApproval):
        async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
            where = {"saga_id": self.saga_id, "step_id": step_id, "tool": "send_email"}
            raise ApprovalDeniedError("approval for send_email denied by ops:carol", **where)

    class Client(FakeClient):
        def saga(self, workflow: str, principal: str, *, saga_id: str | None = None) -> FakeSaga:
            kind = Denied if not self.sagas else FakeSaga
            saga = kind(saga_id or f"s-{len(self.sagas) + 1}", None)
            self.sagas.append(saga)
            return saga

    client = Client()
    proxy = _fake_proxy(tmp_path, client)
    waiting = _call(proxy, "send_email", {"to": "a", "body": "b"})
    assert (waiting.structured_content or {}).get("status") == "awaiting_approval"
    failed = _call(proxy, "create_ticket", {"title": "t"})
    assert failed.is_error and "denied by ops:carol" in _text(failed), _text(failed)
    first = client.sagas[0]
    assert first.calls == ["01-send_email"] and first.ended == [SagaOutcome.ABORT]
    again = _call(proxy, "create_ticket", {"title": "t"})
    assert again.structured_content == {"ok": "01-create_ticket"}
    first.let_go()


def test_a_restarted_proxy_remembers_the_step_awaiting_approval_R7(tmp_path: Path) -> None:
    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-1", "next_step": 3, "awaiting": ["02-send_email"]}))
    client = FakeClient(saga_type=AwaitsApproval)
    refused = _call(_fake_proxy(tmp_path, client), "create_ticket", {"title": "t"})
    assert refused.is_error and "02-send_email" in _text(refused), _text(refused)
    assert "nothing was called" in _text(refused) and client.sagas[0].calls == []


def test_a_request_cancelled_while_the_saga_is_resumed_does_not_start_a_second_resume(
    tmp_path: Path,
) -> None:
    """The one-time resume of the saga on disk (a ledger read, in a thread) belonged to
    the request that began it: cancelled meanwhile (an MCP client's request timeout, on
    a receipt read now served outside the step lock), it let go of the resume lock with
    the thread still reading, and never marked the saga resumed. The next request began
    a second resume of its own, beside the first: the saga attached (read from the
    ledger) twice, two threads writing the session at once. The resume under way is
    awaited instead, and done once."""
    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-1", "next_step": 3}))
    reading = threading.Event()
    read_on = threading.Event()

    class SlowAttach(FakeSaga):
        def attach(self) -> FakeSaga:
            reading.set()
            read_on.wait(60)  # the ledger read, still going when the request is cancelled
            return super().attach()

    client = FakeClient(saga_type=SlowAttach)
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> types.CallToolResult:
        first = asyncio.ensure_future(proxy._read_resource(None, _resource(RECEIPT)))
        assert await asyncio.to_thread(reading.wait, 60)
        first.cancel()
        with suppress(asyncio.CancelledError):
            await first
        params = types.CallToolRequestParams(name="create_ticket", arguments={"title": "t"})
        write = asyncio.ensure_future(proxy._call_tool(_no_elicitation(), params))
        read_on.set()
        return await asyncio.wait_for(write, 60)

    result = asyncio.run(run())
    assert [s.saga_id for s in client.sagas] == ["s-1"], "attached more than once"
    assert result.structured_content == {"ok": "03-create_ticket"}, _text(result)
    assert client.sagas[0].calls == ["03-create_ticket"]


def test_a_result_over_the_limit_is_a_tool_error_that_keeps_the_committed_effect(
    tmp_path: Path,
) -> None:
    """The upstream call ran and committed, but its result was over
    SAGALINE_MAX_RESULT_BYTES: the client raises ResultTooLarge (the effect exists; an
    incident names it). The proxy took it for a failed write and aborted the saga,
    undoing the effect that succeeded and every earlier one. The agent gets an error
    saying the call happened (not to repeat it) and the saga stays open."""
    from participants.client import ResultTooLarge

    too_large = ResultTooLarge(
        "create_ticket committed but its result (300000 bytes) is over the limit of"
        " 262144 bytes, so it is not on the ledger",
        saga_id="s-1",
        step_id="01-create_ticket",
        tool="create_ticket",
    )
    client = FakeClient(too_large)
    proxy = _fake_proxy(tmp_path, client)
    first = _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas
    assert saga.ended == [], "the saga was ended (aborted) for a step that committed"
    text = _text(first)
    assert first.is_error and "committed" in text and "over the limit" in text, text
    assert "do not call" in text, text
    saga.answer = None
    second = _call(proxy, "create_ticket", {"title": "u"})
    assert second.structured_content == {"ok": "02-create_ticket"}  # the same saga went on
    assert [s.saga_id for s in client.sagas] == ["s-1"]


def test_a_parked_saga_is_said_parked_for_a_person_not_aborted_and_compensated(
    tmp_path: Path,
) -> None:
    """The coordinator parked the saga (SagaParked): it decides nothing more for it, so
    an abort would go to the DLQ and no receipt would come. The proxy asked for one
    anyway, waited for a receipt that never comes, and told the agent the saga "was
    aborted and its earlier effects compensated": nothing was undone. It must say the
    saga is parked for a person, ask for no end, and let go of it (the next write
    starts a new saga)."""
    from participants.client import SagaParked

    parked = SagaParked(
        "the coordinator could not write saga s-1's state (over the limit)",
        saga_id="s-1",
        step_id="01-create_ticket",
        tool="create_ticket",
    )
    client = FakeClient(parked)
    proxy = _fake_proxy(tmp_path, client)
    result = _call(proxy, "create_ticket", {"title": "t"})
    text = _text(result)
    (saga,) = client.sagas
    assert saga.ended == [], "an end was asked of a parked saga"
    assert result.is_error and "parked" in text and "compensated" not in text, text
    assert "s-1" in text and "sagaline saga show s-1" in text, text
    receipt = _fake_receipt(proxy)
    assert receipt["status"] == "PARKED" and receipt["saga_id"] == "s-1", receipt
    client.answer = None
    again = _call(proxy, "create_ticket", {"title": "u"})
    assert again.structured_content == {"ok": "01-create_ticket"}, _text(again)
    assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]


def test_reading_an_unknown_resource_is_a_clear_invalid_params_error_not_a_crash(
    tmp_path: Path,
) -> None:
    """A resource URI the proxy does not serve raised ValueError from the handler: the
    MCP server logged it as a crash (a traceback in the proxy's log) and answered with
    code 0. It is the client's mistake: an INVALID_PARAMS error naming the URI and what
    the proxy serves."""
    from mcp.shared.exceptions import MCPError

    proxy = _fake_proxy(tmp_path, FakeClient())
    with pytest.raises(MCPError) as raised:
        asyncio.run(proxy._read_resource(None, _resource("sagaline://saga/reciept")))
    assert raised.value.error.code == types.INVALID_PARAMS, raised.value.error
    message = raised.value.error.message
    assert "sagaline://saga/reciept" in message and RECEIPT in message, message


def test_a_misspelt_tool_is_a_tool_error_naming_the_tool_it_may_have_meant(
    tmp_path: Path,
) -> None:
    """A tool name the proxy does not serve was answered "unknown tool 'x'" and
    nothing else. Like the saga client's UnknownTool, the answer names the close
    names, and says where the proxy's tools come from: its declaration's tools:."""
    proxy = _fake_proxy(tmp_path, FakeClient(), source="/etc/sagaline/desk.yaml")
    result = _call(proxy, "create_tikcet", {})
    assert result.is_error, result
    said = _text(result)
    assert "did you mean 'create_ticket'?" in said, said
    assert "tools:" in said and "/etc/sagaline/desk.yaml" in said, said


def test_a_tool_nothing_like_a_served_one_is_answered_with_the_tools_served(
    tmp_path: Path,
) -> None:
    """No close name: the answer lists what the proxy serves (its declared tools and
    the saga tools), so the agent need not list the tools again to know."""
    proxy = _fake_proxy(tmp_path, FakeClient())
    result = _call(proxy, "weather", {})
    assert result.is_error, result
    said = _text(result)
    for served in ("'create_ticket'", "'send_email'", "'saga_commit'", "'saga_abort'"):
        assert served in said, said
    assert "'delete_ticket'" not in said, said  # a compensation, not served to the agent
    assert "tools:" in said, said


def test_a_call_of_a_tool_only_the_proxy_calls_says_it_is_not_served(tmp_path: Path) -> None:
    """A compensation tool called by name is no typo of a served one: the answer says
    the proxy calls it itself, not a close served name (create_ticket for delete_ticket)."""
    proxy = _fake_proxy(tmp_path, FakeClient())
    result = _call(proxy, "delete_ticket", {})
    assert result.is_error, result
    said = _text(result)
    assert "not served to the agent" in said and "compensation" in said, said
    assert "create_ticket" not in said, said


def test_a_timed_out_step_is_reported_as_an_unknown_outcome_not_as_a_failure_R11(
    tmp_path: Path,
) -> None:
    from participants.client import OutcomeUnknown

    client = FakeClient(
        OutcomeUnknown(
            "no outcome for create_ticket within 60.0 s",
            saga_id="s-1",
            step_id="01-create_ticket",
            tool="create_ticket",
        )
    )
    result = _call(_fake_proxy(tmp_path, client), "create_ticket", {"title": "t"})
    text = _text(result)
    assert result.is_error and "unknown" in text and "failed" not in text, text
    assert client.sagas[0].ended == [SagaOutcome.ABORT]  # undone if it did happen


def test_a_step_the_ledger_did_not_acknowledge_is_an_unknown_outcome_not_a_crash(
    tmp_path: Path,
) -> None:
    """DeliveryFailed: the StepScheduled may still reach the ledger and the step run.
    The agent gets a tool result saying so (not a protocol error), the saga is aborted
    so the step is undone if it runs, and the next call starts afresh."""
    from sagaline.kafka import DeliveryFailed

    client = FakeClient(
        DeliveryFailed("no acknowledgement within 60 s", topic="sagaline.events", error=None)
    )
    proxy = _fake_proxy(tmp_path, client)
    result = _call(proxy, "create_ticket", {"title": "t"})
    text = _text(result)
    assert result.is_error and "unknown" in text and "may have happened" in text, text
    assert client.sagas[0].ended == [SagaOutcome.ABORT]
    client.answer = None
    _call(proxy, "create_ticket", {"title": "t"})
    assert [s.calls for s in client.sagas] == [["01-create_ticket"], ["01-create_ticket"]]


def test_restarting_does_not_read_the_ledger_on_the_event_loop(tmp_path: Path) -> None:
    """The saga remembered on disk is checked on the ledger at start-up (attach()): a
    blocking read, which must not stall the event loop the upstream sessions run on."""
    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-7", "next_step": 3}))
    client = FakeClient()

    async def start_and_call() -> types.CallToolResult:
        proxy = _fake_proxy(tmp_path, client)
        params = types.CallToolRequestParams(name="create_ticket", arguments={"title": "t"})
        result: types.CallToolResult = await proxy._call_tool(_no_elicitation(), params)
        return result

    result = asyncio.run(start_and_call())
    assert [s.attached_on_loop for s in client.sagas] == [[False]]
    assert result.structured_content == {"ok": "03-create_ticket"}  # the saga continued
    assert [s.saga_id for s in client.sagas] == ["s-7"]


def test_a_remembered_saga_missing_from_the_ledger_is_dropped_and_a_new_one_started(
    tmp_path: Path,
) -> None:
    """The saga remembered on disk is not on the ledger (no start: another cluster, a
    topic recreated, past retention): attach() refuses it, and the proxy forgets it
    and starts a new saga on the next write instead of failing every request."""
    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-gone", "next_step": 3}))
    client = FakeClient()

    async def start_and_call() -> types.CallToolResult:
        proxy = _fake_proxy(tmp_path, client)
        params = types.CallToolRequestParams(name="create_ticket", arguments={"title": "t"})
        result: types.CallToolResult = await proxy._call_tool(_no_elicitation(), params)
        return result

    result = asyncio.run(start_and_call())
    assert result.structured_content == {"ok": "01-create_ticket"}, result
    assert [s.saga_id for s in client.sagas] == ["s-gone", "s-2"]
    assert json.loads(state.read_text())["saga_id"] == "s-2"


# ------------------------------------- the proxy's upstream calls, in-process (no broker)

FIND = UpstreamTool("find_ticket", "desk", {"properties": {"request_id": {}}})


def _reconciling_upstreams(deadline: float = 10.0) -> tuple[Any, Any]:
    """Upstreams for create_ticket with an idempotency key, a compensation and a lookup,
    and the catalogue built on them."""
    from sagaline.agents.mcp_proxy import Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}},
                "lookup": {"tool": "find_ticket", "args": {"request_id": "{idempotency_key}"}},
                "idempotency_arg": "request_id",
                "deadline": deadline,
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [*DESK, FIND]
    return upstreams, build_catalogue(decl, upstreams)


def test_a_lookup_while_the_proxys_own_call_with_that_key_runs_answers_pending_R11() -> None:
    """The forward call overran its deadline (an unknown outcome) and the coordinator
    asks for a lookup while the proxy's upstream call with that key still runs. The
    upstream has not acted yet, so it would answer "not found", and the step be taken
    for one that never ran while its effect lands a moment later, unknown to the saga.
    While the call runs the lookup answers PENDING, so reconciliation asks again."""
    from participants.context import CallContext, call_context
    from schemas.models import ReconcileResult

    upstreams, catalogue = _reconciling_upstreams()
    tickets: dict[str, dict[str, str]] = {}  # request_id -> ticket: the upstream's state
    started = threading.Event()
    release = threading.Event()

    async def upstream_call(upstream: str, name: str, args: dict[str, Any]) -> Any:
        if name == "create_ticket":
            started.set()
            await asyncio.to_thread(release.wait)  # the upstream is slow to act
            tickets[args["request_id"]] = {"id": "T-1", "title": args["title"]}
            return tickets[args["request_id"]]
        assert name == "find_ticket"
        return tickets.get(args["request_id"], {})

    upstreams.call = upstream_call
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    upstreams.loop = loop
    forward_result: list[Any] = []

    def forward() -> None:
        ctx = CallContext("s-1", "01-create_ticket", "create_ticket", "key-1")
        with call_context(ctx):
            forward_result.append(catalogue["create_ticket"].invoke({"title": "t"}))

    forward_thread = threading.Thread(target=forward, daemon=True)
    forward_thread.start()
    try:
        assert started.wait(120), "the forward call never reached the upstream"
        during = catalogue["create_ticket"].lookup("key-1")
        release.set()
        forward_thread.join(120)
        after = catalogue["create_ticket"].lookup("key-1")
    finally:
        release.set()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(120)
        loop.close()
    assert during.status is ReconcileResult.PENDING, during
    assert forward_result == [{"id": "T-1", "title": "t"}]
    assert after.status is ReconcileResult.COMMITTED and after.result == forward_result[0]


def test_a_lookup_the_upstream_answers_with_an_error_is_no_not_found_R11() -> None:
    """The coordinator looks up a step whose outcome is unknown and the upstream's
    lookup answers with an error (a rate limit, a transient failure of its own): it
    could not tell, so the lookup must not say "not found" (the step would be taken for
    one that never ran: retried, its effect doubled, or left out of an unwind). It
    raises, which the participant runtime reports as PENDING (asked again, then a
    person). Only an error the declaration names as "not found" (``not_found:``),
    or an empty answer, is NOT_FOUND."""
    from sagaline.agents.mcp_proxy import UpstreamRejected, build_catalogue
    from schemas.models import ReconcileResult

    upstreams, catalogue = _reconciling_upstreams()
    answers = {
        "busy": "find_ticket: rate limited, retry in 30 s",
        "gone": "find_ticket: no ticket for gone",
    }

    def call_sync(upstream: str, name: str, args: dict[str, Any], timeout_s: float) -> Any:
        assert name == "find_ticket"
        key = args["request_id"]
        if key == "empty":
            return {}
        raise UpstreamRejected(answers[key])

    upstreams.call_sync = call_sync
    with pytest.raises(RuntimeError, match=r"could not tell.*rate limited"):
        catalogue["create_ticket"].lookup("busy")
    # Not said to be "not found" either, without a not_found: declared.
    with pytest.raises(RuntimeError, match="no ticket for"):
        catalogue["create_ticket"].lookup("gone")
    assert catalogue["create_ticket"].lookup("empty").status is ReconcileResult.NOT_FOUND

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}},
                "lookup": {
                    "tool": "find_ticket",
                    "args": {"request_id": "{idempotency_key}"},
                    "not_found": "no ticket for",
                },
                "idempotency_arg": "request_id",
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        },
        participant="fake-desk",
    )
    upstreams.declaration = decl
    declared = build_catalogue(decl, upstreams)
    assert declared["create_ticket"].lookup("gone").status is ReconcileResult.NOT_FOUND
    with pytest.raises(RuntimeError, match="rate limited"):
        declared["create_ticket"].lookup("busy")


def test_a_lookup_answering_its_declared_not_found_text_without_an_error_is_not_found_R11() -> None:
    """Many upstream tools say "not found" in a plain text answer, not an error
    (isError). With the lookup's not_found: text declared, such an answer was taken for
    a non-empty result, "it happened" (COMMITTED): a step that never ran was settled as
    done, never retried and its "result" (the not-found text) compensated. The declared
    text says "not found" in a text answer as in an error answer; any other text, and
    every answer of a lookup with no not_found:, is still COMMITTED."""
    from sagaline.agents.mcp_proxy import build_catalogue
    from schemas.models import ReconcileResult

    upstreams, plain = _reconciling_upstreams()
    answers: dict[str, Any] = {
        "gone": "no ticket for gone",
        "here": {"id": "T-1", "title": "t"},
        "text": "T-2 opened",
    }
    upstreams.call_sync = lambda upstream, name, args, timeout_s: answers[args["request_id"]]
    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}},
                "lookup": {
                    "tool": "find_ticket",
                    "args": {"request_id": "{idempotency_key}"},
                    "not_found": "no ticket for",
                },
                "idempotency_arg": "request_id",
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        },
        participant="fake-desk",
    )
    upstreams.declaration = decl
    declared = build_catalogue(decl, upstreams)
    assert declared["create_ticket"].lookup("gone").status is ReconcileResult.NOT_FOUND
    assert declared["create_ticket"].lookup("here").status is ReconcileResult.COMMITTED
    assert declared["create_ticket"].lookup("text").status is ReconcileResult.COMMITTED
    # Without not_found: a text answer cannot be told from a found operation's.
    assert plain["create_ticket"].lookup("gone").status is ReconcileResult.COMMITTED


def test_a_compensation_the_upstream_answers_with_an_error_is_retried_not_given_up_R8() -> None:
    """The upstream's compensation tool answers with an error (a rate limit, a failure
    of its own): it was taken for a business rejection, never retried, so one hiccup
    during an unwind left the effect uncompensated and handed to a person at once.
    Compensations are retried with backoff before they escalate (R8): the error is a
    transient failure of the compensation."""
    from sagaline.agents.mcp_proxy import UpstreamRejected

    upstreams, catalogue = _reconciling_upstreams()

    def call_sync(upstream: str, name: str, args: dict[str, Any], timeout_s: float) -> Any:
        assert name == "delete_ticket"
        raise UpstreamRejected("delete_ticket: rate limited, retry in 30 s")

    upstreams.call_sync = call_sync
    spec = catalogue["create_ticket"]
    ctx = CompensationContext("s-1", "create_ticket", {"title": "t"}, {"id": "T-1"}, "key-1")
    with pytest.raises(Exception, match="rate limited") as failed:
        spec.compensate(ctx)
    assert not spec.is_business_rejection(failed.value), repr(failed.value)


def test_a_write_error_answer_declared_transient_is_retried_not_a_business_rejection_R9() -> None:
    """A forward write whose upstream answers with an error (isError) is a business
    rejection (R9): never retried, the saga aborted and every earlier effect undone. A
    rate limit ("try again in 30 s") is no rejection, and a declaration had no way to
    say so (a Python tool has transient=): one hiccup undid the agent's whole task. An
    error answer containing one of the tool's declared transient: texts is a transient
    failure, retried with the same idempotency key; any other is still a rejection."""
    from participants.context import CallContext, call_context
    from sagaline.agents.mcp_proxy import UpstreamRejected, Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}},
                "idempotency_arg": "request_id",
                "transient": ["rate limited", "try again"],
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = list(DESK)
    answers = {"busy": "create_ticket: rate limited, retry in 30 s", "no": "title refused"}
    sent: list[dict[str, Any]] = []

    def call_sync(upstream: str, name: str, args: dict[str, Any], *a: Any, **k: Any) -> Any:
        sent.append(dict(args))
        raise UpstreamRejected(answers[args["title"]])

    upstreams.call_sync = call_sync  # type: ignore[method-assign]
    spec = build_catalogue(decl, upstreams)["create_ticket"]
    failures = []
    for title in ("busy", "no"):
        context = CallContext("s-1", "01-create_ticket", "create_ticket", "key-1")
        with call_context(context), pytest.raises(Exception) as failed:
            spec.invoke({"title": title})
        failures.append(failed.value)
    busy, refused = failures
    assert "rate limited" in str(busy) and not spec.is_business_rejection(busy), repr(busy)
    assert spec.is_business_rejection(refused), repr(refused)
    assert [s["request_id"] for s in sent] == ["key-1", "key-1"]

    for bad in ("", [""], 3, ["ok", None]):
        with pytest.raises(DeclarationError, match="transient"):
            _decl(
                {
                    "create_ticket": {
                        "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "x"}},
                        "transient": bad,
                    }
                }
            )
    with pytest.raises(DeclarationError, match="transient"):
        _decl({"list_tickets": {"read_only": True, "transient": ["busy"]}})


def test_compensations_and_lookups_wait_as_long_as_the_declared_deadline_R8() -> None:
    """A tool declared with a 600 s deadline: its compensation and lookup may take as
    long as the forward call. A fixed 60 s cut a longer compensation short, and the
    retry ran while the first attempt still ran upstream."""
    from participants.context import CallContext, call_context

    upstreams, catalogue = _reconciling_upstreams(deadline=600)
    timeouts: dict[str, float] = {}

    def call_sync(
        upstream: str, name: str, args: dict[str, Any], timeout_s: float, **_: Any
    ) -> Any:
        timeouts[name] = timeout_s
        return {"id": "T-1", "title": "t"}

    upstreams.call_sync = call_sync
    spec = catalogue["create_ticket"]
    with call_context(CallContext("s-1", "01-create_ticket", "create_ticket", "key-1")):
        spec.invoke({"title": "t"})
    spec.compensate(
        CompensationContext("s-1", "create_ticket", {"title": "t"}, {"id": "T-1"}, "key-1")
    )
    spec.lookup("key-1")
    assert timeouts["create_ticket"] >= 600, timeouts
    assert timeouts["delete_ticket"] == timeouts["create_ticket"], timeouts
    assert timeouts["find_ticket"] == timeouts["create_ticket"], timeouts


def test_a_receipt_that_is_not_in_yet_is_said_and_the_ended_saga_forgotten(
    tmp_path: Path,
) -> None:
    """saga_commit asked the coordinator to end the saga but its receipt did not come
    within the wait: the agent gets a tool result saying so and where to read the
    receipt later (not a TimeoutError out of the handler), and the session does not
    keep the ended saga: the next write starts a new one."""
    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas

    def no_receipt(timeout_s: float) -> Any:
        raise TimeoutError(f"saga {saga.saga_id} is not terminal after {timeout_s} s")

    saga.wait = no_receipt  # type: ignore[method-assign]
    ended = _call(proxy, "saga_commit", {})
    text = _text(ended)
    assert saga.ended == [SagaOutcome.COMPLETE]
    assert "not in yet" in text and f"sagaline saga show {saga.saga_id}" in text, text
    receipt = asyncio.run(proxy._read_resource(None, types.ReadResourceRequestParams(uri=RECEIPT)))
    note = json.loads(receipt.contents[0].text)
    assert (note["saga_id"], note["status"]) == (saga.saga_id, "RECEIPT_PENDING"), note
    again = _call(proxy, "create_ticket", {"title": "u"})
    assert again.structured_content == {"ok": "01-create_ticket"}
    assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]  # a new saga


def _end_not_acknowledged_once(saga: FakeSaga) -> None:
    """The broker does not acknowledge the saga's first SagaEndRequested."""
    from sagaline.kafka import DeliveryFailed

    real_end = saga.end

    def end(outcome: SagaOutcome, reason: str) -> None:
        saga.ended.append(outcome)
        if len(saga.ended) == 1:
            raise DeliveryFailed("no acknowledgement within 60 s", topic="events", error=None)
        saga.ended.pop()
        real_end(outcome, reason)

    saga.end = end  # type: ignore[method-assign]


def test_an_end_the_ledger_did_not_acknowledge_is_said_and_can_be_retried(
    tmp_path: Path,
) -> None:
    """saga_commit's SagaEndRequested is not acknowledged (DeliveryFailed): it may
    still land, or not. The agent gets a tool result saying so (not a protocol error),
    the session keeps the saga so the end can be retried, a write meanwhile is refused
    (a step scheduled after an end that lands is rejected), and the retry asks for the
    same outcome, after which the next write starts a new saga."""
    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas
    _end_not_acknowledged_once(saga)
    ended = _call(proxy, "saga_commit", {})
    text = _text(ended)
    assert ended.is_error and "not acknowledged" in text and "saga_commit" in text, text
    assert ended.structured_content is not None
    assert ended.structured_content["status"] == "END_NOT_ACKNOWLEDGED"
    refused = _call(proxy, "create_ticket", {"title": "u"})
    assert refused.is_error and "nothing was called" in _text(refused), _text(refused)
    assert saga.calls == ["01-create_ticket"]
    # Retried with the outcome that may already be on the ledger, whatever is asked.
    retried = _call(proxy, "saga_abort", {"reason": "changed my mind"})
    assert not retried.is_error and "COMPENSATED" in _text(retried), _text(retried)
    assert saga.ended == [SagaOutcome.COMPLETE, SagaOutcome.COMPLETE]
    again = _call(proxy, "create_ticket", {"title": "v"})
    assert again.structured_content == {"ok": "01-create_ticket"}
    assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]


def test_an_abort_after_a_failed_step_that_is_not_acknowledged_is_retried_as_an_abort(
    tmp_path: Path,
) -> None:
    """A step failed, so the proxy aborts the saga; that abort is not acknowledged. The
    tool result still says the step failed and that the abort must be retried, and
    saga_commit then retries the abort (the saga must be undone), never a completion,
    also from a proxy restarted in between."""
    from participants.client import BusinessRejected

    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas
    _end_not_acknowledged_once(saga)
    saga.answer = BusinessRejected(
        "no", saga_id="s-1", step_id="02-create_ticket", tool="create_ticket"
    )
    failed = _call(proxy, "create_ticket", {"title": "u"})
    text = _text(failed)
    assert failed.is_error and "failed" in text and "not acknowledged" in text, text
    assert saga.ended == [SagaOutcome.ABORT]
    # Restarted now, the proxy still knows the saga's abort must be retried.
    retried = _call(_fake_proxy(tmp_path, client), "saga_commit", {})
    assert not retried.is_error, _text(retried)
    assert [(s.saga_id, s.ended) for s in client.sagas] == [
        ("s-1", [SagaOutcome.ABORT]),
        ("s-1", [SagaOutcome.ABORT]),  # the restarted proxy's handle on the same saga
    ]


def _ends_as(saga: FakeSaga, status: str) -> None:
    """The saga's receipt, once it is ended, says ``status``."""
    from types import SimpleNamespace

    def wait(timeout_s: float) -> Any:
        if status == "RECEIPT_PENDING":  # not in within the proxy's wait
            raise TimeoutError(f"saga {saga.saga_id} is not terminal after {timeout_s} s")
        text = json.dumps({"saga_id": saga.saga_id, "status": status})
        return SimpleNamespace(model_dump_json=lambda indent: text)

    saga.wait = wait  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("first", "status", "then", "error", "said"),
    [
        ("saga_abort", "COMPENSATED", "saga_commit", True, "nothing was committed"),
        ("saga_commit", "COMPLETED", "saga_abort", True, "cannot be undone"),
        ("saga_commit", "ESCALATED", "saga_commit", True, "handed to a person"),
        ("saga_abort", "COMPENSATED", "saga_abort", False, "aborted already"),
        ("saga_commit", "COMPLETED", "saga_commit", False, "committed already"),
        ("failed write", "COMPENSATED", "saga_commit", True, "nothing was committed"),
        ("saga_abort", "RECEIPT_PENDING", "saga_commit", True, "nothing was committed"),
        ("saga_commit", "RECEIPT_PENDING", "saga_commit", False, "committed already"),
        ("saga_abort", "ESCALATED", "saga_abort", False, "aborted already"),
        ("failed write", "ESCALATED", "saga_abort", False, "aborted already"),
        ("saga_abort", "ESCALATED", "saga_commit", True, "nothing was committed"),
    ],
)
def test_an_end_after_the_sessions_saga_ended_says_how_it_ended(
    tmp_path: Path, first: str, status: str, then: str, error: bool, said: str
) -> None:
    """saga_commit or saga_abort after the session's saga had already ended (ended by
    the agent, or aborted by the proxy after a failed write) answered "no saga is
    open: nothing was written in this session", never an error: an agent that
    committed after the saga was aborted (its effects undone) was told nothing of it.
    The answer names the last saga and how it ended, points to its receipt, asks for
    no end again, and is an error where the agent's intent was not met."""
    from participants.client import BusinessRejected

    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas
    _ends_as(saga, status)
    if first == "failed write":
        saga.answer = BusinessRejected(
            "no", saga_id="s-1", step_id="02-create_ticket", tool="create_ticket"
        )
        _call(proxy, "create_ticket", {"title": "u"})
    else:
        _call(proxy, first, {})
    ended = list(saga.ended)
    result = _call(proxy, then, {})
    text = _text(result)
    assert saga.ended == ended, "an end was asked again of the ended saga"
    assert [s.saga_id for s in client.sagas] == ["s-1"], "a saga was started to end it"
    assert result.is_error is error, text
    assert "s-1" in text and status in text and RECEIPT in text, text
    assert said in text and "nothing was written" not in text, text
    if first != "saga_commit":  # the saga was aborted: not said as one that was not
        assert "cannot be undone by saga_abort" not in text, text
    if status == "ESCALATED":
        assert "handed to a person" in text, text


@pytest.mark.parametrize(
    ("tool", "kind", "status"),
    [
        ("create_ticket", "BusinessRejected", "ESCALATED"),
        ("create_ticket", "BusinessRejected", "RECEIPT_PENDING"),
        ("create_ticket", "StepEscalated", "COMPENSATED"),
        ("create_ticket", "OutcomeUnknown", "ESCALATED"),
        ("send_email", "OutcomeUnknown", "COMPENSATED"),
        ("create_ticket", "OutcomeUnknown", "COMPLETED"),
    ],
)
def test_a_write_that_aborts_the_saga_says_only_what_the_abort_did_R3_R11_R14(
    tmp_path: Path, tool: str, kind: str, status: str
) -> None:
    """A write that did not commit aborts the saga. Its answer said "The saga s-1 was
    aborted and its earlier effects compensated (status ESCALATED)" when a
    compensation had failed and was handed to a person, or "(status
    RECEIPT_PENDING)" before anything was known; a step handed to a person
    (StepEscalated: its outcome unknown, no lookup) was said to have "failed"; and an
    IRREVERSIBLE write of unknown outcome "is undone if it did", which it cannot be.
    Each says what is known."""
    import participants.client as saga_client

    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    _call(proxy, "create_ticket", {"title": "t"})
    (saga,) = client.sagas
    _ends_as(saga, status)
    where = {"saga_id": "s-1", "step_id": f"02-{tool}", "tool": tool}
    saga.answer = getattr(saga_client, kind)(f"{kind} of {tool}", **where)
    args = {"title": "u"} if tool == "create_ticket" else {"to": "a", "body": "b"}
    result = _call(proxy, tool, args)
    text = _text(result)
    assert saga.ended == [SagaOutcome.ABORT], saga.ended
    assert result.is_error and f"{kind} of {tool}" in text and status in text, text
    if status != "COMPENSATED":
        assert "effects compensated" not in text, text
    if status == "ESCALATED":
        assert "handed to a person" in text, text
    if status == "RECEIPT_PENDING":
        assert "not in yet" in text, text
    if kind != "BusinessRejected":
        assert "failed" not in text and "may have" in text, text
    if tool == "send_email":
        assert "undone if" not in text and "IRREVERSIBLE" in text, text
    if status == "COMPLETED":  # a pivot had committed: the abort went forward (R6)
        assert "compensated" not in text and "was aborted" not in text, text
        assert "effects stand" in text, text


def test_a_restart_reads_the_saga_from_the_ledger_once(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saga remembered on disk is read from the ledger at start-up: a scan of its
    partition of the events topic, which grows with every saga. One scan tells both
    whether it ended while the proxy was down and what it holds to continue it."""
    import sagaline.kafka

    reads: list[str] = []
    real = sagaline.kafka.LedgerReader.saga_records

    def counted(self: Any, topic: str, saga_id: str, signer: Any, **kw: Any) -> list[Any]:
        reads.append(saga_id)
        return real(self, topic, saga_id, signer, **kw)

    client = SagaClient(world.settings, world.bootstrap)
    client.start()
    try:
        open_saga = client.saga("helpdesk", "agent:helpdesk").__enter__()
        ended = client.saga("helpdesk", "agent:helpdesk").__enter__()
        ended.end(SagaOutcome.ABORT, "done")
        assert ended.wait(120).status.value == "COMPENSATED"
        monkeypatch.setattr(sagaline.kafka.LedgerReader, "saga_records", counted)
        answers = []
        for saga in (open_saga, ended):
            proxy = _fake_proxy(tmp_path, client, settings=world.settings)  # type: ignore[arg-type]
            proxy.session.path.parent.mkdir(parents=True, exist_ok=True)
            proxy.session.path.write_text(json.dumps({"saga_id": saga.saga_id, "next_step": 4}))
            asyncio.run(proxy._ensure_resumed())
            session = proxy.session
            answers.append((session.saga, session.next_step, session.last_receipt))
        open_saga.end(SagaOutcome.ABORT, "test over")
    finally:
        client.close()
    (resumed, next_step, _), (gone, _, receipt) = answers
    assert resumed is not None and resumed.saga_id == open_saga.saga_id and next_step == 4
    assert gone is None and receipt is not None and ended.saga_id in receipt
    assert reads == [open_saga.saga_id, ended.saga_id], reads


def test_a_read_only_call_is_bounded_by_its_deadline_and_does_not_hold_the_session(
    tmp_path: Path,
) -> None:
    """A read-only tool is passed straight through, but its declared deadline bounds
    that call too (docs/agents.md): an upstream that never answers got the call waited
    for forever, under the session's lock, so every later call of the session hung."""
    from sagaline.agents.mcp_proxy import McpProxy, Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}}
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
            "list_tickets": {"read_only": True, "deadline": 0.05},
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [*DESK, UpstreamTool("list_tickets", "desk", {"properties": {}})]
    settings = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    client = FakeClient()
    proxy = McpProxy(decl, upstreams, build_catalogue(decl, upstreams), client, settings)  # type: ignore[arg-type]

    async def never_answers(upstream: str, name: str, args: dict[str, Any]) -> Any:
        await asyncio.Event().wait()

    upstreams.call = never_answers  # type: ignore[method-assign]

    async def run() -> tuple[types.CallToolResult, types.CallToolResult]:
        def params(name: str) -> types.CallToolRequestParams:
            return types.CallToolRequestParams(name=name, arguments={"title": "t"})

        hung = asyncio.ensure_future(proxy._call_tool(_no_elicitation(), params("list_tickets")))
        # A safety net only: the deadline ends the call long before.
        read = await asyncio.wait_for(hung, 120)
        write = await asyncio.wait_for(
            proxy._call_tool(_no_elicitation(), params("create_ticket")), 120
        )
        return read, write

    read, write = asyncio.run(run())
    assert read.is_error and "list_tickets" in _text(read) and "0.05" in _text(read), _text(read)
    assert write.structured_content == {"ok": "01-create_ticket"}


def test_a_commit_cancelled_while_its_receipt_is_awaited_lets_go_of_the_ended_saga(
    tmp_path: Path,
) -> None:
    """The MCP client cancels saga_commit (its own request timeout, often 60 s, is
    shorter than the proxy's 300 s receipt wait) after the end was acknowledged. The
    saga is ended on the ledger, so the session must let go of it: the next write
    starts a new saga instead of scheduling a step the coordinator rejects on the
    ended one (the agent would be told its outcome is unknown, and its work lost)."""
    client = FakeClient()
    proxy = _fake_proxy(tmp_path, client)
    waiting = threading.Event()
    receipt_in = threading.Event()

    async def run() -> types.CallToolResult:
        first = types.CallToolRequestParams(name="create_ticket", arguments={"title": "t"})
        await proxy._call_tool(_no_elicitation(), first)
        (saga,) = client.sagas
        real_wait = saga.wait

        def slow_wait(timeout_s: float) -> Any:
            waiting.set()
            receipt_in.wait(120)
            return real_wait(timeout_s)

        saga.wait = slow_wait  # type: ignore[method-assign]
        commit = asyncio.ensure_future(
            proxy._call_tool(_no_elicitation(), types.CallToolRequestParams(name="saga_commit"))
        )
        assert await asyncio.to_thread(waiting.wait, 120), "the receipt was never awaited"
        commit.cancel()  # what the MCP server does on notifications/cancelled
        with suppress(asyncio.CancelledError):
            await commit
        second = types.CallToolRequestParams(name="create_ticket", arguments={"title": "u"})
        try:
            return await proxy._call_tool(_no_elicitation(), second)
        finally:
            receipt_in.set()

    again = asyncio.run(run())
    assert client.sagas[0].ended == [SagaOutcome.COMPLETE]
    assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]  # a new saga
    assert again.structured_content == {"ok": "01-create_ticket"}


@pytest.mark.parametrize("cause", ["no coordinator", "start not acknowledged", "restarted"])
def test_a_saga_that_cannot_start_is_a_tool_result_saying_why(tmp_path: Path, cause: str) -> None:
    """The first write starts the saga; when that fails (no coordinator consumes the
    ledger, or the broker does not acknowledge SagaStarted) the agent must be told why
    and that nothing was called, not get the MCP server's bare "Internal server error"
    with the reason only on the proxy's stderr. The next write tries afresh."""
    from participants.readiness import CoordinatorNotRunning
    from sagaline.kafka import DeliveryFailed

    error: Exception = (
        DeliveryFailed("no acknowledgement within 60 s", topic="events", error=None)
        if cause == "start not acknowledged"
        else CoordinatorNotRunning("no coordinator is consuming `sagaline.events`: start one")
    )
    failures = [error]

    class StartFails(FakeSaga):
        def __enter__(self) -> FakeSaga:
            if failures:
                raise failures.pop()
            return self

        def attach(self) -> FakeSaga:  # a restarted proxy continues the saga
            return self.__enter__()

    client = FakeClient(saga_type=StartFails)
    if cause == "restarted":  # with a saga open: continuing it finds no coordinator
        state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"saga_id": "s-1", "next_step": 2}))
    proxy = _fake_proxy(tmp_path, client)
    refused = _call(proxy, "create_ticket", {"title": "t"})
    text = _text(refused)
    assert refused.is_error and str(error) in text and "nothing was called" in text, text
    assert client.sagas[0].calls == []
    again = _call(proxy, "create_ticket", {"title": "t"})
    if cause == "restarted":  # the open saga is continued once the coordinator is back
        assert again.structured_content == {"ok": "02-create_ticket"}
        assert [s.saga_id for s in client.sagas] == ["s-1", "s-1"]
    else:
        assert again.structured_content == {"ok": "01-create_ticket"}
        assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]


@pytest.mark.parametrize("when", ["first write", "later write"])
def test_a_saga_client_that_cannot_go_on_is_a_tool_result_saying_why_not_a_bare_error(
    tmp_path: Path, when: str
) -> None:
    """The proxy's saga client stopped following the ledger (its listener died: a
    fatal Kafka error, lost authorisation): the client refuses every start and call
    before writing anything (ClientStopped: "... listener stopped ...; nothing was
    written"). That escaped the handler, and the agent got the MCP server's bare
    "Internal server error" at every write, the reason only on the proxy's stderr.
    The agent is told why, that nothing was called, and that the proxy needs a
    restart."""
    stopped = ClientStopped(
        "the saga client's listener stopped (KafkaError: _FATAL), so no outcome would"
        " reach saga s-1: nothing was written; use a new client"
    )

    class Stopped(FakeSaga):
        def __enter__(self) -> FakeSaga:
            if when == "first write":
                raise stopped
            return self

        async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
            if self.calls:  # the first write went through, then the listener died
                raise stopped
            return self.call(name, step_id=step_id, **args)

    client = FakeClient(saga_type=Stopped)
    proxy = _fake_proxy(tmp_path, client)
    if when == "later write":
        assert _call(proxy, "create_ticket", {"title": "t"}).structured_content == {
            "ok": "01-create_ticket"
        }
    refused = _call(proxy, "create_ticket", {"title": "u"})
    text = _text(refused)
    assert refused.is_error and "listener stopped" in text and "restart" in text, text
    assert client.sagas[0].ended == [], "nothing failed that would abort the saga"


def test_an_upstream_lost_during_a_forward_call_is_an_unknown_outcome_R11() -> None:
    """The upstream acted and then died (or its connection dropped) before answering:
    the SDK says "Connection closed". Taken as a transient failure, the step was
    retried on the dead session, failed for good and counted as never committed: its
    effect neither compensated nor named anywhere (R1, R14). It is an unknown outcome,
    which the participant runtime settles by lookup or hands to a person; the runtime
    takes a tool's TimeoutError for one (participants/runtime.py, _call_tool)."""
    import concurrent.futures

    from mcp.shared.exceptions import MCPError

    from participants.context import CallContext, call_context

    upstreams, catalogue = _reconciling_upstreams()
    sessions: dict[str, Any] = {}

    class DeadSession:
        async def call_tool(self, name: str, args: dict[str, Any]) -> Any:
            sessions[name] = args  # the request was sent; the answer never comes
            raise MCPError(-32000, "Connection closed")

    upstreams.sessions = {"desk": DeadSession()}
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    upstreams.loop = loop
    spec = catalogue["create_ticket"]
    try:
        with (
            call_context(CallContext("s-1", "01-create_ticket", "create_ticket", "key-1")),
            pytest.raises(Exception) as raised,
        ):
            spec.invoke({"title": "t"})
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(120)
        loop.close()
    assert sessions["create_ticket"]["request_id"] == "key-1"
    assert isinstance(raised.value, concurrent.futures.TimeoutError), repr(raised.value)
    assert "Connection closed" in str(raised.value) and "unknown" in str(raised.value)
    assert not spec.is_business_rejection(raised.value)


def test_an_upstream_server_is_not_given_the_proxys_keys(tmp_path: Path) -> None:
    """A stdio upstream is started with the proxy's environment, so its own settings
    (tokens, paths) reach it; but not Sagaline's: SAGALINE_HMAC_KEY would let the
    upstream (often third-party code) sign ledger records, approvals included, and
    SAGALINE_SECRET_KEY open every sealed argument. A variable the declaration's
    env: names is passed as given."""
    out = tmp_path / "upstream-env.json"
    text = _declaration(tmp_path).read_text()
    declaration = tmp_path / "desk.yaml"
    declaration.write_text(
        text.replace("args: [", "env: {SAGALINE_TENANT_ID: acme}\n    args: [", 1)
    )
    env = {
        **os.environ,
        "DESK_STATE": str(tmp_path / "desk.json"),
        "DESK_ENV_OUT": str(out),
        "PYTHONPATH": str(ROOT),
        "SAGALINE_HMAC_KEY": "hmac-key-of-the-ledger",
        "SAGALINE_SECRET_KEY": "sealing-key-of-the-ledger",
        "SAGALINE_KAFKA_SASL_PASSWORD": "kafka-password",
    }
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "mcp", "proxy", str(declaration), "--check"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    given = set(json.loads(out.read_text()))
    assert {"DESK_STATE", "PATH", "SAGALINE_TENANT_ID"} <= given, given
    assert not {"SAGALINE_HMAC_KEY", "SAGALINE_SECRET_KEY", "SAGALINE_KAFKA_SASL_PASSWORD"} & given


def test_a_first_write_cancelled_while_its_saga_starts_leaves_no_saga_open_for_good(
    tmp_path: Path,
) -> None:
    """The MCP client cancels the first write while its saga is being started (the
    coordinator check and SagaStarted's acknowledgement can take a while) and retries.
    The start goes on in its thread and lands; the retry starts another saga. The
    first one must not stay open for good with nothing to end it (R14): it is
    aborted (or, with no other saga, continued)."""
    entering = threading.Event()
    let_start = threading.Event()
    first_ended = threading.Event()

    class SlowStart(FakeSaga):
        def __enter__(self) -> FakeSaga:
            entering.set()
            let_start.wait(120)
            return self

        def end(self, outcome: SagaOutcome, reason: str) -> None:
            super().end(outcome, reason)
            first_ended.set()

    class Client(FakeClient):
        def saga(self, workflow: str, principal: str, *, saga_id: str | None = None) -> FakeSaga:
            kind = SlowStart if not self.sagas else FakeSaga
            saga = kind(saga_id or f"s-{len(self.sagas) + 1}", None)
            self.sagas.append(saga)
            return saga

    client = Client()
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> types.CallToolResult:
        def params() -> types.CallToolRequestParams:
            return types.CallToolRequestParams(name="create_ticket", arguments={"title": "t"})

        first = asyncio.ensure_future(proxy._call_tool(_no_elicitation(), params()))
        assert await asyncio.to_thread(entering.wait, 120), "the saga never started"
        first.cancel()  # what the MCP server does on notifications/cancelled
        with suppress(asyncio.CancelledError):
            await first
        retried = await proxy._call_tool(_no_elicitation(), params())
        let_start.set()  # the first start lands now
        assert await asyncio.to_thread(first_ended.wait, 120), "the first saga stays open"
        return retried

    retried = asyncio.run(run())
    first, second = client.sagas
    assert first.ended == [SagaOutcome.ABORT] and first.calls == []
    assert retried.structured_content == {"ok": "01-create_ticket"}
    assert second.calls == ["01-create_ticket"] and proxy.session.saga is second


def test_an_approval_the_client_fails_to_ask_is_awaited_like_one_without_elicitation_R7(
    tmp_path: Path,
) -> None:
    """The client declares elicitation, but asking fails (it answers with an error,
    or its connection drops): the agent must be told the IRREVERSIBLE step waits for
    a person and the saga stays open (as without elicitation), not get the MCP
    server's bare "Internal server error" while the step silently waits."""
    from types import SimpleNamespace

    from mcp.shared.exceptions import MCPError

    async def elicit_form(message: str, schema: Any) -> Any:
        raise MCPError(-32603, "the client could not show the form")

    ctx = SimpleNamespace(
        session=SimpleNamespace(
            client_capabilities=SimpleNamespace(elicitation=object()),
            client_params=None,
            elicit_form=elicit_form,
        )
    )
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = _fake_proxy(tmp_path, client)
    params = types.CallToolRequestParams(name="send_email", arguments={"to": "a", "body": "b"})

    async def run() -> types.CallToolResult:
        try:
            return await proxy._call_tool(ctx, params)
        finally:  # the person never comes: let the call's wait go
            for saga in client.sagas:
                saga.let_go()

    result = asyncio.run(run())
    assert not result.is_error and result.structured_content is not None, _text(result)
    assert result.structured_content["status"] == "awaiting_approval"
    assert "could not show the form" in _text(result), _text(result)
    assert proxy.session.saga is client.sagas[0] and client.sagas[0].ended == []


def test_an_approval_the_proxys_key_cannot_record_is_not_asked_for_in_vain_R7(
    tmp_path: Path,
) -> None:
    """With per-identity keys the proxy signs as its participant, and only an operator
    key may approve or deny (docs/security.md). The proxy asked the person anyway, then
    could not record the answer: NoUsableKey out of the handler (the client's bare
    "Internal server error", a traceback in the proxy's log). It answers "awaiting
    approval" saying why, without asking; a person approves with `sagaline approve`."""
    from types import SimpleNamespace

    from schemas.trust import Role
    from tests.trust_kit import TrustKit

    kit = TrustKit(tmp_path / "keys")
    kit.add("fake-desk", Role.PARTICIPANT)
    base = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    settings = kit.settings(base, "fake-desk")
    asked: list[str] = []

    async def elicit_form(message: str, schema: Any) -> Any:
        asked.append(message)
        return SimpleNamespace(action="accept", content={"approve": True})

    ctx = SimpleNamespace(
        session=SimpleNamespace(
            client_capabilities=SimpleNamespace(elicitation=object()),
            client_params=None,
            elicit_form=elicit_form,
        )
    )
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = _fake_proxy(tmp_path, client, settings=settings)
    params = types.CallToolRequestParams(name="send_email", arguments={"to": "a", "body": "b"})

    async def run() -> types.CallToolResult:
        try:
            return await proxy._call_tool(ctx, params)
        finally:  # the person never comes: let the call's wait go
            for saga in client.sagas:
                saga.let_go()

    result = asyncio.run(run())
    assert result.structured_content is not None, _text(result)
    assert result.structured_content["status"] == "awaiting_approval", _text(result)
    assert "operator key" in _text(result) and "sagaline approve" in _text(result)
    assert asked == []
    assert proxy.session.saga is client.sagas[0] and client.sagas[0].ended == []


def test_an_argument_the_upstream_marks_secret_never_reaches_the_ledger_in_clear(
    tmp_path: Path,
) -> None:
    """An upstream lists an argument as a secret (JSON Schema writeOnly / format
    password, what pydantic's SecretStr gives): the proxy's saga client must seal or
    redact it like any secret argument, not write it to sagaline.events in clear."""
    from sagaline.agents.mcp_proxy import Upstreams, build_catalogue

    decl = _decl(
        {
            "connect": {"compensation": {"tool": "disconnect", "args": {"id": "{result.id}"}}},
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [
        UpstreamTool(
            "connect",
            "desk",
            {
                "properties": {
                    "user": {"type": "string"},
                    "password": {"type": "string", "format": "password", "writeOnly": True},
                    "token": {"type": "string", "writeOnly": True},
                },
                "required": ["user", "password"],
            },
            {"properties": {"id": {}}},
        ),
        UpstreamTool("disconnect", "desk", {"properties": {"id": {}}, "required": ["id"]}),
    ]
    catalogue = build_catalogue(decl, upstreams)
    settings = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    client = SagaClient(settings, "unused:1", catalogues=[catalogue])
    try:
        saga = client.saga("helpdesk", "agent:helpdesk")
        body = saga._checked_body(
            client.contract("connect"),
            "01-connect",
            1,
            {"user": "ann", "password": "hunter2", "token": "t0k3n"},
        )
    finally:
        client.close()
    written = body.decode()
    assert "ann" in written  # not a secret
    assert "hunter2" not in written and "t0k3n" not in written, written


@pytest.mark.parametrize("broken", ["no such command", "exits at once", "nothing at the url"])
def test_an_upstream_that_cannot_be_reached_is_refused_naming_it(
    tmp_path: Path, broken: str
) -> None:
    """An upstream server that cannot be started, or exits before answering: the proxy
    refuses to start saying which upstream and why, with exit status 2 (a service is
    missing), not a Python traceback of nested exception groups."""
    text = _declaration(tmp_path).read_text()
    if broken == "no such command":
        text = text.replace(f"command: {sys.executable}", "command: /nonexistent/mcp-server")
    elif broken == "exits at once":
        text = text.replace(f"args: [{UPSTREAM}]", "args: [-c, 'raise SystemExit(3)']")
    else:  # with a password and a token, which the error must not show
        url = f"http://ann:pw-123@127.0.0.1:{_free_port()}/mcp?token=tok-456"
        start, end = text.index("  desk:\n"), text.index("tools:")
        text = text[:start] + f"  desk: {{url: '{url}'}}\n" + text[end:]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "mcp", "proxy", str(bad), "--check"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "sagaline mcp proxy: cannot start: upstream 'desk'" in done.stderr, done.stderr
    assert "pw-123" not in done.stderr and "tok-456" not in done.stderr, done.stderr


def test_an_elicitation_nobody_answers_does_not_hold_the_session_for_good_R7(
    tmp_path: Path,
) -> None:
    """The client accepts the elicitation but its person never answers (and the client
    never cancels the call): the proxy must not wait for good holding the session's
    lock, which would leave every later call, saga_abort included, waiting too. Past
    its wait the call answers "awaiting approval" (the step waits for a person, who
    approves with `sagaline approve`), the saga stays open, and the session serves."""
    from types import SimpleNamespace

    never = asyncio.Event()

    async def elicit_form(message: str, schema: Any) -> Any:
        await never.wait()  # the person walked away

    ctx = SimpleNamespace(
        session=SimpleNamespace(
            client_capabilities=SimpleNamespace(elicitation=object()),
            client_params=None,
            elicit_form=elicit_form,
        )
    )
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = _fake_proxy(tmp_path, client, approval_wait_s=0.5)
    params = types.CallToolRequestParams(name="send_email", arguments={"to": "a", "body": "b"})

    async def run() -> tuple[types.CallToolResult, types.CallToolResult]:
        try:
            # The bound is only there so the unfixed proxy fails instead of hanging.
            asked = await asyncio.wait_for(proxy._call_tool(ctx, params), 120)
            plan = types.CallToolRequestParams(name="saga_check_plan", arguments={"calls": []})
            after = await asyncio.wait_for(proxy._call_tool(ctx, plan), 120)
            return asked, after
        finally:
            for saga in client.sagas:
                saga.let_go()

    asked, after = asyncio.run(run())
    assert asked.structured_content is not None, _text(asked)
    assert asked.structured_content["status"] == "awaiting_approval", _text(asked)
    assert "sagaline approve" in _text(asked) and "no answer" in _text(asked), _text(asked)
    assert after.content, "the session does not serve after the unanswered elicitation"
    assert proxy.session.saga is client.sagas[0] and client.sagas[0].ended == []


def test_reads_are_served_while_a_write_waits_for_its_approval_through_the_client_R7(
    tmp_path: Path,
) -> None:
    """An IRREVERSIBLE write asks its person through elicitation and waits (up to 600
    s) for the answer, holding the session's step lock. Read-only calls, the plan
    check and the receipt resource queued behind that lock: the agent was frozen
    while it waited for the person, although none of them is a step or changes the
    session's saga. They are served while the write waits."""
    from types import SimpleNamespace

    from sagaline.agents.mcp_proxy import McpProxy, Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}}
            },
            "send_email": {"reversibility": "IRREVERSIBLE"},
            "list_tickets": {"read_only": True},
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [*DESK, UpstreamTool("list_tickets", "desk", {"properties": {}})]

    async def listed(upstream: str, name: str, args: dict[str, Any]) -> Any:
        return {"tickets": ["t-1"]}

    upstreams.call = listed  # type: ignore[method-assign]
    settings = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = McpProxy(decl, upstreams, build_catalogue(decl, upstreams), client, settings)  # type: ignore[arg-type]
    order: list[str] = []

    async def run() -> list[Any]:
        reads_done = asyncio.Event()
        asking = asyncio.Event()

        async def elicit_form(message: str, schema: Any) -> Any:
            asking.set()
            # The person answers once the reads are served; the bound is only there so
            # the unfixed proxy (reads behind the lock) fails instead of hanging.
            with suppress(TimeoutError):
                await asyncio.wait_for(reads_done.wait(), 20)
            order.append("elicitation answered")
            raise RuntimeError("the client went away")

        ctx = SimpleNamespace(
            session=SimpleNamespace(
                client_capabilities=SimpleNamespace(elicitation=object()),
                client_params=None,
                elicit_form=elicit_form,
            )
        )

        async def read(what: str, request: Any) -> Any:
            answer = await request
            order.append(what)
            return answer

        try:
            write = asyncio.ensure_future(
                proxy._call_tool(ctx, _params("send_email", {"to": "a", "body": "b"}))
            )
            await asyncio.wait_for(asking.wait(), 120)  # the write waits for its person
            reads = await asyncio.gather(
                read("list", proxy._call_tool(ctx, _params("list_tickets", {}))),
                read("plan", proxy._call_tool(ctx, _params("saga_check_plan", {"calls": []}))),
                read("receipt", proxy._read_resource(ctx, _resource(RECEIPT))),
            )
            reads_done.set()
            return [await asyncio.wait_for(write, 120), *reads]
        finally:
            for saga in client.sagas:
                saga.let_go()

    write, listing, plan, receipt = asyncio.run(run())
    assert order[-1] == "elicitation answered", f"reads waited behind the write: {order}"
    assert listing.structured_content == {"tickets": ["t-1"]}, _text(listing)
    assert not plan.is_error, _text(plan)
    assert json.loads(receipt.contents[0].text)["status"] == "OPEN", receipt
    assert (write.structured_content or {}).get("status") == "awaiting_approval", _text(write)


def test_saga_abort_while_a_write_waits_for_its_approval_through_the_client_goes_ahead_R7(
    world: World,
) -> None:
    """An IRREVERSIBLE write asks its person through elicitation and waits (up to 600
    s) holding the session's step lock. saga_abort queued behind it: an agent that no
    longer wanted the call could not abort the saga until the person answered or the
    wait ran out. The abort goes ahead: the coordinator cancels the step awaiting its
    approval (and withdraws the request) and compensates the earlier effects, and the
    waiting write is answered with a tool error saying the saga was aborted."""
    asked = asyncio.Event()
    answered = asyncio.Event()

    async def never_answers(context: Any, params: Any) -> types.ElicitResult:
        asked.set()
        await answered.wait()  # the person is away; cancelled by the proxy
        return types.ElicitResult(action="accept", content={"approve": True})

    async def run() -> tuple[types.CallToolResult, types.CallToolResult, dict[str, Any]]:
        async with world.proxy(elicit=never_answers) as session:
            made = await session.call_tool("create_ticket", {"title": "keep me"})
            assert made.structured_content == {"id": "T-1", "title": "keep me"}, made
            write = asyncio.ensure_future(
                session.call_tool("send_email", {"to": "bob@example.com", "body": "x"})
            )
            await asyncio.wait_for(asked.wait(), 120)
            try:
                # The bound is only there so the unfixed proxy (the abort behind the
                # write, 600 s) fails instead of hanging.
                aborted = await asyncio.wait_for(
                    session.call_tool("saga_abort", {"reason": "not needed any more"}), 120
                )
                sent = await asyncio.wait_for(write, 120)
            finally:
                answered.set()
            return aborted, sent, await _receipt(session)

    aborted, sent, receipt = asyncio.run(run())
    assert not aborted.is_error, _text(aborted)
    assert receipt["status"] == "COMPENSATED", receipt
    steps = {s["tool"]: s["disposition"] for s in receipt["steps"]}
    assert steps["create_ticket"] == "COMPENSATED", receipt
    assert steps["send_email"] != "COMMITTED", receipt
    assert [a["decision"] for a in receipt["approvals"]] == ["WITHDRAWN"], receipt
    assert sent.is_error and "aborted" in _text(sent), _text(sent)
    assert "send_email" in _text(sent) and "did not run" in _text(sent), _text(sent)
    assert world.state()["emails"] == []
    assert world.log() == ["create_ticket", "delete_ticket"]


def test_saga_commit_while_a_write_waits_for_its_approval_through_the_client_is_refused_R7(
    world: World,
) -> None:
    """saga_commit while an IRREVERSIBLE write waits for its person's answer through
    the client silently waited behind it (up to 600 s). It is refused at once, nothing
    ended, saying which step waits; the person's answer then still counts, and a
    commit after it completes the saga."""
    asked = asyncio.Event()
    answer = asyncio.Event()

    async def approves_later(context: Any, params: Any) -> types.ElicitResult:
        asked.set()
        await answer.wait()
        return types.ElicitResult(action="accept", content={"approve": True})

    async def run() -> tuple[types.CallToolResult, types.CallToolResult, dict[str, Any]]:
        async with world.proxy(elicit=approves_later) as session:
            await session.call_tool("create_ticket", {"title": "keep me"})
            write = asyncio.ensure_future(
                session.call_tool("send_email", {"to": "bob@example.com", "body": "x"})
            )
            await asyncio.wait_for(asked.wait(), 120)
            try:
                # Bounded only so the unfixed proxy (the commit behind the write) fails.
                early = await asyncio.wait_for(session.call_tool("saga_commit", {}), 120)
            finally:
                answer.set()
            sent = await asyncio.wait_for(write, 120)
            assert sent.structured_content == {"result": "sent to bob@example.com"}, _text(sent)
            await session.call_tool("saga_commit", {})
            return early, sent, await _receipt(session)

    early, _sent, receipt = asyncio.run(run())
    assert early.is_error and "02-send_email" in _text(early), _text(early)
    assert "nothing was ended" in _text(early), _text(early)
    assert receipt["status"] == "COMPLETED", receipt
    assert world.state()["emails"] == [{"to": "bob@example.com", "body": "x"}]


def _asking_ctx(asked: asyncio.Event) -> Any:
    """A client with elicitation whose person never answers (asked is set)."""
    from types import SimpleNamespace

    async def elicit_form(message: str, schema: Any) -> Any:
        asked.set()
        await asyncio.Event().wait()  # the person has not answered

    return SimpleNamespace(
        session=SimpleNamespace(
            client_capabilities=SimpleNamespace(elicitation=object()),
            client_params=None,
            elicit_form=elicit_form,
        )
    )


def test_a_write_cancelled_while_its_step_awaits_approval_is_remembered_as_awaiting_R7(
    tmp_path: Path,
) -> None:
    """The MCP client cancels an IRREVERSIBLE write while its person is asked (a
    client's own request timeout, often 60 s, is shorter than a person's answer). The
    step stays on the ledger waiting for its approval, but the session did not
    remember it as awaiting: the next write was not refused, it was scheduled behind
    that step and waited out the client's call timeout, then was answered "awaiting
    approval" as if it were the IRREVERSIBLE one. The step is remembered (on disk too)
    and the next write is refused at once, nothing called, naming it."""
    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = FakeClient(saga_type=AwaitsApproval)
    proxy = _fake_proxy(tmp_path, client)

    async def cancel_the_write() -> None:
        write = asyncio.ensure_future(
            proxy._call_tool(ctx, _params("send_email", {"to": "a", "body": "b"}))
        )
        await asyncio.wait_for(asked.wait(), 120)
        write.cancel()  # what the MCP server does on notifications/cancelled
        with suppress(asyncio.CancelledError):
            await write

    asyncio.run(cancel_the_write())
    assert proxy.session.awaiting == ["01-send_email"], proxy.session.awaiting
    saved = json.loads(proxy.session.path.read_text())
    assert saved["awaiting"] == ["01-send_email"], saved
    try:
        refused = _call(proxy, "create_ticket", {"title": "t"})
    finally:
        client.sagas[0].let_go()
    assert refused.is_error and "01-send_email" in _text(refused), _text(refused)
    assert "nothing was called" in _text(refused), _text(refused)
    assert client.sagas[0].calls == ["01-send_email"]


async def _abort_while_the_write_asks(
    proxy: Any, ctx: Any, asked: asyncio.Event
) -> tuple[asyncio.Future[types.CallToolResult], types.CallToolResult]:
    """send_email, IRREVERSIBLE, asks its person (``asked``); saga_abort is sent then:
    the write (going on) and the abort's answer."""
    write = asyncio.ensure_future(
        proxy._call_tool(ctx, _params("send_email", {"to": "a", "body": "b"}))
    )
    await asyncio.wait_for(asked.wait(), 120)
    aborted = await asyncio.wait_for(
        proxy._call_tool(ctx, _params("saga_abort", {"reason": "no"})), 120
    )
    return write, aborted


class _SeenQueued(asyncio.Lock):
    """The proxy's step lock, saying when a request queues behind its holder."""

    def __init__(self) -> None:
        super().__init__()
        self.queued = asyncio.Event()

    async def acquire(self) -> Literal[True]:
        if self.locked():
            self.queued.set()
        return await super().acquire()


class _FirstAwaitsClient(FakeClient):
    """The session's first saga awaits its IRREVERSIBLE step's approval; a later one
    (a new saga) answers every call at once."""

    def saga(self, workflow: str, principal: str, *, saga_id: str | None = None) -> FakeSaga:
        if self.sagas:
            return super().saga(workflow, principal, saga_id=saga_id)
        saga = AwaitsApproval(saga_id or "s-1", None)
        self.sagas.append(saga)
        return saga


def test_a_write_queued_behind_the_asking_write_does_not_run_after_the_abort_that_went_ahead_R7(
    tmp_path: Path,
) -> None:
    """A write sent while an IRREVERSIBLE write asked its person queues behind it (the
    step lock); saga_abort, sent after it, goes ahead. The queued write then ran after
    the abort, in a new saga the agent never asked for: its effect not undone by the
    abort sent after it, the new saga left open. It is refused, nothing called."""

    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = _FirstAwaitsClient()
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> tuple[types.CallToolResult, types.CallToolResult, types.CallToolResult]:
        lock = _SeenQueued()
        proxy._lock = lock
        # The session lets go of the aborted saga when the end's thread is done, in a
        # callback the loop may run after the queued write has taken the step lock
        # (CI saw it run in the aborted saga): held back here until it has.
        let_go: list[tuple[Any, ...]] = []
        session_ended = proxy._ended
        proxy._ended = lambda *args: let_go.append(args)  # type: ignore[method-assign]
        write = asyncio.ensure_future(
            proxy._call_tool(ctx, _params("send_email", {"to": "a", "body": "b"}))
        )
        await asyncio.wait_for(asked.wait(), 120)
        queued = asyncio.ensure_future(
            proxy._call_tool(ctx, _params("create_ticket", {"title": "t"}))
        )
        await asyncio.wait_for(lock.queued.wait(), 120)
        aborted = await asyncio.wait_for(
            proxy._call_tool(ctx, _params("saga_abort", {"reason": "no"})), 120
        )
        await asyncio.wait_for(write, 120)
        queued_result = await asyncio.wait_for(queued, 120)
        for args in let_go:
            session_ended(*args)
        return (
            aborted,
            queued_result,
            await asyncio.wait_for(proxy._call_tool(ctx, _params("saga_commit", {})), 120),
        )

    aborted, queued, commit = asyncio.run(run())
    assert not aborted.is_error, _text(aborted)
    assert [s.saga_id for s in client.sagas] == ["s-1"], [s.calls for s in client.sagas]
    assert queued.is_error and "saga_abort" in _text(queued), _text(queued)
    assert "nothing was called" in _text(queued), _text(queued)
    assert client.sagas[0].calls == ["01-send_email"]
    assert client.sagas[0].ended == [SagaOutcome.ABORT]
    assert "no saga is open" in _text(commit), _text(commit)


class _WaitRunsOut(AwaitsApproval):
    """As the real call whose wait (the client's call timeout) runs out before the
    person answers: ApprovalPending once released."""

    async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
        from participants.client import ApprovalPending

        self.calls.append(step_id)
        await self.released(120)
        where = {"saga_id": self.saga_id, "step_id": step_id, "tool": name}
        raise ApprovalPending("waits for approval ap-1", approval_id="ap-1", **where)


def test_a_write_cancelled_while_its_person_is_asked_leaves_no_unretrieved_error_R7(
    tmp_path: Path,
) -> None:
    """The MCP client cancels an IRREVERSIBLE write while its person is asked: the
    step's call goes on waiting (the client's call timeout), then ends with
    ApprovalPending, which nobody read: asyncio logged "Task exception was never
    retrieved" with its traceback in the proxy's log. It is the session's to forget,
    as on every other path that answers "awaiting approval"."""
    import gc

    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = FakeClient(saga_type=_WaitRunsOut)
    proxy = _fake_proxy(tmp_path, client)
    unhandled: list[str] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(
            lambda _loop, context: unhandled.append(
                f"{context['message']}: {context.get('exception')!r}"
            )
        )
        write = asyncio.ensure_future(
            proxy._call_tool(
                ctx, types.CallToolRequestParams(name="send_email", arguments={"to": "a"})
            )
        )
        await asyncio.wait_for(asked.wait(), 120)
        write.cancel()  # what the MCP server does on notifications/cancelled
        with suppress(asyncio.CancelledError):
            await write
        going_on = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert going_on, "the step's call goes on after the request was cancelled"
        client.sagas[0].let_go()  # its wait runs out: ApprovalPending
        await asyncio.wait_for(asyncio.wait(going_on), 120)
        del going_on
        gc.collect()  # an unread task's exception is logged when it is collected

    asyncio.run(run())
    assert proxy.session.awaiting == ["01-send_email"], proxy.session.awaiting
    assert unhandled == [], unhandled


class _AbortNotActedOn(AwaitsApproval):
    """A coordinator that has not acted on the abort yet: the step's wait, and a wait
    again, end with ApprovalPending (once ``slow`` is set)."""

    def __init__(self, saga_id: str, answer: BaseException | None) -> None:
        super().__init__(saga_id, answer)
        self.slow = asyncio.Event()

    def _pending(self, step_id: str) -> BaseException:
        from participants.client import ApprovalPending

        where = {"saga_id": self.saga_id, "step_id": step_id, "tool": "send_email"}
        return ApprovalPending("waits for approval ap-1", approval_id="ap-1", **where)

    async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
        self.calls.append(step_id)
        await self.slow.wait()
        raise self._pending(step_id)

    async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
        raise self._pending(step_id)


def test_a_write_whose_abort_is_acknowledged_is_not_told_its_saga_stays_open_R7(
    tmp_path: Path,
) -> None:
    """saga_abort goes ahead while an IRREVERSIBLE write asks its person; the broker
    acknowledges the abort, so the session lets go of the saga, but the coordinator
    has not acted on it when the write's wait runs out. The write answered "awaiting
    approval ... The saga stays open; it runs once approved": neither is so, the saga
    was aborted and the coordinator withdraws the request when it reads the abort."""
    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = FakeClient(saga_type=_AbortNotActedOn)
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> tuple[types.CallToolResult, types.CallToolResult]:
        write, aborted = await _abort_while_the_write_asks(proxy, ctx, asked)
        saga = client.sagas[0]
        assert isinstance(saga, _AbortNotActedOn)
        saga.slow.set()  # the write's wait runs out: still pending
        return aborted, await asyncio.wait_for(write, 120)

    aborted, sent = asyncio.run(run())
    assert not aborted.is_error, _text(aborted)
    assert client.sagas[0].ended == [SagaOutcome.ABORT]
    assert proxy.session.saga is None and proxy.session.awaiting == []
    assert sent.is_error and "aborted" in _text(sent), _text(sent)
    assert "stays open" not in _text(sent), _text(sent)
    assert (sent.structured_content or {}).get("status") != "awaiting_approval", _text(sent)


class _EndsInAfterAbort(AwaitsApproval):
    """The step's wait, once the saga is ended (saga_abort went ahead), ends in its
    answer instead of the coordinator's withdrawal."""

    async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
        self.calls.append(step_id)
        await self.released(120)
        assert self.answer is not None
        raise self.answer


@pytest.mark.parametrize(
    "kind",
    ["OutcomeUnknown", "ResultTooLarge", "SagaParked", "StepEscalated", "CoordinatorNotRunning"],
)
def test_a_write_whose_step_ends_unsettled_after_the_abort_is_not_told_it_did_not_run_R7_R11(
    tmp_path: Path, kind: str
) -> None:
    """saga_abort goes ahead while an IRREVERSIBLE write asks its person; the step's
    wait then ends in an unknown outcome (OutcomeUnknown), a committed step whose
    result is over the limit (ResultTooLarge), a parked saga (SagaParked) or a step
    handed to a person (StepEscalated). Each fell into the answer for a step decided
    before the abort: "send_email (step 01-send_email) did not run", where it may
    have run (or did): the agent would call it again. Each is said as what it is.
    The client finding no coordinator consuming (CoordinatorNotRunning) escaped the
    handler: a bare MCP internal error."""
    import participants.client as saga_client
    from participants.readiness import CoordinatorNotRunning

    where = {"saga_id": "s-1", "step_id": "01-send_email", "tool": "send_email"}
    after: BaseException = (
        CoordinatorNotRunning(f"{kind} of send_email")  # no saga, step nor tool in it
        if kind == "CoordinatorNotRunning"
        else getattr(saga_client, kind)(f"{kind} of send_email", **where)
    )

    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = FakeClient(after, saga_type=_EndsInAfterAbort)
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> tuple[types.CallToolResult, types.CallToolResult]:
        write, aborted = await _abort_while_the_write_asks(proxy, ctx, asked)
        return aborted, await asyncio.wait_for(write, 120)

    aborted, sent = asyncio.run(run())
    text = _text(sent)
    assert not aborted.is_error, _text(aborted)
    assert sent.is_error and "did not run" not in text, text
    assert f"{kind} of send_email" in text and "01-send_email" in text, text
    expected = {
        "OutcomeUnknown": "may have run",
        "ResultTooLarge": "do not call it again",
        "SagaParked": "parked",
        "StepEscalated": "may have run",
        "CoordinatorNotRunning": "do not call it again",
    }[kind]
    assert expected in text, text


def test_the_receipt_of_an_abort_that_went_ahead_does_not_replace_a_later_sagas_R7_R14(
    tmp_path: Path,
) -> None:
    """saga_abort goes ahead while an IRREVERSIBLE write asks its person, outside the
    step lock, and waits for its receipt. Meanwhile the agent ran and committed a new
    saga. When the aborted saga's receipt came in, it replaced the later saga's as the
    session's last: the receipt resource showed s-1, and a saga_commit after answered
    "the last saga of this session, s-1, was aborted already ... nothing was committed
    now", an error, of a session whose last saga had committed."""
    terminal = asyncio.Event()

    class Aborted(AwaitsApproval):
        async def await_terminal(self, timeout_s: float) -> Any:
            await asyncio.wait_for(terminal.wait(), 120)  # its compensation takes time
            return self.wait(timeout_s)

    class Client(FakeClient):
        def saga(self, workflow: str, principal: str, *, saga_id: str | None = None) -> FakeSaga:
            if self.sagas:
                return super().saga(workflow, principal, saga_id=saga_id)
            saga = Aborted(saga_id or "s-1", None)
            self.sagas.append(saga)
            return saga

    asked = asyncio.Event()
    ctx = _asking_ctx(asked)
    client = Client()
    proxy = _fake_proxy(tmp_path, client)

    async def run() -> tuple[types.CallToolResult, types.CallToolResult, str]:
        write = asyncio.ensure_future(
            proxy._call_tool(ctx, _params("send_email", {"to": "a", "body": "b"}))
        )
        await asyncio.wait_for(asked.wait(), 120)
        abort = asyncio.ensure_future(proxy._call_tool(ctx, _params("saga_abort", {})))
        await asyncio.wait_for(write, 120)
        await proxy._call_tool(ctx, _params("create_ticket", {"title": "t"}))
        _ends_as(client.sagas[1], "COMPLETED")
        committed = await proxy._call_tool(ctx, _params("saga_commit", {}))
        terminal.set()  # the aborted saga's receipt comes in after the new one's
        await asyncio.wait_for(abort, 120)
        again = await proxy._call_tool(ctx, _params("saga_commit", {}))
        read = await proxy._read_resource(None, _resource(RECEIPT))
        content = read.contents[0]
        assert isinstance(content, types.TextResourceContents)
        return committed, again, content.text

    committed, again, resource = asyncio.run(run())
    assert [s.saga_id for s in client.sagas] == ["s-1", "s-2"]
    assert not committed.is_error and "COMPLETED" in _text(committed), _text(committed)
    assert json.loads(resource)["saga_id"] == "s-2", resource
    text = _text(again)
    assert not again.is_error and "s-2" in text and "committed already" in text, text


# ------------------------------------------------------------- upstreams that go away


def _kill_upstream_servers() -> int:
    """SIGKILL this process's children that run tests/mcp_upstream.py (the upstream
    servers the test's own Upstreams started); how many."""
    me = os.getpid()
    killed = 0
    for task in os.listdir(f"/proc/{me}/task"):
        with suppress(OSError):
            for pid in Path(f"/proc/{me}/task/{task}/children").read_text().split():
                with suppress(OSError):
                    if b"mcp_upstream" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(int(pid), signal.SIGKILL)
                        killed += 1
    return killed


def _stdio_declaration(tmp_path: Path, flag: Path) -> Any:
    """The desk over stdio, started by a launcher that refuses to start it again once
    ``flag`` exists (an upstream that cannot be brought back)."""
    launcher = (
        "import os, runpy, sys\n"
        f"if os.path.exists({str(flag)!r}): sys.exit(3)\n"
        f"runpy.run_path({str(UPSTREAM)!r}, run_name='__main__')\n"
    )
    return _decl(
        {"list_tickets": {"read_only": True}, "charge": {"reversibility": "IRREVERSIBLE"}},
        participant="fake-desk",
        upstreams={
            "desk": {
                "command": sys.executable,
                "args": ["-c", launcher],
                "env": {"DESK_STATE": str(tmp_path / "desk.json"), "PYTHONPATH": str(ROOT)},
            }
        },
    )


def test_an_upstream_that_died_is_reconnected_on_the_next_call(tmp_path: Path) -> None:
    """The stdio upstream server exits (crash, OOM kill) while the proxy runs: the
    proxy must start it again for the next call, not fail every later call, the
    compensations and lookups of the open saga included, until it is restarted."""
    from contextlib import AsyncExitStack

    from sagaline.agents.mcp_proxy import Upstreams

    upstreams = Upstreams(_stdio_declaration(tmp_path, tmp_path / "no-restart"))

    async def run() -> list[Any]:
        async with AsyncExitStack() as stack:
            await upstreams.open(stack)
            before = await upstreams.call("desk", "list_tickets", {})
            assert _kill_upstream_servers() == 1
            with suppress(ConnectionError):  # it may have been in flight: unknown
                await upstreams.call("desk", "list_tickets", {})
            after = await upstreams.call("desk", "list_tickets", {})
            return [before, after]

    assert asyncio.run(run()) == [{"result": []}, {"result": []}]


def test_an_upstream_that_cannot_be_brought_back_is_a_clear_failure_not_an_unknown_outcome(
    tmp_path: Path,
) -> None:
    """The upstream died and cannot be started again: a write then is refused before
    anything is sent, so its outcome is known (it did not happen). It must say so and
    which upstream, and be a failure the runtime retries and then fails (the saga
    aborts), not an unknown outcome sent to reconciliation and a person."""
    from contextlib import AsyncExitStack

    from participants.context import CallContext, call_context
    from sagaline.agents.mcp_proxy import UpstreamOutcomeUnknown, Upstreams, build_catalogue

    flag = tmp_path / "no-restart"
    decl = _stdio_declaration(tmp_path, flag)
    upstreams = Upstreams(decl)
    raised: list[BaseException] = []

    async def run() -> None:
        async with AsyncExitStack() as stack:
            await upstreams.open(stack)
            catalogue = build_catalogue(decl, upstreams)
            flag.touch()
            assert _kill_upstream_servers() == 1
            with suppress(ConnectionError):  # it may have been in flight: unknown
                await upstreams.call("desk", "list_tickets", {})

            def write() -> None:
                ctx = CallContext("s-1", "01-charge", "charge", "key-1")
                with call_context(ctx):
                    catalogue["charge"].invoke({"amount": 5})

            try:
                await asyncio.to_thread(write)
            except Exception as exc:
                raised.append(exc)

    asyncio.run(run())
    (exc,) = raised
    assert not isinstance(exc, (UpstreamOutcomeUnknown, TimeoutError)), repr(exc)
    assert isinstance(exc, ConnectionError), repr(exc)
    assert "'desk'" in str(exc) and "nothing was called" in str(exc), str(exc)
    desk = tmp_path / "desk.json"
    assert not desk.exists() or "charge" not in [t for t, _ in json.loads(desk.read_text())["log"]]


def test_an_http_upstream_going_down_does_not_take_the_proxy_down(tmp_path: Path) -> None:
    """A streamable-HTTP upstream goes away (restarted, redeployed): its transport's
    failure must end that connection only, not cancel the task that serves the agent
    (the proxy exited with a traceback), and the upstream is reconnected once back."""
    from contextlib import AsyncExitStack

    from sagaline.agents.mcp_proxy import Upstreams

    port = _free_port()
    env = {**os.environ, "DESK_STATE": str(tmp_path / "desk.json"), "DESK_HTTP_PORT": str(port)}

    def serve() -> subprocess.Popen[bytes]:
        server = subprocess.Popen(
            [sys.executable, str(UPSTREAM)], env=env, stderr=subprocess.DEVNULL
        )
        wait_until(lambda: _listening(port), 60, "the HTTP upstream to listen")
        return server

    decl = _decl(
        {"list_tickets": {"read_only": True}, "charge": {"reversibility": "IRREVERSIBLE"}},
        participant="fake-desk",
        upstreams={"desk": {"url": f"http://127.0.0.1:{port}/mcp"}},
    )
    upstreams = Upstreams(decl)
    server = serve()
    answers: list[Any] = []

    async def call() -> Any:  # as the runtime's threads do: in a task of its own
        with suppress(ConnectionError):
            return await asyncio.ensure_future(upstreams.call("desk", "list_tickets", {}))
        return "failed"

    async def run() -> None:
        nonlocal server
        async with AsyncExitStack() as stack:
            await upstreams.open(stack)
            answers.append(await call())
            server.kill()
            server.wait(60)
            answers.append(await call())  # the upstream is down: fails
            server = serve()
            answers.append(await call())
            answers.append(await call())

    try:
        asyncio.run(run())
    finally:
        server.kill()
        server.wait(60)
    assert answers[0] == {"result": []} and answers[1] == "failed", answers
    assert {"result": []} in answers[2:], answers


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_tool_without_upstream_among_several_upstreams_is_refused_not_guessed() -> None:
    """With two upstreams, a tool naming none would be served by whichever upstream
    the file lists first: its call (and its undo) could go to the wrong server."""
    with pytest.raises(DeclarationError) as err:
        parse_declaration(
            {
                "upstreams": {"desk": {"command": "x"}, "billing": {"url": "http://h/mcp"}},
                "tools": {"list_tickets": {"read_only": True}},
            }
        )
    message = str(err.value)
    assert "tool 'list_tickets': name its upstream" in message, message
    assert "'billing'" in message and "'desk'" in message, message


@pytest.mark.parametrize("saved", ['{"saga_id": "s-7", "next_st', '{"next_step": 3}', "[]"])
def test_an_unreadable_session_file_is_set_aside_with_a_warning_not_a_crash_at_every_call(
    tmp_path: Path, saved: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The remembered saga's file is torn or not the proxy's (a full disk, a hand
    edit): every call raised out of the MCP server ("Internal server error"), on every
    start. It is kept aside for a person, said in the log, and the session goes on."""
    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(saved)
    client = FakeClient()
    with caplog.at_level("WARNING", logger="sagaline.mcp"):
        result = _call(_fake_proxy(tmp_path, client), "create_ticket", {"title": "t"})
    assert result.structured_content == {"ok": "01-create_ticket"}, result
    aside = state.with_name("mcp-session.json.unreadable")
    assert aside.read_text() == saved
    assert str(aside) in caplog.text, caplog.text
    assert json.loads(state.read_text())["saga_id"] == client.sagas[-1].saga_id


def test_an_upstream_that_never_answers_initialize_is_refused_naming_it_not_waited_on_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stdio upstream that starts but never answers (stuck, or not an MCP server):
    the proxy waited for its initialize for ever, so `sagaline mcp proxy` (and the MCP
    client that started it) hung with nothing said. Past the start-up wait it is an
    upstream that cannot be reached, named, and its process is not left behind."""
    from contextlib import AsyncExitStack

    from sagaline.agents import mcp_proxy

    monkeypatch.setattr(mcp_proxy, "CONNECT_WAIT_S", 2.0)  # it never answers
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    decl = _decl({}, upstreams={"desk": {"command": sys.executable, "args": ["-c", script]}})

    async def start() -> None:
        async with AsyncExitStack() as stack:
            await mcp_proxy.Upstreams(decl).open(stack)

    with pytest.raises(mcp_proxy.UpstreamUnavailable) as err:
        asyncio.run(asyncio.wait_for(start(), 120))
    assert "upstream 'desk'" in str(err.value) and "did not answer" in str(err.value), err.value
    pid = int(pid_file.read_text())
    wait_until(lambda: not _alive(pid), timeout_s=60, what="the stuck upstream to be ended")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with suppress(OSError):  # a zombie is ended
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    return False


def test_an_optional_or_nested_secret_argument_never_reaches_the_ledger_in_clear(
    tmp_path: Path,
) -> None:
    """pydantic lists an optional ``SecretStr | None`` as ``anyOf`` [password, null] and
    a secret inside a model argument under ``$defs``: only a top-level writeOnly /
    password was taken for a secret, so these went to sagaline.events in clear."""
    from sagaline.agents.mcp_proxy import Upstreams, build_catalogue

    decl = _decl(
        {"connect": {"compensation": {"tool": "disconnect", "args": {"id": "{result.id}"}}}},
        participant="fake-desk",
    )
    secret = {"type": "string", "format": "password", "writeOnly": True}
    upstreams = Upstreams(decl)
    upstreams.tools = [
        UpstreamTool(
            "connect",
            "desk",
            {
                "$defs": {
                    "Card": {
                        "type": "object",
                        "properties": {"holder": {"type": "string"}, "number": secret},
                    },
                    "Key": {
                        "type": "object",
                        "properties": {"label": {"type": "string"}, "value": secret},
                    },
                },
                "properties": {
                    "user": {"type": "string"},
                    "otp": {"anyOf": [secret, {"type": "null"}], "default": None},
                    "card": {"$ref": "#/$defs/Card"},
                    "keys": {"type": "array", "items": {"$ref": "#/$defs/Key"}},
                },
                "required": ["user", "card"],
            },
            {"properties": {"id": {}}},
        ),
        UpstreamTool("disconnect", "desk", {"properties": {"id": {}}, "required": ["id"]}),
    ]
    catalogue = build_catalogue(decl, upstreams)
    settings = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    client = SagaClient(settings, "unused:1", catalogues=[catalogue])
    try:
        saga = client.saga("helpdesk", "agent:helpdesk")
        body = saga._checked_body(
            client.contract("connect"),
            "01-connect",
            1,
            {
                "user": "ann",
                "otp": "990-117",
                "card": {"holder": "Ann Lee", "number": "4111-2222"},
                "keys": [{"label": "prod", "value": "k-5150"}],
            },
        )
    finally:
        client.close()
    written = body.decode()
    assert "ann" in written and "Ann Lee" in written and "prod" in written  # not secrets
    assert "990-117" not in written and "4111-2222" not in written, written
    assert "k-5150" not in written, written


@pytest.mark.parametrize("calls", ["create_ticket", [{"args": {}}], [{"tool": "x", "args": "y"}]])
def test_a_malformed_plan_is_a_tool_result_saying_why_not_a_protocol_error(
    tmp_path: Path, calls: Any
) -> None:
    """saga_check_plan given calls it cannot read (a model's mistake): check_plan's
    ValueError escaped the handler, a JSON-RPC error and a traceback in the proxy's
    log, instead of a tool result the agent reads and corrects."""
    result = _call(_fake_proxy(tmp_path, FakeClient()), "saga_check_plan", {"calls": calls})
    assert result.is_error and "planned call 0" in _text(result), _text(result)


def test_upstream_arguments_that_are_no_python_names_are_served_under_their_own_names(
    tmp_path: Path,
) -> None:
    """An email tool's ``from``, a ``reply-to``: the proxy built each tool's Python
    signature from the upstream's argument names, and ``inspect.Parameter`` refuses
    these, so `sagaline mcp proxy` died at start-up with a ValueError traceback. They
    are served, validated, sealed and sent upstream under the upstream's names."""
    from participants.context import CallContext, call_context
    from sagaline.agents.mcp_proxy import Upstreams, build_catalogue

    decl = _decl(
        {"send_email": {"reversibility": "IRREVERSIBLE"}},
        participant="fake-mail",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [
        UpstreamTool(
            "send_email",
            "desk",
            {
                "properties": {
                    "from": {"type": "string"},
                    "to": {"type": "string"},
                    "reply-to": {"type": "string"},
                    "api-key": {"type": "string", "writeOnly": True},
                },
                "required": ["from", "to", "api-key"],
            },
        )
    ]
    catalogue = build_catalogue(decl, upstreams)
    spec = catalogue["send_email"]
    assert set(spec.input_schema()["properties"]) == {"from", "to", "reply-to", "api-key"}
    assert "api-key" in spec.secret_paths
    sent: list[tuple[str, dict[str, Any]]] = []

    def call_sync(upstream: str, name: str, args: dict[str, Any], *a: Any, **k: Any) -> str:
        sent.append((name, dict(args)))
        return "sent"

    upstreams.call_sync = call_sync  # type: ignore[method-assign]
    args = {"from": "desk@example.com", "to": "ann@example.com", "api-key": "k-5150"}
    with call_context(CallContext("s-1", "01-send_email", "send_email", "key-1")):
        assert spec.invoke(args) == "sent"
    assert sent == [("send_email", args)]
    settings = Settings(bootstrap="unused:1", state_dir=tmp_path / "state")
    client = SagaClient(settings, "unused:1", catalogues=[catalogue])
    try:
        saga = client.saga("helpdesk", "agent:helpdesk")
        body = saga._checked_body(client.contract("send_email"), "01-send_email", 1, args)
    finally:
        client.close()
    assert "k-5150" not in body.decode() and "ann@example.com" in body.decode()


def test_the_session_file_is_on_disk_before_it_replaces_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open saga's id is what a restarted proxy continues. It was written to a
    temporary file renamed over the last one with nothing flushed: after a crash of
    the machine the rename may be on disk and the data not (an empty or torn file,
    set aside at the next start, the saga's id lost and the saga open for good). The
    temporary file is synced before the rename, and its directory after."""
    from sagaline.agents.mcp_proxy import _Session

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "state" / "desk" / "mcp-session.json"
    session = _Session(path, saga=FakeSaga("s-1", None), next_step=4)  # type: ignore[arg-type]
    session.save()
    assert json.loads(path.read_text()) == {"saga_id": "s-1", "next_step": 4}
    assert synced == [str(path.with_suffix(".tmp")), str(path.parent)], synced


def test_an_http_upstreams_credentials_are_not_logged_in_clear(tmp_path: Path) -> None:
    """A streamable-HTTP upstream whose URL carries a password or a token (its query):
    the proxy logs at INFO, and the HTTP client's INFO line for every request ("HTTP
    Request: POST http://ann:pw-123@.../mcp?token=tok-456") put them in the proxy's
    log in clear, which its own messages take care to leave out."""
    port = _free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(UPSTREAM)],
        env={**os.environ, "DESK_STATE": str(tmp_path / "desk.json"), "DESK_HTTP_PORT": str(port)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert upstream.stderr is not None
        for line in upstream.stderr:  # uvicorn says when it listens
            if "running on" in line.lower() or "startup complete" in line.lower():
                break
        else:
            pytest.fail(f"the HTTP upstream exited {upstream.wait()}")
        text = _declaration(tmp_path).read_text()
        start, end = text.index("  desk:\n"), text.index("tools:")
        url = f"http://ann:pw-123@127.0.0.1:{port}/mcp?token=tok-456"
        declaration = tmp_path / "http.yaml"
        declaration.write_text(text[:start] + f"  desk: {{url: '{url}'}}\n" + text[end:])
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "mcp", "proxy", str(declaration), "--check"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        upstream.terminate()
        upstream.wait(30)
    assert done.returncode == 0, done.stderr
    assert "pw-123" not in done.stderr and "tok-456" not in done.stderr, done.stderr


def test_a_remembered_saga_written_by_a_newer_version_is_said_not_a_protocol_error(
    tmp_path: Path,
) -> None:
    """A restarted proxy (rolled back to an older version) cannot read records of its
    open saga: attach() refuses, SagaHistoryUnreadable. Every call, saga_abort
    included, then failed with the MCP server's bare "Internal server error", the
    reason (upgrade) only on the proxy's stderr. The agent is told, nothing called."""
    from participants.client import SagaHistoryUnreadable

    class Unreadable(FakeSaga):
        def attach(self) -> FakeSaga:
            raise SagaHistoryUnreadable(
                f"cannot attach saga {self.saga_id}: 1 of its record(s) were written by a"
                " newer version of Sagaline; upgrade this client",
                saga_id=self.saga_id,
                unreadable=["events[0]@7"],
            )

    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-1", "next_step": 2}))
    client = FakeClient(saga_type=Unreadable)
    proxy = _fake_proxy(tmp_path, client)
    for name, args in [("create_ticket", {"title": "t"}), ("saga_abort", {})]:
        refused = _call(proxy, name, args)
        text = _text(refused)
        assert refused.is_error and "upgrade" in text and "nothing was called" in text, text
    assert [s.calls for s in client.sagas] == [[], []]


@pytest.mark.parametrize("cause", ["unreadable", "no-coordinator"])
def test_the_receipt_of_a_saga_that_cannot_be_continued_says_why_not_a_protocol_error(
    tmp_path: Path, cause: str
) -> None:
    """A restarted proxy whose open saga cannot be continued (no coordinator running,
    or records written by a newer Sagaline): reading the receipt resource raised
    CoordinatorNotRunning / SagaHistoryUnreadable out of the handler, a bare JSON-RPC
    error (and a traceback in the proxy's log). It answers with a receipt document
    saying the saga cannot be continued yet, and why."""
    from participants.client import SagaHistoryUnreadable
    from participants.readiness import CoordinatorNotRunning

    class Stuck(FakeSaga):
        def attach(self) -> FakeSaga:
            if cause == "no-coordinator":
                raise CoordinatorNotRunning("no coordinator is running: start one")
            raise SagaHistoryUnreadable(
                f"cannot attach saga {self.saga_id}: 1 of its record(s) were written by a"
                " newer version of Sagaline; upgrade this client",
                saga_id=self.saga_id,
                unreadable=["events[0]@7"],
            )

    state = tmp_path / "state" / "fake-desk" / "mcp-session.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"saga_id": "s-1", "next_step": 2}))
    proxy = _fake_proxy(tmp_path, FakeClient(saga_type=Stuck))
    params = types.ReadResourceRequestParams(uri=RECEIPT)
    read = asyncio.run(proxy._read_resource(_no_elicitation(), params))
    content = read.contents[0]
    assert isinstance(content, types.TextResourceContents)
    receipt = json.loads(content.text)
    assert receipt["status"] == "CANNOT_CONTINUE" and receipt["saga_id"] == "s-1", receipt
    assert ("upgrade" if cause == "unreadable" else "start one") in receipt["note"], receipt


def test_an_explicit_null_the_upstream_schema_allows_is_forwarded_not_dropped() -> None:
    """An optional upstream argument the agent sets to null on purpose (``note: null``
    to clear it, where the upstream's own default is "keep") was dropped, so the
    upstream applied its default instead: the call did something else than asked. An
    explicit null is forwarded when the schema allows it; an argument not given is
    still left out; a null the schema does not allow is refused, nothing called."""
    from participants.context import CallContext, call_context
    from participants.errors import InvalidArgumentsError
    from sagaline.agents.mcp_proxy import Upstreams, build_catalogue

    decl = _decl(
        {
            "create_ticket": {
                "compensation": {"tool": "delete_ticket", "args": {"ticket_id": "{result.id}"}}
            },
        },
        participant="fake-desk",
    )
    upstreams = Upstreams(decl)
    upstreams.tools = [
        UpstreamTool(
            "create_ticket",
            "desk",
            {
                "properties": {
                    "title": {"type": "string"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": "keep"},
                    "priority": {"type": "integer", "default": 3},
                },
                "required": ["title"],
            },
        ),
        DESK[1],
    ]
    catalogue = build_catalogue(decl, upstreams)
    sent: list[dict[str, Any]] = []

    def call_sync(
        upstream: str, name: str, args: dict[str, Any], timeout_s: float, **_: Any
    ) -> Any:
        sent.append(dict(args))
        return {"id": "T-1"}

    upstreams.call_sync = call_sync
    spec = catalogue["create_ticket"]
    with call_context(CallContext("s-1", "01-create_ticket", "create_ticket", "key-1")):
        spec.invoke({"title": "t", "note": None})
        spec.invoke({"title": "t"})
        with pytest.raises(InvalidArgumentsError, match="priority"):
            spec.invoke({"title": "t", "priority": None})
    assert sent == [{"title": "t", "note": None}, {"title": "t"}]


def test_a_write_whose_outcome_no_coordinator_gives_is_remembered_as_awaiting_not_a_bare_error(
    tmp_path: Path,
) -> None:
    """The step was written, but the client found no coordinator consuming the ledger
    while it waited for the outcome (CoordinatorNotRunning). That escaped the handler:
    the agent got the MCP server's bare "Internal server error" and, not told the step
    was on the ledger (it runs once a coordinator consumes), could call it again. It
    is a tool error saying so; the session remembers the step, so the next write
    checks the ledger first and is refused while the step has no outcome (nothing
    called twice), then goes on once it has one."""
    from participants.client import OutcomeUnknown
    from participants.readiness import CoordinatorNotRunning

    no_coordinator = "no coordinator is consuming `sagaline.events`: start one"
    up = threading.Event()
    ran = threading.Event()

    class NoCoordinator(FakeSaga):
        async def acall(self, name: str, *, step_id: str, **args: Any) -> Any:
            self.calls.append(step_id)
            if not self.calls[:-1]:  # the first step: written, its outcome never came
                raise CoordinatorNotRunning(no_coordinator)
            return {"ok": step_id}

        async def aresume(self, step_id: str, timeout_s: float | None = None) -> Any:
            if not up.is_set():
                raise CoordinatorNotRunning(no_coordinator)
            if not ran.is_set():  # a coordinator consumes, the step runs: no outcome yet
                where = {"saga_id": self.saga_id, "step_id": step_id, "tool": "create_ticket"}
                raise OutcomeUnknown(f"no outcome for create_ticket within {timeout_s} s", **where)
            return {"ok": step_id}

    client = FakeClient(saga_type=NoCoordinator)
    proxy = _fake_proxy(tmp_path, client)
    first = _call(proxy, "create_ticket", {"title": "t"})
    text = _text(first)
    assert first.is_error and no_coordinator in text, text
    assert "01-create_ticket" in text and "do not call it again" in text, text
    assert proxy.session.awaiting == ["01-create_ticket"], proxy.session.awaiting
    saved = json.loads((tmp_path / "state" / "fake-desk" / "mcp-session.json").read_text())
    assert saved["awaiting"] == ["01-create_ticket"], saved
    (saga,) = client.sagas
    assert saga.ended == [], "nothing failed that would abort the saga"
    behind = _call(proxy, "create_ticket", {"title": "u"})
    assert behind.is_error and "nothing was called" in _text(behind), _text(behind)
    assert no_coordinator in _text(behind), _text(behind)
    assert saga.calls == ["01-create_ticket"]
    up.set()  # a coordinator consumes: the first step runs, its outcome not in yet
    running = _call(proxy, "create_ticket", {"title": "u"})
    assert running.is_error and "nothing was called" in _text(running), _text(running)
    assert saga.ended == [], "a step still running is no failure to abort the saga for"
    assert saga.calls == ["01-create_ticket"]
    ran.set()  # its outcome is on the ledger
    after = _call(proxy, "create_ticket", {"title": "u"})
    assert after.structured_content == {"ok": "02-create_ticket"}, _text(after)
    assert saga.calls == ["01-create_ticket", "02-create_ticket"]
    assert proxy.session.awaiting == []


def test_a_call_past_the_step_limit_tells_the_agent_to_end_the_saga_not_to_retry(
    tmp_path: Path,
) -> None:
    """Past SAGALINE_MAX_STEPS no arguments get a call through: "call it again with
    other arguments" sent the agent into retries that could never succeed."""
    from participants.client import CallRefused

    client = FakeClient(
        CallRefused(
            "saga s-1 would get step 65 (create_ticket) but at most 64 steps per saga"
            " are allowed (SAGALINE_MAX_STEPS)",
            limit="max_steps",
            size=65,
            saga_id="s-1",
            step_id="65-create_ticket",
            tool="create_ticket",
        )
    )
    result = _call(_fake_proxy(tmp_path, client), "create_ticket", {"title": "t"})
    text = _text(result)
    assert result.is_error and "nothing was called" in text, text
    assert "no further tool call" in text and "again with other arguments" not in text, text
    assert "saga_commit" in text and client.sagas[0].ended == [], text

"""Start-up of the deployables on a configuration that cannot work: one clear line
and exit code 2, never a traceback, and never a quiet fall-back to a weaker mode."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from schemas.settings import ENV_VARS, Settings, SettingsError
from services.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def broker_env(
    _clean_env: None, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str, unique_prefix: str
) -> None:
    """The commands a test runs reach the test broker, under topics of its own prefix."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)


@pytest.mark.parametrize(
    "env",
    [
        {"SAGALINE_SIGNING_KEY": "/secrets/payments.pem"},
        {"SAGALINE_SIGNING_KEY_ID": "payments.1"},
        {"SAGALINE_SIGNING_KEY": "/secrets/payments.pem", "SAGALINE_HMAC_KEY": "k"},
    ],
)
def test_a_signing_key_without_a_trust_file_is_refused_not_ignored(env: dict[str, str]) -> None:
    """The process was meant to sign as an identity; without the trust file it signed
    with the shared HMAC key, or not at all, and said nothing."""
    with pytest.raises(SettingsError, match="SAGALINE_TRUST_FILE"):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({"SAGALINE_OLD_SECRET_KEYS": "s1=old-secret"}, "SAGALINE_SECRET_KEY"),
        ({"SAGALINE_SECRET_KEY_ID": "s2"}, "SAGALINE_SECRET_KEY"),
        ({"SAGALINE_HMAC_KEY_ID": "k2"}, "SAGALINE_HMAC_KEY"),
    ],
)
def test_a_keys_companion_without_the_key_is_refused_not_a_weaker_mode(
    env: dict[str, str], missing: str
) -> None:
    """A rotation that lost the new key (old keys, a new id, but no key): this process
    redacted secrets instead of sealing them -- the tool got "[redacted]" for the card
    number -- or wrote unsigned records, and said nothing."""
    with pytest.raises(SettingsError, match=f"without {missing}"):
        Settings.from_env(env)


def test_the_companions_with_their_keys_are_fine() -> None:
    settings = Settings.from_env(
        {
            "SAGALINE_SECRET_KEY": "new-secret",
            "SAGALINE_SECRET_KEY_ID": "s2",
            "SAGALINE_OLD_SECRET_KEYS": "s1=old-secret",
            "SAGALINE_HMAC_KEY": "k",
            "SAGALINE_HMAC_KEY_ID": "k2",
        }
    )
    assert settings.sealer().enabled and settings.signer().key_id == "k2"
    # With identities the HMAC key id is not used: nothing to refuse.
    assert Settings.from_env(
        {"SAGALINE_TRUST_FILE": "trust.json", "SAGALINE_HMAC_KEY_ID": "k2"}
    ).trust_file == Path("trust.json")


@pytest.mark.parametrize(
    "env",
    [
        # The new secret under the default id s1, the old one listed as s1 too.
        {"SAGALINE_SECRET_KEY": "new-secret", "SAGALINE_OLD_SECRET_KEYS": "s1=old-secret"},
        {
            "SAGALINE_SECRET_KEY": "new-secret",
            "SAGALINE_SECRET_KEY_ID": "s2",
            "SAGALINE_OLD_SECRET_KEYS": "s1=old-secret,s1=older-secret",
        },
    ],
)
def test_one_secret_key_id_for_two_secrets_is_refused_not_the_old_one_dropped(
    env: dict[str, str],
) -> None:
    """A rotation that kept the key id (the new SAGALINE_SECRET_KEY under the default
    s1, the old one as ``s1=old-secret``): a sealed value names only its key id, so the
    old secret was silently dropped, and every secret sealed before the change failed
    to open (SealError: the step failed as a business rejection, the saga compensated)."""
    before = Settings.from_env({"SAGALINE_SECRET_KEY": "old-secret"}).sealer()
    sealed = before.seal({"card": "4111 1111 1111 1111"}, ["card"], "saga-1")
    with pytest.raises(SettingsError, match="SAGALINE_SECRET_KEY_ID"):
        after = Settings.from_env(env).sealer()
        # What a participant then did with a card sealed before the rotation:
        after.open(sealed, ["card"], "saga-1")
    # Rotated as docs/security.md says (a new id), the value sealed before opens; the
    # current secret listed again under its own id changes nothing.
    for fine in (
        {**env, "SAGALINE_SECRET_KEY_ID": "s2", "SAGALINE_OLD_SECRET_KEYS": "s1=old-secret"},
        {"SAGALINE_SECRET_KEY": "old-secret", "SAGALINE_OLD_SECRET_KEYS": "s1=old-secret"},
    ):
        opened = Settings.from_env(fine).sealer().open(sealed, ["card"], "saga-1")
        assert opened == {"card": "4111 1111 1111 1111"}


@pytest.mark.kafka
def test_a_command_with_a_signing_key_but_no_trust_file_exits_2_saying_so(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SAGALINE_SIGNING_KEY", str(tmp_path / "payments.pem"))
    assert main(["incidents", "list"]) == 2
    err = capsys.readouterr().err
    assert "SAGALINE_SIGNING_KEY" in err and "SAGALINE_TRUST_FILE" in err, err


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on (another process's metrics server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.kafka
@pytest.mark.parametrize("command", [["participant", "run", "policy"], ["coordinator", "run"]])
def test_a_metrics_port_in_use_exits_2_naming_it_not_a_traceback(
    command: list[str],
    busy_port: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path))
    assert main([*command, "--metrics-port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"--metrics-port {busy_port}" in err and "127.0.0.1" in err, err


@pytest.mark.parametrize("command", [["participant", "run", "policy"], ["coordinator", "run"]])
@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_metrics_port_out_of_range_is_a_usage_error(
    command: list[str], port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--metrics-port", port])
    assert exit_.value.code == 2
    assert "argument --metrics-port" in capsys.readouterr().err


@pytest.mark.kafka
@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_dashboard_port_out_of_range_is_a_usage_error(
    port: str,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
) -> None:
    """It was an OverflowError traceback from uvicorn's bind (after reading the ledger)."""
    with pytest.raises(SystemExit) as exit_:
        main(["dashboard", "--port", port])
    assert exit_.value.code == 2
    assert "argument --port" in capsys.readouterr().err


def _not_a_directory(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.write_text("a file where a directory should be\n")
    return path


def _not_a_database(tmp_path: Path) -> Path:
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "commands.sqlite").write_text("not SQLite\n" * 20)
    return tmp_path


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("make", "option"),
    [
        (_not_a_directory, "SAGALINE_STATE_DIR"),
        (_not_a_directory, "--journal-dir"),
        (_not_a_database, "SAGALINE_STATE_DIR"),
    ],
)
def test_a_state_dir_it_cannot_use_exits_2_naming_it_not_a_traceback(
    make: Callable[[Path], Path],
    option: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    bad = make(tmp_path)
    argv = ["participant", "run", "policy", "--catalogue", "tests.fixtures.participants_good"]
    if option == "--journal-dir":
        monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path / "fine"))
        argv += ["--journal-dir", str(bad / "policy")]
    else:
        monkeypatch.setenv("SAGALINE_STATE_DIR", str(bad))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and option in err, err


@pytest.mark.kafka
def test_a_damaged_journal_exits_2_naming_it_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    """A journal whose pages past the first are damaged opens (SQLite reads page 1
    only), then fails at start when the accepted compensations are read back: that
    was a DatabaseError traceback ("database disk image is malformed") naming no file."""
    from participants.runtime import CommandJournal

    path = tmp_path / "policy" / "commands.sqlite"
    journal = CommandJournal(path)
    journal.write([(f"old-{i}", "done", b"c" * 200, b"o" * 200, i) for i in range(300)])
    journal.close()
    with path.open("r+b") as f:
        f.seek(4096)  # page 1 (the schema) is kept
        f.write(b"\xff" * (path.stat().st_size - 4096))
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    argv = ["participant", "run", "policy", "--catalogue", "tests.fixtures.participants_good"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "damaged" in err and "Traceback" not in err, err


@pytest.mark.kafka
def test_the_refund_services_state_dir_it_cannot_use_exits_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    bad = _not_a_directory(tmp_path)
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(bad))
    assert main(["participant", "run", "policy"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "SAGALINE_STATE_DIR" in err, err


@pytest.mark.parametrize(
    "var",
    [
        "SAGALINE_DASHBOARD_SECURE_COOKIE",
        "SAGALINE_DASHBOARD_READ_OPEN",
        "SAGALINE_DASHBOARD_METRICS_OPEN",
    ],
)
@pytest.mark.parametrize("value", ["on", "enabled", "Y", "2"])
def test_a_dashboard_switch_it_cannot_read_is_refused_not_taken_as_off(
    var: str, value: str
) -> None:
    """SAGALINE_DASHBOARD_SECURE_COOKIE=on left the session cookie without Secure, and
    said nothing: any value but 1/true/yes was quietly "off"."""
    from services.dashboard.auth import AuthConfigError, OperatorAuth

    with pytest.raises(AuthConfigError, match=var):
        OperatorAuth.from_env({var: value})


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), (" TRUE ", True), ("0", False), ("", False)]
)
def test_the_dashboard_switches_read_1_true_yes_and_0_false_no(value: str, on: bool) -> None:
    from services.dashboard.auth import OperatorAuth

    auth = OperatorAuth.from_env({"SAGALINE_DASHBOARD_SECURE_COOKIE": value})
    assert auth.secure_cookie is on


@pytest.mark.kafka
@pytest.mark.parametrize("plan", ["{not json", "@/nonexistent/faults.json"])
def test_a_refund_fault_plan_it_cannot_read_exits_2_naming_it_not_a_traceback(
    plan: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("SAGALINE_FAULTS", plan)
    assert main(["participant", "run", "policy"]) == 2
    err = capsys.readouterr().err
    assert "fault plan" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("command", "fallback"),
    [(["coordinator", "run"], "coordinator-0"), (["participant", "run", "policy"], None)],
)
def test_an_empty_hostname_is_unset_not_an_empty_instance_id(
    command: list[str], fallback: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HOSTNAME set but empty (a container run with --hostname '', an env file's
    HOSTNAME=) gave the coordinator the instance id "": every such instance had the
    same transactional id, "<group>-", and fenced the others."""
    from services.cli import build_parser

    monkeypatch.setenv("HOSTNAME", "")
    monkeypatch.setenv("SAGALINE_INSTANCE_ID", "")
    args = build_parser().parse_args(command)
    assert args.instance_id == fallback


@pytest.mark.parametrize("command", [["coordinator", "run"], ["participant", "run", "policy"]])
@pytest.mark.parametrize("given", ["", "  "])
def test_an_explicitly_empty_instance_id_is_a_usage_error(
    command: list[str], given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--instance-id "$ID"`` with ID unset: the coordinator ran as "", the participant
    quietly as its name (every replica the same static member)."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--instance-id", given])
    assert exit_.value.code == 2
    assert "argument --instance-id" in capsys.readouterr().err


@pytest.mark.kafka
def test_a_dashboard_port_in_use_exits_2_naming_it_not_uvicorns_exit_3(
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
) -> None:
    """It was uvicorn's log line and exit code 3 (SystemExit from deep in uvicorn.run),
    unlike every other bind error (--metrics-port: one line, exit 2)."""
    assert main(["dashboard", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {busy_port}" in err and "127.0.0.1" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_empty_partitions_variable_counts_as_unset_like_the_others() -> None:
    """``SAGALINE_PARTITIONS: ${SAGALINE_PARTITIONS:-}`` in a compose file stopped every
    process ("SAGALINE_PARTITIONS='' is not an integer"), while an empty
    SAGALINE_MAX_*, SAGALINE_REPLICATION_FACTOR or SAGALINE_HMAC_KEY counts as unset."""
    env = {"SAGALINE_PARTITIONS": "", "SAGALINE_MAX_STEPS": "", "SAGALINE_REPLICATION_FACTOR": ""}
    assert Settings.from_env(env).partitions == Settings().partitions


@pytest.mark.parametrize(
    ("command", "var", "attr", "default"),
    [
        (["participant", "run", "policy"], "SAGALINE_MAX_IN_FLIGHT", "max_in_flight", 16),
        (["participant", "run", "policy"], "SAGALINE_JOURNAL_KEEP_MS", "journal_keep_ms", None),
        (["coordinator", "run"], "SAGALINE_DECODED_STATES", "decoded_states", None),
    ],
)
def test_an_empty_service_variable_counts_as_unset(
    command: list[str],
    var: str,
    attr: str,
    default: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.cli import build_parser

    monkeypatch.setenv(var, "")
    assert getattr(build_parser().parse_args(command), attr) == default


def test_the_demo_refuses_a_dashboard_switch_it_cannot_read_before_starting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's dashboard (a child process with the demo's environment) stopped at
    once on SAGALINE_DASHBOARD_READ_OPEN=on, its error only in dashboard.log, while the
    demo printed its address and ran every saga: one line and exit 2 up front."""
    import services.demo as demo

    def started(*_args: object) -> object:
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "run_demo", started)
    monkeypatch.setenv("SAGALINE_DASHBOARD_READ_OPEN", "on")
    assert main(["demo", "--sagas", "20", "--no-ui"]) == 2
    err = capsys.readouterr().err
    assert "SAGALINE_DASHBOARD_READ_OPEN" in err and len(err.strip().splitlines()) == 1, err
    # Without a dashboard (--dashboard-port 0) the switch is not read.
    monkeypatch.setattr(demo, "run_demo", lambda options: type("R", (), {"exit_code": 0})())
    assert main(["demo", "--sagas", "20", "--no-ui", "--dashboard-port", "0"]) == 0


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_demo_dashboard_port_out_of_range_is_a_usage_error(
    port: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dashboard-port 70000 was an OverflowError traceback from the port probe, after
    the demo had created its topics and started its services."""
    import services.demo as demo

    def started(*_args: object) -> object:
        raise AssertionError("the demo started")

    monkeypatch.setattr(demo, "run_demo", started)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--dashboard-port", port])
    assert exit_.value.code == 2
    assert "argument --dashboard-port" in capsys.readouterr().err


@pytest.mark.kafka
@pytest.mark.parametrize("name", ["team/seats", "../seats", "seats desk"])
def test_a_participant_name_no_topic_can_hold_exits_2_before_anything_is_made(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    tmp_path: Path,
) -> None:
    """``participant run team/seats --catalogue M`` (M holding a Catalogue, which is
    not wrapped with NAME, so nothing checked it) made <state dir>/team/seats (or,
    for ``../seats``, a directory beside the state dir), imported the catalogue, and
    ended in a ValueError traceback from the command topic's name."""
    state = tmp_path / "state"
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(state))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    argv = ["participant", "run", name, "--catalogue", "tests.fixtures.participants_ready"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"participant name {name!r}" in err and "Traceback" not in err, err
    assert not state.exists() and not (tmp_path / "seats").exists()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SAGALINE_PARTITIONS", "3000000000"),
        ("SAGALINE_PARTITIONS", "100001"),
        ("SAGALINE_REPLICATION_FACTOR", "0"),
        ("SAGALINE_REPLICATION_FACTOR", "10001"),
        ("SAGALINE_REPLICATION_FACTOR", "3000000000"),
    ],
)
def test_a_partition_or_replica_count_kafka_cannot_take_is_a_settings_error(
    var: str, value: str
) -> None:
    """SAGALINE_PARTITIONS=3000000000 passed the settings and ended `coordinator run`
    in an OverflowError traceback from the topic set-up (100001: librdkafka's
    ValueError); SAGALINE_REPLICATION_FACTOR=0 was taken as 1 without a word."""
    with pytest.raises(SettingsError, match=var):
        Settings.from_env({var: value})


@pytest.mark.kafka
def test_a_partition_count_kafka_cannot_take_exits_2_naming_it_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
) -> None:
    monkeypatch.setenv("SAGALINE_PARTITIONS", "3000000000")
    assert main(["coordinator", "run"]) == 2
    err = capsys.readouterr().err
    assert "SAGALINE_PARTITIONS" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.kafka
def test_a_name_the_refund_example_lacks_without_catalogue_exits_2_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kafka_bootstrap: str,
    unique_prefix: str,
    tmp_path: Path,
) -> None:
    """`sagaline participant run trip` with `--catalogue` forgotten ended in a
    traceback (UnknownParticipantError, exit 1) after making `<state dir>/trip`; one
    line now names the example's participants and `--catalogue`, nothing made."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    monkeypatch.setenv("SAGALINE_STATE_DIR", str(tmp_path))
    assert main(["participant", "run", "trip"]) == 2
    err = capsys.readouterr().err
    assert "no participant 'trip'" in err and "--catalogue" in err, err
    assert not (tmp_path / "trip").exists()


@pytest.mark.kafka
@pytest.mark.parametrize("command", [["topics", "create"], ["coordinator", "run"]])
@pytest.mark.parametrize("name", ["team/seats", "two words"])
def test_a_participants_name_no_topic_can_hold_exits_2_not_a_traceback(
    command: list[str],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kafka_bootstrap: str,
    unique_prefix: str,
) -> None:
    """`--participants team/seats` raised ValueError out of main (a traceback, exit 1),
    where `participant run team/seats` says so in one line, exit 2."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("SAGALINE_TOPIC_PREFIX", unique_prefix)
    assert main([*command, "--participants", f"payments,{name}"]) == 2
    err = capsys.readouterr().err
    assert f"participant name {name!r} is not usable in a topic name" in err, err
    assert "--participants" in err, err


@pytest.mark.kafka
def test_a_dashboard_on_port_0_prints_the_port_it_listens_on(
    capsys: pytest.CaptureFixture[str],
    broker_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--port 0`` takes a free port, but the line said ``http://127.0.0.1:0/``: an
    address nobody listens on, and the only place the operator learns the port."""
    from services.dashboard import Dashboard

    bound: list[int] = []

    def serve(self: Dashboard, host: str, port: int, sockets: list[socket.socket]) -> None:
        bound.extend(sock.getsockname()[1] for sock in sockets)
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(Dashboard, "serve", serve)
    assert main(["dashboard", "--port", "0"]) == 0
    assert bound and bound[0] != 0
    assert f"sagaline dashboard on http://127.0.0.1:{bound[0]}/" in capsys.readouterr().out


def test_a_dashboard_on_port_0_listens_on_one_port_on_every_address_of_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --host that resolves to several addresses (``localhost``: ``::1`` and
    ``127.0.0.1`` on most machines) has a socket bound on each; with ``--port 0``
    each took a free port of its own, so the one port printed at start was served on
    one address only (``http://127.0.0.1:<printed>/`` refused where it was ``::1``'s)."""
    from services.dashboard import listen

    real = socket.getaddrinfo

    def two_addresses(host: str, port: int, *args: object, **kwargs: object) -> list[object]:
        return [
            info
            for address in ("127.0.0.1", "127.0.0.2")  # two addresses, as of localhost
            for info in real(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    sockets = listen("localhost", 0)
    try:
        bound = [sock.getsockname() for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    assert [host for host, _port in bound] == ["127.0.0.1", "127.0.0.2"]
    assert bound[0][1] != 0 and bound[1][1] == bound[0][1], bound

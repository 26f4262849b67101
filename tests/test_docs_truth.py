"""What the newcomer's docs state, checked against the code: README's configuration
table names every variable a process reads, with the defaults the code uses."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from schemas.limits import Limits
from schemas.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("schemas", "sagaline", "participants", "coordinator", "services")

# Read by the code but documented elsewhere on purpose: the local development
# launcher's (docs/kafka-local.md), the supervisor's hand-over to its children
# (docs/running-the-demo.md), and the librdkafka pass-through whose row is the
# pattern `SAGALINE_KAFKA_<NAME>`.
ELSEWHERE = {
    "SAGALINE_CACHE_DIR": "docs/kafka-local.md",
    "SAGALINE_NO_APT": "docs/kafka-local.md",
    "SAGALINE_KAFKA_VERSION": "docs/kafka-local.md",
    "SAGALINE_KAFKA_PORT": "docs/kafka-local.md",
    "SAGALINE_KAFKA_START_TIMEOUT": "docs/kafka-local.md",
    "SAGALINE_PARENT_PID": "docs/running-the-demo.md",
}


def _readme_table() -> dict[str, str]:
    """variable -> its default cell, from README's "Configuration" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([A-Z0-9_<>]+)`", cells[0]) if len(cells) >= 3 else None
        if match:
            rows[match.group(1)] = cells[1]
    return rows


def _variables_read_by_the_code() -> set[str]:
    found: set[str] = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"[\"'](SAGALINE_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text()))
    return found


def test_readme_lists_every_variable_the_code_reads() -> None:
    table = _readme_table()
    assert "KAFKA_BOOTSTRAP_SERVERS" in table and "SAGALINE_KAFKA_<NAME>" in table
    missing = []
    for var in sorted(_variables_read_by_the_code()):
        if var in table or var in ELSEWHERE:
            continue
        if var.startswith("SAGALINE_KAFKA_"):  # a client setting: the pattern row
            continue
        missing.append(var)
    assert not missing, f"README.md's Configuration table does not list {missing}"
    for var, doc in ELSEWHERE.items():
        assert var in (ROOT / doc).read_text(), (var, doc)


def test_readme_defaults_are_the_codes() -> None:
    table = _readme_table()
    settings, limits = Settings(), Limits()
    expected = {
        "SAGALINE_TOPIC_PREFIX": '`""`',
        "SAGALINE_PARTITIONS": f"`{settings.partitions}`",
        "SAGALINE_REPLICATION_FACTOR": "unset: the brokers'"
        if settings.replication.factor is None
        else f"`{settings.replication.factor}`",
        "SAGALINE_HMAC_KEY_ID": f"`{settings.hmac_key_id}`",
        "SAGALINE_TENANT_ID": f"`{settings.tenant_id}`",
        "SAGALINE_STATE_DIR": f"`{settings.state_dir}`",
        "SAGALINE_SECRET_KEY_ID": f"`{settings.secret_key_id}`",
        "SAGALINE_METRICS_HOST": f"`{settings.metrics_host}`",
        "SAGALINE_MAX_ARGS_BYTES": f"`{limits.max_args_bytes}`",
        "SAGALINE_MAX_RESULT_BYTES": f"`{limits.max_result_bytes}`",
        "SAGALINE_MAX_STEPS": f"`{limits.max_steps}`",
        "SAGALINE_MAX_RECORD_BYTES": f"`{limits.max_record_bytes}`",
    }
    wrong = {
        var: (table.get(var), want) for var, want in expected.items() if table.get(var) != want
    }
    assert not wrong, wrong


def test_every_file_the_docs_name_exists() -> None:
    """A doc that sends the reader to `some.md` or `tests/x.py` names a file that is
    there (the docs stand alone: nothing outside this repository)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for name in re.findall(r"`([A-Za-z0-9_./-]+\.(?:md|py))`", doc.read_text()):
            if "/" not in name and not name.endswith(".md"):
                continue  # a bare module file name, not a path
            if not ((ROOT / name).exists() or (ROOT / "docs" / name).exists()):
                missing.append(f"{doc.relative_to(ROOT)} -> {name}")
    assert not missing, missing


def _acl_rows() -> dict[str, list[str]]:
    """principal -> its cells (read, write, groups/other), from docs/security.md's
    "Kafka ACLs per identity" table."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## Kafka ACLs per identity", 1)[1]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| `User:"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_security_acls_list_what_each_process_asks_of_kafka() -> None:
    """Each permission the code needs, in the table and in the participant example:
    a least-privilege deployment granted only what the page lists must work."""
    rows = _acl_rows()
    text = (ROOT / "docs" / "security.md").read_text()
    example = text.split("For example, for the payments participant:", 1)[1].split("```")[1]
    grants = example.split("kafka-acls.sh")[1:]

    # The throw-away groups of the participant's readers, as the code names them.
    probe = (ROOT / "participants" / "ledger_probe.py").read_text()
    reader = (ROOT / "sagaline" / "kafka" / "_reader.py").read_text()
    assert 'f"sagaline-probe-{' in probe and 'f"sagaline-reader-{' in reader
    participant = rows["`User:<participant>`"][2]
    for group in ("sagaline-participant-<participant>", "sagaline-probe-*", "sagaline-reader-*"):
        assert f"`{group}`" in participant, (group, participant)
    for group in ("sagaline-probe-", "sagaline-reader-"):
        assert any("Read" in g and "prefixed" in g and f"--group {group}" in g for g in grants), (
            group,
            example,
        )

    # Journal pruning reads the command topic's retention (participants.runtime).
    assert "DescribeConfigs on `sagaline.commands.<participant>`" in participant
    assert any("DescribeConfigs" in g and "--topic sagaline.commands.payments" in g for g in grants)

    # The agent's client checks that a coordinator consumes (participants.readiness).
    client = (ROOT / "participants" / "client.py").read_text()
    assert "check_coordinator = True" in client
    agent = rows["`User:<agent>`"][2]
    assert "Describe on group `sagaline-coordinator`" in agent, agent

    # `--wait` reads the coordinator's committed offsets and the DLQ (sagaline.ops).
    operator = rows["`User:<operator>` (CLI)"][2]
    assert "Read on `sagaline.dlq`" in operator and "group `sagaline-coordinator`" in operator


def test_readme_defaults_of_the_service_commands_are_the_codes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows whose default lives in a command's options or a module constant."""
    from coordinator.shell import DECODED_STATES
    from schemas.limits import DAY_MS, RETENTION_MARGIN_MS
    from schemas.topics import EVENTS_CONFIG
    from services.cli import build_parser

    for var in ("SAGALINE_MAX_IN_FLIGHT", "SAGALINE_DECODED_STATES", "SAGALINE_JOURNAL_KEEP_MS"):
        monkeypatch.delenv(var, raising=False)
    parser = build_parser()
    participant = parser.parse_args(["participant", "run", "p"])
    coordinator = parser.parse_args(["coordinator", "run"])
    table = _readme_table()
    assert table["SAGALINE_MAX_IN_FLIGHT"] == f"`{participant.max_in_flight}`"
    assert participant.journal_keep_ms is None  # auto
    assert table["SAGALINE_JOURNAL_KEEP_MS"] == "`auto`"
    assert coordinator.decoded_states is None  # the shell's own default
    assert table["SAGALINE_DECODED_STATES"] == f"`{DECODED_STATES}`"
    # what sagaline.events keeps a record as created (retention + segment), plus a day
    events = int(EVENTS_CONFIG["retention.ms"]) + int(EVENTS_CONFIG["segment.ms"])
    assert Limits().terminal_memory_ms == events + RETENTION_MARGIN_MS == 373 * DAY_MS
    assert table["SAGALINE_TERMINAL_MEMORY_MS"] == "373 days"


def test_the_sizes_the_docs_state_for_operator_input_are_the_codes() -> None:
    """docs/security.md's request body limit and docs/operating.md's operator text cap."""
    from schemas.limits import MAX_OPERATOR_TEXT_BYTES
    from services.dashboard.app import MAX_BODY_BYTES

    security = (ROOT / "docs" / "security.md").read_text()
    operating = (ROOT / "docs" / "operating.md").read_text()
    assert f"A request body over {MAX_BODY_BYTES // 1024} KiB" in security
    assert f"at most\n{MAX_OPERATOR_TEXT_BYTES // 1024} KiB ({MAX_OPERATOR_TEXT_BYTES} bytes" in (
        operating
    )


def test_the_settings_say_what_an_unset_bootstrap_does() -> None:
    """schemas/settings.py said ``bootstrap=None`` meant "the local broker", while a
    service command with it unset stops (docs/deploying.md: they never start one)."""
    import schemas.settings as module
    from sagaline.kafka import BrokerNotConfigured, require_bootstrap

    with pytest.raises(BrokerNotConfigured):
        require_bootstrap(Settings(), "sagaline coordinator run")
    row = next(line for line in (module.__doc__ or "").splitlines() if "KAFKA_BOOTSTRAP" in line)
    for doc in (row, Settings.__doc__ or ""):
        assert "the local broker" not in doc and "the project's local broker" not in doc, doc
    for doc in (module.__doc__ or "", Settings.__doc__ or ""):
        assert "BrokerNotConfigured" in doc, doc


NEWCOMER_DOCS = (
    "README.md",
    "docs/quickstart.md",
    "docs/agents.md",
    "docs/writing-a-participant.md",
    "docs/concepts.md",
)


def _python_blocks(doc: str) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of ``doc``, indented ones (in a list) too."""
    text = (ROOT / doc).read_text()
    found = re.finditer(r"^([ \t]*)```python\n(.*?)^\1```", text, re.S | re.M)
    return [(text[: m.start()].count("\n") + 1, textwrap.dedent(m.group(2))) for m in found]


def _names_read_after_their_except(tree: ast.AST) -> list[str]:
    """``except E as name:`` unbinds ``name`` when the handler ends, so a statement
    after the ``try`` that reads it raises NameError (unless it was assigned again)."""
    wrong = []
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, statement in enumerate(block):
                if not isinstance(statement, ast.Try):
                    continue
                unbound = {h.name for h in statement.handlers if h.name}
                for later in block[i + 1 :]:
                    for name in ast.walk(later):
                        if isinstance(name, ast.Name) and name.id in unbound:
                            if isinstance(name.ctx, ast.Store):
                                unbound.discard(name.id)
                            else:
                                wrong.append(f"line {name.lineno}: {name.id}")
    return wrong


@pytest.mark.parametrize("doc", NEWCOMER_DOCS)
def test_the_python_samples_of_the_newcomer_docs_run_as_python(doc: str) -> None:
    """Each sample parses, and reads no name Python has already unbound: a sample that
    reads `stopped` after `except ... as stopped:` stops there with a NameError."""
    wrong = []
    for line, code in _python_blocks(doc):
        try:
            tree = ast.parse(code)
        except SyntaxError as error:
            wrong.append(f"{doc}:{line}: {error}")
            continue
        wrong += [f"{doc}:{line}: {w}" for w in _names_read_after_their_except(tree)]
    assert not wrong, wrong


ADAPTER_MODULES = ("langchain", "openai_agents", "pydantic_ai")


def _docstring_samples(module: str) -> list[tuple[int, str]]:
    """(line, code) of each ``::`` sample of ``sagaline/agents/MODULE.py``'s docstring
    (what ``help()`` shows a user of that adapter): the indented lines after ``::``."""
    text = (ROOT / "sagaline" / "agents" / f"{module}.py").read_text()
    docstring = ast.get_docstring(ast.parse(text), clean=False) or ""
    found = re.finditer(r"::\n\n((?:(?:    .*)?\n)+)", docstring)
    return [(docstring[: m.start()].count("\n") + 3, textwrap.dedent(m.group(1))) for m in found]


@pytest.mark.parametrize("module", ADAPTER_MODULES)
def test_the_samples_of_the_adapter_docstrings_run_as_python(module: str) -> None:
    """As the newcomer docs' samples: each parses and reads no name Python has unbound
    (the pydantic-ai adapter's read ``stopped`` after ``except ... as stopped:``)."""
    samples = _docstring_samples(module)
    assert samples, f"no sample found in sagaline/agents/{module}.py"
    wrong = []
    for line, code in samples:
        tree = ast.parse(code)
        wrong += [f"{module}.py:{line}: {w}" for w in _names_read_after_their_except(tree)]
    assert not wrong, wrong


def test_the_quickstart_says_how_soon_a_saga_without_a_coordinator_fails() -> None:
    """The wait the quickstart promises is the client's: the check gives a coordinator
    that is just starting this long to join before `CoordinatorNotRunning`."""
    import inspect

    from participants.readiness import require_coordinator

    patience = inspect.signature(require_coordinator).parameters["patience_s"].default
    text = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    assert f"the first saga fails within {patience:g} s" in text


def _commands_and_flags_named(
    docs: dict[str, str],
) -> list[tuple[str, int, list[str], list[str]]]:
    """(doc, line, words after `sagaline`, `--flags` after them) of every `sagaline ...`
    the ``docs`` (name -> text) write (in code blocks and in prose); not Python's
    `from sagaline import ...` / `import sagaline`."""
    found = []
    for name, text in docs.items():
        for m in re.finditer(
            r"(?<!from )(?<!import )sagaline((?: [a-z][a-z-]*)+)"
            r"((?: (?:--[a-z][a-z-]*|[^\s`|]+))*)",
            text,
        ):
            flags = re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", m.group(0))
            line = text[: m.start()].count("\n") + 1
            found.append((name, line, m.group(1).split(), flags))
    return found


def _commands_the_cli_lacks(docs: dict[str, str]) -> tuple[list[str], int]:
    """Each `sagaline ...` of ``docs`` that the CLI's parser does not take, and how
    many documented flags were checked."""
    import argparse

    from services.cli import build_parser

    def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    top = build_parser()
    wrong: list[str] = []
    checked = 0
    for doc, line, words, flags in _commands_and_flags_named(docs):
        parser, path = top, list[str]()
        for word in words:
            choices = subcommands(parser)
            if word in choices:
                parser, path = choices[word], [*path, word]
            elif choices:  # a top-level command too: prose never says "sagaline <word>"
                named = " ".join(["sagaline", *path])
                wrong.append(f"{doc}:{line}: {named} has no {word!r}")
                break
            else:
                break  # a positional argument
        if not path:
            continue
        taken = {option for action in parser._actions for option in action.option_strings}
        for flag in flags:
            checked += 1
            if flag not in taken:
                wrong.append(f"{doc}:{line}: sagaline {' '.join(path)} takes no {flag}")
    return wrong, checked


def test_every_command_and_flag_the_docs_name_is_the_clis() -> None:
    """A doc that tells an operator to run `sagaline saga list` or `incidents resolve
    --comment` sends them to a usage error: each sub-command written after a command
    that has sub-commands is one of them, and each `--flag` after it is one it takes."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    wrong, checked = _commands_the_cli_lacks(
        {str(doc.relative_to(ROOT)): doc.read_text() for doc in docs}
    )
    assert checked >= 40, f"only {checked} documented flags found: is the pattern still right?"
    assert not wrong, wrong


def test_the_command_check_reports_what_the_cli_does_not_have() -> None:
    """The check above, shown a doc with a command renamed or gone, reports it: a
    top-level command the CLI lacks (`sagaline sagas show`, `sagaline serve`) was
    skipped as prose, so the rename the check is for went unseen at the top level."""
    wrong, _checked = _commands_the_cli_lacks(
        {
            "ops.md": "run `sagaline sagas show s-1`\n"
            "then `sagaline saga waits`\n"
            "and `sagaline incidents list --open`\n"
            "not `from sagaline import connect` (Python)\n"
        }
    )
    assert wrong == [
        "ops.md:1: sagaline has no 'sagas'",
        "ops.md:2: sagaline saga has no 'waits'",
        "ops.md:3: sagaline incidents list takes no --open",
    ]


def _table_rows(doc: str, heading: str) -> dict[str, str]:
    """first cell -> second cell of the first table under ``heading`` in ``doc``."""
    text = (ROOT / doc).read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0]] = cells[1]
    return rows


def test_the_demo_options_table_gives_the_demos_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/running-the-demo.md's "Options" repeats `sagaline demo`'s defaults; each
    number there is the parser's (a default changed in one place only was not seen)."""
    from services.cli import build_parser

    monkeypatch.delenv("SAGALINE_PARTITIONS", raising=False)
    args = build_parser().parse_args(["demo"])
    rows = _table_rows("docs/running-the-demo.md", "## Options")
    numbers = {k: v for k, v in rows.items() if re.fullmatch(r"[0-9.]+", v)}
    assert len(numbers) >= 7, rows
    wrong = {}
    for option, default in numbers.items():
        dest = option.strip("`").split()[0].removeprefix("--").replace("-", "_")
        if float(getattr(args, dest)) != float(default):
            wrong[option] = (default, getattr(args, dest))
    assert not wrong, wrong


def test_the_limits_table_of_operating_gives_the_codes_defaults() -> None:
    """docs/operating.md's "Limits" table repeats README's defaults in bytes and KiB."""
    from schemas.limits import DAY_MS

    limits = Limits()
    rows = _table_rows("docs/operating.md", "## Limits")

    def kib(n: int) -> str:
        return f"{n} ({n // 1024} KiB)"

    expected = {
        "`SAGALINE_MAX_ARGS_BYTES`": kib(limits.max_args_bytes),
        "`SAGALINE_MAX_RESULT_BYTES`": kib(limits.max_result_bytes),
        "`SAGALINE_MAX_STEPS`": str(limits.max_steps),
        "`SAGALINE_MAX_RECORD_BYTES`": kib(limits.max_record_bytes),
        "`SAGALINE_MAX_PARTICIPANTS`": str(limits.max_participants),
        "`SAGALINE_TERMINAL_MEMORY_MS`": f"{limits.terminal_memory_ms // DAY_MS} days",
    }
    wrong = {var: (rows.get(var), want) for var, want in expected.items() if rows.get(var) != want}
    assert not wrong, wrong

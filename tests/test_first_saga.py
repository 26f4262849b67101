"""The first saga of docs/quickstart.md, run as a newcomer runs it, on the real broker;
and the facade stays lazy (``import sagaline`` pulls in nothing else)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sagaline

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "first_saga.py"


@pytest.mark.kafka
def test_first_saga_runs_and_compensates_R1(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SAGALINE_TOPIC_PREFIX": unique_prefix,
        "SAGALINE_PARTITIONS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        cwd=tmp_path,  # as a newcomer would: from their own directory
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    # What docs/quickstart.md shows the console printing, and nothing else: the last
    # line alone was checked, while every run also printed librdkafka's
    # "%6|...|BGQUEUE|rdkafka#producer-N| ... Purging 1 unserved events from
    # background queue" on stderr.
    assert done.stdout == (
        "COMPENSATED [('reserve_seat', 'COMPENSATED'), ('charge_card', 'NOT_COMMITTED')]"
        " held: set()\n"
    ), done.stdout
    assert "rdkafka" not in done.stderr, done.stderr


def test_first_saga_has_at_most_ten_lines_of_sagaline_code() -> None:
    source = EXAMPLE.read_text()
    _existing, sagaline_part = source.split("# --- Sagaline: ten lines. ---")
    lines = [
        line
        for line in sagaline_part.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert len(lines) <= 10, lines
    ast.parse(source)


def test_import_sagaline_is_lazy() -> None:
    code = (
        "import sys, sagaline; "
        "heavy = [m for m in ('participants', 'confluent_kafka', 'coordinator', 'services')"
        " if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_facade_exports_the_first_saga_names() -> None:
    from participants.client import SagaClient

    assert sagaline.SagaClient is SagaClient
    assert callable(sagaline.connect) and callable(sagaline.compensable)
    assert isinstance(sagaline.__version__, str) and sagaline.__version__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = sagaline.nope  # type: ignore[attr-defined]


def test_every_exported_name_resolves() -> None:
    for name in sagaline.__all__:
        assert getattr(sagaline, name) is not None, name


def _code_lines(text: str) -> list[str]:
    """Non-blank lines, without the linter's `# noqa` remarks."""
    lines = (line.split("  # noqa")[0].rstrip() for line in text.splitlines())
    return [line for line in lines if line.strip()]


def test_the_quickstart_shows_the_example_in_full() -> None:
    """docs/quickstart.md prints examples/first_saga.py "in full": the block is the file
    (less its docstring, blank lines and linter remarks), so the two cannot drift."""
    doc = (EXAMPLE.parents[1] / "docs" / "quickstart.md").read_text()
    after = doc.split("`examples/first_saga.py` (in this repository), in full:", 1)[1]
    block = after.split("```python\n", 1)[1].split("\n```", 1)[0]
    source = EXAMPLE.read_text()
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    assert docstring is not None
    body = source.split('"""', 2)[2]
    assert _code_lines(block) == _code_lines(body)


def test_every_client_error_the_saga_docs_name_is_on_the_facade() -> None:
    """The quickstart and docs/agents.md import only ``sagaline``; an error they say a
    call raises must be catchable from it. ``except sagaline.X:`` with a missing ``X``
    fails only when an error arrives, as an AttributeError in place of the handler."""
    import participants.client as client

    errors = {
        name
        for name, value in vars(client).items()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == client.__name__  # not DeliveryFailed: sagaline.kafka's
    }
    docs = EXAMPLE.parents[1] / "docs"
    named = set()
    for doc in ("quickstart.md", "agents.md"):
        named |= set(re.findall(r"`(?:sagaline\.)?([A-Z]\w+)`", (docs / doc).read_text()))
    missing = sorted(name for name in errors & named if not hasattr(sagaline, name))
    assert not missing, missing

"""Shared by the benchmark scripts: where a number was measured, how it is printed,
and how it lands in ``docs/benchmarks.md`` (one ``## <Title>`` section per script,
so scripts never overwrite each other's results)."""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_DOC = REPO_ROOT / "docs" / "benchmarks.md"


def cpu_model() -> str:
    """The CPU's marketing name (Linux), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """One line: cores, CPU, OS and Python, for the header of a result."""
    return (
        f"{os.cpu_count()} cores ({cpu_model()}), {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def require_broker(bootstrap: str, timeout_s: float = 10.0) -> None:
    """Exit with a message naming ``bootstrap`` when no broker answers a metadata
    request there within ``timeout_s`` (instead of librdkafka's connection errors and
    a traceback half a minute later, from whatever asks the broker first)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        raise SystemExit(
            f"no Kafka broker answers at {bootstrap} within {timeout_s:.0f} s ({reason}). "
            "Start one (`python -m services.kafka_cli up` prints its address) and set "
            "KAFKA_BOOTSTRAP_SERVERS to it, or unset KAFKA_BOOTSTRAP_SERVERS to use the "
            "local broker."
        ) from None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table, columns padded so it also reads well in a terminal;
    the first column is left-aligned, the others right-aligned (numbers)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def write_docs_section(title: str, body: str, path: Path = BENCHMARKS_DOC) -> None:
    """Replace the ``## {title}`` section of ``path`` with ``body`` (append it when
    absent), leaving every other section as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


__all__ = [
    "BENCHMARKS_DOC",
    "REPO_ROOT",
    "cpu_model",
    "machine_description",
    "markdown_table",
    "require_broker",
    "write_docs_section",
]

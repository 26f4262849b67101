"""Typed errors of the participant SDK.

Every message says what is wrong, where (the tool and the method), and what to do,
because the person reading it is usually deploying a service, not debugging ours.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class SagalineParticipantError(Exception):
    """Base of every error raised by ``participants``."""


class ContractChanged(SagalineParticipantError):
    """A step reached its participant scheduled with a contract that is not the
    tool's current declaration in a way that matters for safety: an IRREVERSIBLE tool
    without an approval (R7). The tool does not run; the step fails as a business
    rejection, and the agent re-reads the published catalogue."""


@dataclass(frozen=True)
class CatalogueProblem:
    """One thing wrong with one declaration.

    ``tool`` is the tool (or method) the problem belongs to, so a list of problems
    can be read, sorted and grepped per tool.
    """

    tool: str
    message: str

    def __str__(self) -> str:
        return f"{self.tool}: {self.message}"


class CatalogueError(SagalineParticipantError):
    """``wrap()`` found declarations that cannot work (R4).

    Raised once, at start-up, with every problem found, so a deploy fails on the
    first boot with the full list rather than one typo at a time.
    """

    def __init__(self, problems: Iterable[CatalogueProblem], *, catalogue: str = "") -> None:
        self.problems: tuple[CatalogueProblem, ...] = tuple(problems)
        self.catalogue = catalogue
        where = f" {catalogue!r}" if catalogue else ""
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        lines = [f"catalogue{where} has {count} {noun}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class UnknownToolError(SagalineParticipantError, KeyError):
    """A tool name that the catalogue does not hold."""

    def __init__(self, name: str, catalogue: str, known: Iterable[str], hint: str = "") -> None:
        self.name = name
        self.catalogue = catalogue
        known_list = ", ".join(sorted(known)) or "(none)"
        suggestion = f" Did you mean {hint!r}?" if hint else ""
        self.text = (
            f"catalogue {catalogue!r} has no tool {name!r}.{suggestion} Known tools: {known_list}."
        )
        super().__init__(self.text)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.text


class InvalidArgumentsError(SagalineParticipantError, ValueError):
    """Arguments that do not match a tool's schema; the tool was not called."""

    def __init__(self, tool: str, detail: str) -> None:
        self.tool = tool
        self.detail = detail
        super().__init__(f"invalid arguments for tool {tool!r}: {detail}")


class ContractViolation(SagalineParticipantError, TypeError):
    """A tool, compensation, lookup or verification returned something its contract
    does not allow (for example a lookup that returns a string)."""


class NotDeclaredError(SagalineParticipantError):
    """A compensation, lookup or verification was asked of a tool that declares none."""


class LedgerRefError(SagalineParticipantError):
    """A command refers to a payload on the ledger (``LedgerRef``) that cannot be
    used: the record is gone (past retention), or is not what the reference says."""

"""What every SDK adapter shares: a catalogue's tools as (name, description, JSON
Schema) and one way to run a call as a step of a saga.

An adapter binds tools to a :class:`~participants.client.Saga`; the agent run goes
inside the saga's ``with`` block, so the saga ends with the run: completed when the
run returns, aborted (the committed steps compensated) when it raises. A step that
does not commit raises its :class:`~participants.client.SagaCallError` out of the
tool, through the framework, out of the run: the agent does not keep working on a
saga that is already unwinding.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from participants.catalogue import Catalogue, ToolKind, ToolSpec
from participants.client import CallRefused, Saga

# Options of ``saga.call``, never tool arguments (the catalogue refuses such names).
SAGA_CALL_OPTIONS = frozenset({"step_id", "depends_on", "timeout_s"})

__all__ = ["SagaTool", "saga_tools"]


@dataclass(frozen=True)
class SagaTool:
    """One catalogue tool bound to a saga: each call is the saga's next step."""

    saga: Saga
    spec: ToolSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def description(self) -> str:
        return self.spec.model_description()

    @property
    def parameters(self) -> dict[str, Any]:
        return self.spec.input_schema()

    @property
    def irreversible(self) -> bool:
        return self.spec.kind is ToolKind.IRREVERSIBLE

    @property
    def read_only(self) -> bool:
        return self.spec.read_only

    def __call__(self, args: Mapping[str, Any]) -> Any:
        return self.saga.call(self.spec.name, **tool_args(self.saga, self.spec.name, args))

    async def acall(self, args: Mapping[str, Any]) -> Any:
        return await self.saga.acall(self.spec.name, **tool_args(self.saga, self.spec.name, args))


def tool_args(saga: Saga, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The model's arguments as ``saga.call`` keywords; :class:`CallRefused` when one
    is named like an option of ``saga.call`` (it would steer the saga, not reach the
    tool: ``step_id`` naming an earlier step hands back that step's result)."""
    clash = sorted(SAGA_CALL_OPTIONS.intersection(args))
    if clash:
        raise CallRefused(
            f"{tool} got argument(s) {', '.join(clash)}, which no tool takes"
            " (they are options of saga.call); nothing was written",
            saga_id=saga.saga_id,
            step_id="",
            tool=tool,
            limit="reserved-args",
            size=len(clash),
        )
    return dict(args)


def saga_tools(saga: Saga, catalogue: Catalogue | Iterable[ToolSpec]) -> list[SagaTool]:
    specs = catalogue.values() if isinstance(catalogue, Catalogue) else catalogue
    return [SagaTool(saga, spec) for spec in specs]

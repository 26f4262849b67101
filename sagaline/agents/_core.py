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
from participants.client import Saga

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
        return self.saga.call(self.spec.name, **dict(args))

    async def acall(self, args: Mapping[str, Any]) -> Any:
        return await self.saga.acall(self.spec.name, **dict(args))


def saga_tools(saga: Saga, catalogue: Catalogue | Iterable[ToolSpec]) -> list[SagaTool]:
    specs = catalogue.values() if isinstance(catalogue, Catalogue) else catalogue
    return [SagaTool(saga, spec) for spec in specs]

"""A one-tool catalogue served by ``participant run --catalogue sasl_tools:catalogue``
in the SASL test (tests/test_kafka_sasl.py)."""

from __future__ import annotations

from participants import Catalogue, CompensationContext, compensable, compensation, tool, wrap


class Desk:
    @tool(description="Book a desk")
    @compensable(by="release")
    def book(self, desk: str) -> str:
        return f"booking-{desk}"

    @compensation
    def release(self, ctx: CompensationContext) -> None:
        pass


def catalogue() -> Catalogue:
    return wrap(Desk(), name="desks")

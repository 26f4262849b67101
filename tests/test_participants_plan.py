"""Plan check (R17): each proposed call classified, and ordering flagged that would
leave an effect nobody can undo (seed 003: fallible before the pivot, irreversible
after it)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from pydantic import BaseModel, field_validator

from participants import (
    CallClass,
    Catalogue,
    FindingCode,
    InvalidArgumentsError,
    PlannedCall,
    Severity,
    check_plan,
    tool,
    wrap,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def refunds(monkeypatch: pytest.MonkeyPatch) -> Catalogue:
    """Seed 003's refund tools (tests/fixtures/participants_good.py)."""
    monkeypatch.syspath_prepend(str(ROOT))
    module = importlib.import_module("tests.fixtures.participants_good")
    catalogue: Catalogue = wrap(module.Refunds(), name="refunds")
    return catalogue


def call(tool: str, **args: object) -> PlannedCall:
    return PlannedCall(tool, args)


ATLAS = [
    call("get_order", order_id="o-1"),
    call("place_hold", order_id="o-1"),
    call("issue_credit", order_id="o-1", amount_cents=400_000),
    call("send_email", order_id="o-1", body="refunded"),
]


def test_each_call_is_classified(refunds: Catalogue) -> None:
    report = check_plan([*ATLAS, call("close_ticket", order_id="o-1"), call("nope")], refunds)
    assert [c.call_class for c in report.calls] == [
        CallClass.READ_ONLY,
        CallClass.REVERSIBLE,
        CallClass.PIVOT,
        CallClass.IRREVERSIBLE,
        CallClass.COMPENSATABLE,
        CallClass.UNKNOWN,
    ]


def test_seed_003_ordering_passes(refunds: Catalogue) -> None:
    """Reversible and fallible first, the pivot, the irreversible email last."""
    report = check_plan(ATLAS, refunds)
    assert report.ok, report.render()
    assert FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE not in report.codes()


def test_irreversible_before_a_fallible_step_is_an_error(refunds: Catalogue) -> None:
    """R17: irreversible before fallible; if the later step fails, the saga unwinds and
    the email cannot be unsent."""
    plan = [call("send_email", order_id="o-1", body="x"), call("place_hold", order_id="o-1")]
    report = check_plan(plan, refunds)
    [finding] = [f for f in report.findings if f.code is FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE]
    assert (finding.severity, finding.step, finding.tool) == (Severity.ERROR, 0, "send_email")
    assert "step 1 place_hold" in finding.message
    assert not report.ok


def test_irreversible_before_the_pivot_is_an_error(refunds: Catalogue) -> None:
    """The pivot can fail too; an irreversible step belongs after it."""
    plan = [
        call("send_email", order_id="o-1", body="x"),
        call("issue_credit", order_id="o-1", amount_cents=1),
    ]
    codes = check_plan(plan, refunds).codes()
    assert FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE in codes


def test_irreversible_before_a_read_is_an_error(refunds: Catalogue) -> None:
    """A read-only call is a step of the saga: if it fails (the order is not found, it
    times out), the saga unwinds before any pivot, and the email stays sent. The check
    passed such a plan."""
    plan = [call("send_email", order_id="o-1", body="x"), call("get_order", order_id="o-1")]
    report = check_plan(plan, refunds)
    [finding] = [f for f in report.findings if f.code is FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE]
    assert (finding.step, finding.tool) == (0, "send_email")
    assert "step 1 get_order (READ_ONLY)" in finding.message
    assert not report.ok


def test_where_reads_are_not_steps_an_irreversible_step_before_one_is_not_flagged(
    refunds: Catalogue,
) -> None:
    """The MCP proxy passes read-only calls straight through: their failure is the
    agent's to handle, it does not unwind the saga."""
    plan = [call("send_email", order_id="o-1", body="x"), call("get_order", order_id="o-1")]
    report = check_plan(plan, refunds, reads_are_steps=False)
    assert FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE not in report.codes()
    assert report.ok


def test_irreversible_after_the_pivot_is_not_flagged(refunds: Catalogue) -> None:
    plan = [
        call("issue_credit", order_id="o-1", amount_cents=1),
        call("send_email", order_id="o-1", body="x"),
        call("place_hold", order_id="o-1"),
    ]
    codes = check_plan(plan, refunds).codes()
    assert FindingCode.IRREVERSIBLE_BEFORE_FALLIBLE not in codes


def test_fallible_work_after_the_pivot_is_a_warning(refunds: Catalogue) -> None:
    """R6/R17: past the pivot a failure is retried forward, never compensated."""
    report = check_plan([*ATLAS, call("close_ticket", order_id="o-1")], refunds)
    [finding] = [f for f in report.findings if f.code is FindingCode.WORK_AFTER_PIVOT]
    assert (finding.severity, finding.step, finding.tool) == (Severity.WARNING, 4, "close_ticket")
    assert report.ok


def test_more_than_one_pivot_is_an_error(refunds: Catalogue) -> None:
    plan = [
        call("issue_credit", order_id="o-1", amount_cents=1),
        call("issue_credit", order_id="o-2", amount_cents=1),
    ]
    report = check_plan(plan, refunds)
    [finding] = [f for f in report.findings if f.code is FindingCode.MULTIPLE_PIVOTS]
    assert (finding.step, finding.severity) == (1, Severity.ERROR)


def test_unknown_tool_is_an_error_naming_the_tool(refunds: Catalogue) -> None:
    report = check_plan([call("refund_everything")], refunds)
    [finding] = report.findings
    assert (finding.code, finding.tool, finding.severity) == (
        FindingCode.UNKNOWN_TOOL,
        "refund_everything",
        Severity.ERROR,
    )


def test_arguments_that_do_not_match_the_schema_are_an_error(refunds: Catalogue) -> None:
    report = check_plan([call("place_hold", order=1)], refunds)
    [finding] = report.findings
    assert finding.code is FindingCode.INVALID_ARGS
    assert "order_id" in finding.message


def test_write_without_compensation_is_flagged(refunds: Catalogue) -> None:
    """An IRREVERSIBLE tool with no correction: once it commits, its effect stays."""
    report = check_plan([call("issue_credit", order_id="o", amount_cents=1)], refunds)
    [finding] = [f for f in report.findings if f.code is FindingCode.NO_COMPENSATION]
    assert finding.severity is Severity.WARNING and "operations" in finding.message


def test_irreversible_steps_note_the_approval_they_wait_for(refunds: Catalogue) -> None:
    """R7: an IRREVERSIBLE step suspends for human approval."""
    report = check_plan(ATLAS, refunds)
    noted = [f.tool for f in report.findings if f.code is FindingCode.NEEDS_APPROVAL]
    assert noted == ["issue_credit", "send_email"]


@pytest.mark.parametrize(
    ("calls", "said"),
    [(5, "got int"), ({"tool": "get_order", "args": {"order_id": "o-1"}}, "one call")],
)
def test_calls_that_are_not_a_list_are_a_value_error_saying_so(
    refunds: Catalogue, calls: object, said: str
) -> None:
    """What a model may pass to the MCP proxy's saga_check_plan as ``calls``: a number
    raised a TypeError (a protocol error, not a tool result the agent reads), and one
    call object instead of a list was read key by key ("planned call 0 ... got str
    'tool'")."""
    with pytest.raises(ValueError, match="must be a list") as caught:
        check_plan(calls, refunds)  # type: ignore[arg-type]
    assert said in str(caught.value)


def test_plain_mappings_and_several_catalogues_are_accepted(refunds: Catalogue) -> None:
    from participants import compensable, tool

    class Mail:
        @tool(description="Post a letter")
        @compensable(by="recall")
        def post_letter(self, to: str) -> str:
            return "l-1"

        def recall(self) -> None:
            pass

    report = check_plan(
        [
            {"tool": "place_hold", "args": {"order_id": "o"}},
            {"tool": "post_letter", "args": {"to": "x"}},
        ],
        [refunds, wrap(Mail(), name="mail")],
    )
    assert [c.participant for c in report.calls] == ["refunds", "mail"]
    assert report.ok


def test_render_is_a_readable_report(refunds: Catalogue) -> None:
    plan = [call("send_email", order_id="o-1", body="x"), call("place_hold", order_id="o-1")]
    text = check_plan(plan, refunds).render()
    assert "IRREVERSIBLE_BEFORE_FALLIBLE step 0 send_email" in text
    assert text.rstrip().endswith("NOT OK: fix the errors above before running")


def test_a_tool_name_two_participants_declare_is_an_error(refunds: Catalogue) -> None:
    """Tool names are one namespace for an agent (``saga.call("place_hold")``): when two
    participants both declare ``place_hold``, the call reaches only one of them, so the
    plan cannot be checked against "the" tool and must not be reported OK."""
    from participants import compensable, tool

    class Warehouse:
        @tool(description="Hold stock in the warehouse")
        @compensable(reversibility="IRREVERSIBLE")
        def place_hold(self, order_id: str) -> str:
            return "h-1"

    report = check_plan(
        [call("place_hold", order_id="o-1")], [refunds, wrap(Warehouse(), name="warehouse")]
    )
    assert not report.ok, report.render()
    [finding] = [f for f in report.findings if f.code is FindingCode.AMBIGUOUS_TOOL]
    assert (finding.severity, finding.step, finding.tool) == (Severity.ERROR, 0, "place_hold")
    assert "'refunds'" in finding.message and "'warehouse'" in finding.message


def test_the_same_participant_twice_is_not_ambiguous(refunds: Catalogue) -> None:
    """Two catalogues of one participant (the same service listed twice) name one
    command topic: nothing is ambiguous."""
    report = check_plan(ATLAS, [refunds, refunds])
    assert FindingCode.AMBIGUOUS_TOOL not in report.codes()
    assert report.ok, report.render()


class _Address(BaseModel):
    country: str

    @field_validator("country", mode="before")
    @classmethod
    def _known(cls, value: object) -> object:
        return {"FR": "France", "DE": "Germany"}[value]  # type: ignore[index]  # KeyError


class _Shipping:
    @tool(description="Quote shipping", read_only=True)
    def quote(self, to: _Address) -> int:
        return 1


@pytest.mark.parametrize("country", ["XX", ["FR"]])
def test_arguments_a_validator_fails_on_are_an_error_naming_the_tool(country: object) -> None:
    """A validator of the tool's own types that raises KeyError or TypeError (pydantic
    turns only ValueError and AssertionError into a validation error) ended plan check,
    and an MCP client's call, in that exception's traceback."""
    shipping = wrap(_Shipping(), name="shipping")
    with pytest.raises(InvalidArgumentsError, match="invalid arguments for tool 'quote'"):
        shipping["quote"].validate_args({"to": {"country": country}})
    report = check_plan([call("quote", to={"country": country})], shipping)
    [finding] = report.findings
    assert (finding.code, finding.tool) == (FindingCode.INVALID_ARGS, "quote")

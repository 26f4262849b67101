"""wrap(): every declaration checked at start-up, one error listing every problem,
each naming the tool and what to fix (R4); the catalogue's schema export, contract
snapshot and call handles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from participants import (
    CatalogueError,
    CatalogueProblem,
    CompensationApproval,
    CompensationContext,
    ContractViolation,
    InvalidArgumentsError,
    LookupResult,
    NotDeclaredError,
    RetryPolicy,
    Reversibility,
    UnknownToolError,
    compensable,
    compensation,
    tool,
    wrap,
)
from schemas import StepContract
from schemas.redaction import Secret, is_redacted


def problems_of(*participants: object, name: str = "p") -> list[CatalogueProblem]:
    with pytest.raises(CatalogueError) as caught:
        wrap(*participants, name=name)
    return list(caught.value.problems)


def only_problem(*participants: object) -> CatalogueProblem:
    problems = problems_of(*participants)
    assert len(problems) == 1, problems
    return problems[0]


# ------------------------------------------------------------------- by= (seed 000)


def test_typo_in_by_names_the_tool_and_the_method_and_suggests_the_closest() -> None:
    """R4 / seed 000: a typo in by= fails on boot, naming tool and missing method."""

    class Inventory:
        @tool(description="Reserve inventory")
        @compensable(by="relase_inventory")
        def reserve_inventory(self, sku: str) -> str:
            return "res-1"

        @compensation
        def release_inventory(self, ctx: CompensationContext) -> None:
            pass

    problem = only_problem(Inventory())
    assert problem.tool == "reserve_inventory"
    assert "'relase_inventory'" in problem.message
    assert "did you mean 'release_inventory'?" in problem.message
    assert "reserve_inventory" in str(CatalogueError([problem]))


def test_by_naming_nothing_close_says_to_add_the_method() -> None:
    class Inventory:
        @tool(description="Reserve inventory")
        @compensable(by="undo_everything")
        def reserve_inventory(self) -> str:
            return "res-1"

    problem = only_problem(Inventory())
    assert problem.tool == "reserve_inventory"
    assert "no method 'undo_everything'" in problem.message
    assert "add a method undo_everything()" in problem.message


def test_by_naming_the_tool_itself_is_rejected() -> None:
    class Loop:
        @tool(description="Toggle")
        @compensable(by="toggle")
        def toggle(self) -> str:
            return "t"

    problem = only_problem(Loop())
    assert (problem.tool, "names the tool itself" in problem.message) == ("toggle", True)


def test_compensable_without_by_must_be_irreversible() -> None:
    """Seed 000: by is required unless reversibility is IRREVERSIBLE."""

    class Hold:
        @tool(description="Hold")
        @compensable(reversibility=Reversibility.REVERSIBLE)
        def hold(self) -> str:
            return "h"

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "without by=" in problem.message and "IRREVERSIBLE" in problem.message


# --------------------------------------------------------- compensation signatures


def test_compensation_with_two_arguments_names_tool_method_and_expected_signature() -> None:
    class Hold:
        @tool(description="Hold")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self, hold_id: str, reason: str) -> None:
            pass

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "compensation method 'release' takes 2 arguments (hold_id, reason)" in problem.message
    assert "no argument or one CompensationContext" in problem.message


def test_compensation_whose_argument_is_not_a_compensation_context_is_rejected() -> None:
    class Hold:
        @tool(description="Hold")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self, hold_id: str) -> None:
            pass

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "'release' takes hold_id: str" in problem.message


def test_compensation_with_a_required_keyword_only_argument_is_rejected() -> None:
    class Hold:
        @tool(description="Hold")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self, *, ctx: CompensationContext) -> None:
            pass

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "'release' has a required keyword-only argument 'ctx'" in problem.message


# ----------------------------------------------------------------------------- R4


def test_write_tool_without_compensation_is_rejected() -> None:
    """R4: every write tool declares its compensation (or IRREVERSIBLE, or read-only)."""

    class Card:
        @tool(description="Charge a card")
        def charge_card(self, amount_cents: int) -> str:
            return "ch-1"

    problem = only_problem(Card())
    assert problem.tool == "charge_card"
    assert "write tool with no declared compensation (R4)" in problem.message
    assert "@compensable(by=" in problem.message and "read_only=True" in problem.message


def test_irreversible_write_without_by_and_read_only_tools_are_valid() -> None:
    class Wire:
        @tool(description="Send a wire transfer")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def send_wire_transfer(self, amount: str, to: str) -> str:
            return "w-1"

        @tool(description="Balance", read_only=True)
        def balance(self) -> int:
            return 0

    assert sorted(wrap(Wire(), name="wire")) == ["balance", "send_wire_transfer"]


def test_compensable_without_tool_is_rejected() -> None:
    class Half:
        @tool(description="Ok", read_only=True)
        def ok(self) -> None:
            pass

        @compensable(by="ok")
        def forgotten(self) -> None:
            pass

    problem = only_problem(Half())
    assert problem.tool == "forgotten"
    assert "@compensable but no @tool" in problem.message


# ---------------------------------------------------------------- duplicate names


def test_duplicate_tool_names_across_participants_name_both_methods() -> None:
    class A:
        @tool(description="Look", read_only=True)
        def look(self) -> None:
            pass

    class B:
        @tool(description="Look too", read_only=True, name="look")
        def peek(self) -> None:
            pass

    problem = only_problem(A(), B())
    assert problem.tool == "look"
    assert "declared 2 times (A.look, B.peek)" in problem.message


def test_duplicate_tool_names_within_one_participant_are_rejected() -> None:
    class A:
        @tool(description="Look", read_only=True)
        def look(self) -> None:
            pass

        @tool(description="Look again", read_only=True, name="look")
        def look_again(self) -> None:
            pass

    problem = only_problem(A())
    assert "(A.look, A.look_again)" in problem.message


# ------------------------------------------------------------------ lookup, verify


def test_lookup_naming_no_method_names_the_tool_and_the_method() -> None:
    """R11: the lookup that settles an unknown outcome must exist."""

    class Hold:
        @tool(description="Hold", lookup="find_hodl")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self) -> None:
            pass

        def find_hold(self, key: str) -> LookupResult | None:
            return None

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "lookup method 'find_hodl'" in problem.message
    assert "did you mean 'find_hold'?" in problem.message


@pytest.mark.parametrize(
    ("signature", "expected"),
    [
        ("def find(self) -> None: ...", "takes 0 arguments"),
        ("def find(self, key: int) -> None: ...", "takes key: int"),
        ("def find(self, key: str) -> str: ...", "returns str"),
    ],
)
def test_lookup_with_a_wrong_signature_is_rejected(signature: str, expected: str) -> None:
    namespace: dict[str, Any] = {"LookupResult": LookupResult}
    exec(signature, namespace)

    class Hold:
        find = namespace["find"]

        @tool(description="Hold", lookup="find")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self) -> None:
            pass

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert f"lookup method 'find' {expected}" in problem.message
    assert "idempotency key" in problem.message or "LookupResult" in problem.message


def test_verify_naming_no_method_names_the_tool_and_the_method() -> None:
    """R12: the verification that must pass before a step counts as compensated."""

    class Hold:
        @tool(description="Hold", verify="is_released")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self) -> None:
            pass

    problem = only_problem(Hold())
    assert problem.tool == "hold"
    assert "verify method 'is_released'" in problem.message


def test_verify_with_a_wrong_signature_or_return_type_is_rejected() -> None:
    class Hold:
        @tool(description="Hold", verify="check")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        @tool(description="Hold two", verify="check_str")
        @compensable(by="release")
        def hold_two(self) -> str:
            return "h"

        def release(self) -> None:
            pass

        def check(self) -> bool:
            return True

        def check_str(self, ctx: CompensationContext) -> str:
            return ""

    problems = {p.tool: p.message for p in problems_of(Hold())}
    assert "verify method 'check' takes 0 arguments" in problems["hold"]
    assert "verify method 'check_str' returns str; it must return bool" in problems["hold_two"]


def test_verify_without_a_compensation_is_rejected() -> None:
    class Mail:
        @tool(description="Mail", verify="check")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def mail(self) -> str:
            return "m"

        def check(self, ctx: CompensationContext) -> bool:
            return True

    problem = only_problem(Mail())
    assert problem.tool == "mail"
    assert "no compensation to verify" in problem.message


def test_lookup_and_verify_may_be_functions_like_by() -> None:
    """R11/R12 for plain-function tools (docs/quickstart.md): a function passed to
    wrap() is a tool, so a lookup cannot be a sibling method; ``lookup=`` and
    ``verify=`` take the function itself, as ``by=`` does. Before, wrap() died with
    "TypeError: 'function' object is not iterable", naming no tool."""
    released: list[str] = []

    def find_hold(idempotency_key: str) -> LookupResult | None:
        return LookupResult.committed("h-1", "h-1") if idempotency_key == "k" else None

    def is_released(ctx: CompensationContext) -> bool:
        return ctx.result in released

    def release(ctx: CompensationContext) -> None:
        released.append(ctx.result)

    @tool(lookup=find_hold, verify=is_released)  # type: ignore[arg-type]
    @compensable(by=release)
    def hold(sku: str) -> str:
        """Hold stock."""
        return "h-1"

    spec = wrap(hold, name="holds")["hold"]
    assert (spec.contract().has_lookup, spec.contract().has_verify) == (True, True)
    assert (spec.lookup_name, spec.verify_name) == ("find_hold", "is_released")
    assert spec.lookup("k") == LookupResult.committed("h-1", "h-1")
    ctx = CompensationContext("s-1", "hold", {"sku": "A"}, "h-1", "k")
    assert spec.verify(ctx) is False
    spec.compensate(ctx)
    assert spec.verify(ctx) is True


def test_lookup_function_with_a_wrong_signature_or_neither_name_nor_callable() -> None:
    def find(key: int) -> LookupResult | None:
        return None

    class Hold:
        @tool(description="Hold", lookup=find)
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        @tool(description="Hold two", lookup=42)  # type: ignore[arg-type]
        @compensable(by="release")
        def hold_two(self) -> str:
            return "h"

        def release(self) -> None:
            pass

    problems = {p.tool: p.message for p in problems_of(Hold())}
    assert "lookup method 'find' takes key: int" in problems["hold"]
    assert "@tool(lookup=42) is neither a method name nor a callable" in problems["hold_two"]


# ------------------------------------------------------------ other declarations


def test_pivot_on_a_read_only_tool_is_rejected() -> None:
    """R6: the pivot is a write after which the saga only goes forward."""

    class Reader:
        @tool(description="Read", read_only=True, pivot=True)
        def read(self) -> str:
            return ""

    problem = only_problem(Reader())
    assert (problem.tool, "read_only and pivot" in problem.message) == ("read", True)


def test_read_only_tool_with_a_compensation_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True)
        @compensable(by="unread")
        def read(self) -> str:
            return ""

        def unread(self) -> None:
            pass

    problem = only_problem(Reader())
    assert problem.tool == "read"
    assert "read_only but declares @compensable" in problem.message


def test_tool_without_description_or_docstring_is_rejected() -> None:
    class Reader:
        @tool(read_only=True)
        def read(self) -> str:
            return ""

    problem = only_problem(Reader())
    assert (problem.tool, "has no description" in problem.message) == ("read", True)


def test_tool_name_an_llm_api_would_refuse_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True, name="read the thing")
        def read(self) -> str:
            return ""

    problem = only_problem(Reader())
    assert problem.tool == "read the thing"
    assert "not accepted by LLM tool-calling APIs" in problem.message


def test_tool_with_variadic_arguments_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True)
        def read(self, *ids: str) -> str:
            return ""

    problem = only_problem(Reader())
    assert problem.tool == "read"
    assert "parameter 'ids' is variadic positional" in problem.message


def test_a_required_parameter_the_schema_cannot_hold_is_rejected() -> None:
    """pydantic drops a field named ``_token`` (private) or ``model_config`` (its
    config) from the argument model: the JSON schema never shows it, so no call can
    pass it, and every call failed with "missing 1 required positional argument"
    (a TypeError, classified as a rejection). Such a tool can never work."""

    class Odd:
        @tool(description="Search", read_only=True)
        def search(self, query: str, _token: str) -> str:
            return query

        @tool(description="Tune", read_only=True)
        def tune(self, model_config: dict[str, str]) -> str:
            return ""

        @tool(description="Fine", read_only=True)
        def fine(self, query: str, _page: int = 1) -> str:  # a default: never needed
            return query

    problems = {p.tool: p.message for p in problems_of(Odd())}
    assert set(problems) == {"search", "tune"}
    assert "parameter '_token'" in problems["search"] and "rename it" in problems["search"]
    assert "parameter 'model_config'" in problems["tune"]


def test_tool_with_unresolvable_type_hints_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True)
        def read(self, item: NotImportedAnywhere) -> str:  # type: ignore[name-defined]  # noqa: F821
            return ""

    problem = only_problem(Reader())
    assert problem.tool == "read"
    assert "cannot be resolved" in problem.message and "NotImportedAnywhere" in problem.message


def test_secret_fields_naming_no_argument_is_rejected() -> None:
    class Card:
        @tool(description="Charge", secret_fields=("card_numbr",))
        @compensable(by="refund")
        def charge(self, card_number: str) -> str:
            return "c"

        def refund(self) -> None:
            pass

    problem = only_problem(Card())
    assert problem.tool == "charge"
    assert "'card_numbr'" in problem.message and "did you mean 'card_number'?" in problem.message


def test_declaration_values_of_the_wrong_type_are_problems_naming_the_tool() -> None:
    """``@tool(name=...)`` not a string, a ``secret_fields`` entry not a string, and
    ``read_only`` / ``pivot`` not a bool: wrap() ended in a bare TypeError or
    AttributeError naming no tool, or (``pivot="no"``) the plan check read a pivot
    the contract, which pydantic reads as False, does not declare."""

    class Odd:
        @tool(description="Charge", name=7)  # type: ignore[arg-type]
        @compensable(by="refund")
        def charge(self, card_number: str) -> str:
            return "c"

        @tool(description="Pay", secret_fields=(["card", "number"],))  # type: ignore[list-item]
        @compensable(by="refund")
        def pay(self, card: dict[str, str]) -> str:
            return "p"

        @tool(description="Book", pivot="no")  # type: ignore[arg-type]
        @compensable(by="refund")
        def book(self, seat: str) -> str:
            return "b"

        @tool(description="Look", read_only="yes")  # type: ignore[arg-type]
        def look(self, seat: str) -> str:
            return "l"

        def refund(self) -> None:
            pass

    problems = {p.tool: p.message for p in problems_of(Odd())}
    assert "tool name 7 is not a string" in problems["7"]
    assert "secret_fields must list argument names" in problems["pay"]
    assert "pivot must be True or False, got 'no'" in problems["book"]
    assert "read_only must be True or False, got 'yes'" in problems["look"]


def test_a_parameter_with_no_json_schema_is_a_problem_at_wrap() -> None:
    """``on_done: Callable[[], None] | None = None`` (an existing function passed as a
    tool) built an argument model, so wrap() and ``catalogue check`` passed it, but no
    JSON schema: the participant runtime then failed as it published its catalogue
    (and ``tool_definitions()`` for an agent) with PydanticInvalidForJsonSchema."""

    class Mailer:
        @tool(description="Notify", read_only=True)
        def notify(self, to: str, on_done: Callable[[], None] | None = None) -> str:
            return to

        @tool(description="Make", read_only=True)
        def make(self, kind: type) -> str:
            return "made"

    problems = {p.tool: p.message for p in problems_of(Mailer())}
    assert set(problems) == {"notify", "make"}
    assert "no JSON schema" in problems["notify"]


def test_contract_values_that_cannot_work_are_rejected() -> None:
    """R8/R11/R13 fields: a deadline, a reversal window, exception types, an owner."""

    class Odd:
        @tool(
            description="Odd",
            deadline=0,
            reversal_window=-1,
            non_retryable=("ValueError",),  # type: ignore[arg-type]
            owner="",
        )
        @compensable(by="undo")
        def odd(self) -> str:
            return ""

        def undo(self) -> None:
            pass

    messages = [p.message for p in problems_of(Odd()) if p.tool == "odd"]
    assert any("deadline must be positive" in m for m in messages)
    assert any("reversal_window must be positive" in m for m in messages)
    assert any("non_retryable must list exception classes" in m for m in messages)
    assert any("owner is empty" in m for m in messages)


def test_one_string_or_one_exception_class_is_one_entry_not_a_sequence() -> None:
    """``resources=("inventory")`` (the trailing comma forgotten) is the string
    "inventory": it must be the one resource it names, not nine one-letter resources
    in the contract (R2 serializes on them); ``secret_fields="card_number"`` the one
    secret argument, not eleven unknown one-letter ones; ``non_retryable=KeyError``
    one rejection type, not a TypeError at import naming no tool."""

    class Card:
        @tool(
            description="Charge",
            resources=("payments"),
            secret_fields="card_number",
            non_retryable=OverflowError,  # type: ignore[arg-type]
            transient=KeyError,  # type: ignore[arg-type]
        )
        @compensable(by="refund")
        def charge(self, card_number: str) -> str:
            return "c"

        def refund(self) -> None:
            pass

    spec = wrap(Card(), name="card")["charge"]
    assert spec.contract().resources == ["payments"]
    assert spec.secret_paths == ("card_number",)
    assert spec.is_business_rejection(OverflowError())
    assert not spec.is_business_rejection(KeyError("k"))  # transient wins over built-in


def test_contract_fields_of_the_wrong_type_are_problems_naming_the_tool() -> None:
    """``retry=3`` used to pass wrap() and fail only when the participant built the
    StepContract at run time (a pydantic error naming no tool); an unknown
    ``compensation_approval`` escaped wrap() as a bare ValueError. Both are
    declarations that cannot work: problems of the tool, reported with the others."""

    class Odd:
        @tool(description="Odd", retry=3)  # type: ignore[arg-type]
        @compensable(by="undo")
        def odd_retry(self) -> str:
            return ""

        @tool(description="Odd", compensation_approval="NEVER")  # type: ignore[arg-type]
        @compensable(by="undo")
        def odd_approval(self) -> str:
            return ""

        def undo(self) -> None:
            pass

    problems = {p.tool: p.message for p in problems_of(Odd())}
    assert "retry" in problems["odd_retry"] and "RetryPolicy" in problems["odd_retry"]
    assert "compensation_approval" in problems["odd_approval"]
    assert "'NEVER'" in problems["odd_approval"] and "ALWAYS_ALLOWED" in problems["odd_approval"]


def test_reversal_window_on_a_read_only_tool_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True, reversal_window=60)
        def read(self) -> str:
            return ""

    problem = only_problem(Reader())
    assert "read_only but declares a reversal_window" in problem.message


# ---------------------------------------------------------------- participants


def test_a_class_instead_of_an_instance_is_rejected() -> None:
    class Inventory:
        @tool(description="Read", read_only=True)
        def read(self) -> str:
            return ""

    problem = only_problem(Inventory)
    assert "pass Inventory()" in problem.message


def test_a_participant_with_no_tools_is_rejected() -> None:
    class Empty:
        def helper(self) -> None:
            pass

    problem = only_problem(Empty())
    assert (problem.tool, "no method decorated with @tool" in problem.message) == ("Empty", True)


def test_a_participant_name_that_cannot_be_a_topic_is_rejected() -> None:
    class Reader:
        @tool(description="Read", read_only=True)
        def read(self) -> str:
            return ""

    [problem] = problems_of(Reader(), name="bad name/with slash")
    assert "cannot be part of a Kafka topic name" in problem.message


def test_every_problem_is_reported_in_one_error() -> None:
    """R4: the whole list on the first boot, not one typo per deploy."""

    class Broken:
        @tool(description="A")
        @compensable(by="undo_a_typo")
        def a(self) -> str:
            return ""

        def undo_a(self) -> None:
            pass

        @tool(description="B")
        def b(self) -> str:
            return ""

        @tool(description="C", lookup="nowhere")
        @compensable(by="undo_a")
        def c(self) -> str:
            return ""

    with pytest.raises(CatalogueError) as caught:
        wrap(Broken(), name="broken")
    assert sorted(p.tool for p in caught.value.problems) == ["a", "b", "c"]
    text = str(caught.value)
    assert text.startswith("catalogue 'broken' has 3 problems:")
    assert "undo_a_typo" in text and "nowhere" in text and "(R4)" in text


def test_default_participant_name_is_the_snake_cased_class_name() -> None:
    class InventoryService:
        @tool(description="Read", read_only=True)
        def read(self) -> str:
            return ""

    assert wrap(InventoryService()).name == "inventory_service"


# ---------------------------------------------------- schema export and contract


class Refunds:
    @tool(
        description="Place a hold on an order",
        lookup="find_hold",
        verify="hold_released",
        resources=("order",),
        reversal_window=3600,
        compensation_approval=CompensationApproval.ALWAYS_ALLOWED,
        retry=RetryPolicy(max_attempts=5),
        owner="payments-oncall",
        deadline=3,
    )
    @compensable(by="release_hold", reversibility=Reversibility.REVERSIBLE)
    def place_hold(
        self,
        order_id: Annotated[str, Field(description="The order to hold")],
        amount_cents: int = 0,
    ) -> str:
        return f"hold-{order_id}"

    def release_hold(self, ctx: CompensationContext) -> None:
        pass

    def find_hold(self, key: str) -> LookupResult | None:
        return None

    def hold_released(self, ctx: CompensationContext) -> bool:
        return True

    @tool(description="Charge a card", pivot=True, secret_fields=("cvv",))
    @compensable(by="refund")
    def charge(self, card: Secret, cvv: str, amount_cents: int) -> str:
        return "ch-1"

    def refund(self) -> None:
        pass


def test_tool_definitions_are_json_schema_an_llm_api_accepts() -> None:
    definitions = {d["name"]: d for d in wrap(Refunds(), name="refunds").tool_definitions()}
    hold = definitions["place_hold"]
    assert hold["description"] == "Place a hold on an order"
    schema = hold["input_schema"]
    assert schema["type"] == "object"
    assert schema["required"] == ["order_id"]
    assert schema["properties"]["order_id"]["type"] == "string"
    assert schema["properties"]["order_id"]["description"] == "The order to hold"
    assert schema["properties"]["amount_cents"] == {
        "default": 0,
        "title": "Amount Cents",
        "type": "integer",
    }
    assert schema["additionalProperties"] is False


def test_tool_definitions_validate_as_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for definition in wrap(Refunds(), name="refunds").tool_definitions():
        jsonschema.Draft202012Validator.check_schema(definition["input_schema"])


def test_contract_snapshot_carries_every_declared_field() -> None:
    """What the coordinator decides from (StepScheduled.contract)."""
    contract = wrap(Refunds(), name="refunds")["place_hold"].contract()
    assert contract == StepContract(
        tool="place_hold",
        participant="refunds",
        reversibility=Reversibility.REVERSIBLE,
        compensation="release_hold",
        read_only=False,
        pivot=False,
        has_lookup=True,
        has_verify=True,
        resources=["order"],
        reversal_window_ms=3_600_000,
        compensation_approval=CompensationApproval.ALWAYS_ALLOWED,
        retry=RetryPolicy(max_attempts=5),
        compensation_retry=RetryPolicy(
            max_attempts=8, initial_backoff_ms=200, max_backoff_ms=10_000
        ),
        deadline_ms=3_000,
        owner="payments-oncall",
    )


def test_contract_participant_can_be_overridden() -> None:
    spec = wrap(Refunds(), name="refunds")["charge"]
    assert spec.contract("billing").participant == "billing"
    assert spec.contract().pivot is True


def test_invoke_validates_arguments_before_calling_the_tool() -> None:
    spec = wrap(Refunds(), name="refunds")["place_hold"]
    with pytest.raises(InvalidArgumentsError) as caught:
        spec.invoke({"order_id": "o-1", "amount_cents": "lots"})
    assert caught.value.tool == "place_hold" and "amount_cents" in str(caught.value)
    with pytest.raises(InvalidArgumentsError, match="surprise: Extra inputs"):
        spec.invoke({"order_id": "o-1", "surprise": 1})
    assert spec.invoke({"order_id": "o-1"}) == "hold-o-1"


def test_redact_masks_declared_and_typed_secrets() -> None:
    spec = wrap(Refunds(), name="refunds")["charge"]
    redacted = spec.redact({"card": "4111111111111111", "cvv": "123", "amount_cents": 5})
    assert is_redacted(redacted["card"]) and is_redacted(redacted["cvv"])
    assert redacted["amount_cents"] == 5


class CamelCard(BaseModel):
    """A provider's API model: its fields travel under camelCase aliases."""

    model_config = ConfigDict(alias_generator=to_camel)
    card_number: str
    holder_name: str


class CamelPayments:
    @tool(description="Pay", secret_fields=("card.card_number", "api_key", "cards.*.card_number"))
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def pay(
        self,
        card: CamelCard,
        api_key: Annotated[str, Field(alias="apiKey")],
        cards: list[CamelCard] | None = None,
    ) -> str:
        return "p-1"


def test_secret_fields_named_by_field_name_are_redacted_under_their_aliases() -> None:
    """The model's schema shows a field's alias, so that is how the agent sends it
    (``cardNumber``, ``apiKey``); ``secret_fields`` naming the field by its Python
    name redacted only that spelling, and the secret went to the ledger in clear."""
    spec = wrap(CamelPayments(), name="payments")["pay"]
    args = {
        "card": {"cardNumber": "4111-2222", "holderName": "Ann Lee"},
        "apiKey": "k-5150",
        "cards": [{"cardNumber": "5500-0004", "holderName": "Bo"}],
    }
    assert spec.validate_args(args)["api_key"] == "k-5150"
    redacted = spec.redact(args)
    assert is_redacted(redacted["card"]["cardNumber"]), redacted
    assert is_redacted(redacted["apiKey"]) and is_redacted(redacted["cards"][0]["cardNumber"])
    assert redacted["card"]["holderName"] == "Ann Lee"


def test_unknown_tool_names_the_catalogue_and_suggests_the_closest() -> None:
    catalogue = wrap(Refunds(), name="refunds")
    with pytest.raises(UnknownToolError) as caught:
        catalogue["place_hodl"]
    assert "no tool 'place_hodl'" in str(caught.value)
    assert "Did you mean 'place_hold'?" in str(caught.value)


def test_asking_for_an_undeclared_compensation_or_lookup_is_a_typed_error() -> None:
    class Wire:
        @tool(description="Wire")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def wire(self) -> str:
            return "w"

    spec = wrap(Wire(), name="wire")["wire"]
    ctx = CompensationContext("s", "wire", {}, "w", "idem-1")
    with pytest.raises(NotDeclaredError, match="declares no compensation"):
        spec.compensate(ctx)
    with pytest.raises(NotDeclaredError, match="needs a person"):
        spec.lookup("idem-1")


def test_a_lookup_returning_something_else_is_a_contract_violation() -> None:
    class Hold:
        @tool(description="Hold", lookup="find")
        @compensable(by="release")
        def hold(self) -> str:
            return "h"

        def release(self) -> None:
            pass

        def find(self, key):  # type: ignore[no-untyped-def]
            return "hold-1"

    spec = wrap(Hold(), name="hold")["hold"]
    with pytest.raises(ContractViolation, match="returned str"):
        spec.lookup("idem-1")


class _Store:
    """The provider the first participant of docs/writing-a-participant.md talks to."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}

    def reserve(self, sku: str, qty: int, key: str) -> str:
        self.held[key] = f"res-{sku}-{qty}"
        return self.held[key]

    def release(self, reservation: str, key: str) -> None:
        self.held = {k: v for k, v in self.held.items() if v != reservation}

    def by_key(self, key: str) -> None:
        return None

    def state(self, reservation: str) -> str:
        return "held" if reservation in self.held.values() else "released"


def test_the_first_participant_of_the_guide_wraps_and_runs() -> None:
    """docs/writing-a-participant.md's first example, executed as printed (with a store
    of ours): wrap() accepts it and the tool runs under a call context."""
    from participants import CallContext, Catalogue, call_context

    doc = (Path(__file__).resolve().parents[1] / "docs" / "writing-a-participant.md").read_text()
    block = doc.split("## A first participant", 1)[1].split("```python\n", 1)[1]
    namespace: dict[str, object] = {"store": _Store()}
    exec(compile(block.split("\n```", 1)[0], "writing-a-participant.md", "exec"), namespace)
    catalogue = namespace["catalogue"]
    assert isinstance(catalogue, Catalogue) and catalogue.name == "inventory"
    names = sorted(d["name"] for d in catalogue.tool_definitions())  # what a model reads
    assert names == ["reserve_inventory", "send_wire_transfer"]
    spec = catalogue["reserve_inventory"]
    contract = spec.contract()
    assert contract.has_lookup and contract.has_verify and contract.resources == ["inventory"]
    assert catalogue["send_wire_transfer"].contract().reversibility.value == "IRREVERSIBLE"
    call = CallContext("s-1", "01-reserve_inventory", "reserve_inventory", "k-1")
    with call_context(call):
        assert spec.invoke({"sku": "A"}) == "res-A-1"

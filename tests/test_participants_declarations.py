"""Declarations: the Python twin of seed 000 (@tool, @compensable, @compensation,
CompensationContext), and how a declared tool is called (sync or async)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from participants import (
    Accepted,
    BusinessRejection,
    CompensationContext,
    LookupResult,
    ReconcileResult,
    Reversibility,
    compensable,
    compensation,
    tool,
    wrap,
)
from participants.declarations import TransientError
from participants.errors import CatalogueError, ContractViolation
from schemas import compensation_key


class Inventory:
    """Seed 000's reserveInventory / releaseInventory, recording what it was given."""

    def __init__(self) -> None:
        self.released: list[CompensationContext] = []

    @tool(description="Reserve inventory")
    @compensable(by="release_inventory")
    def reserve_inventory(self, sku: str, qty: int = 1) -> dict[str, object]:
        return {"reservation_id": "res-8891", "sku": sku, "qty": qty}

    @compensation
    def release_inventory(self, ctx: CompensationContext) -> None:
        self.released.append(ctx)

    @compensable(by="release_inventory")
    @tool(description="Reserve inventory, decorators the other way round")
    def reserve_inventory_reversed(self, sku: str) -> str:
        return "res-1"


def test_decorator_order_does_not_matter() -> None:
    catalogue = wrap(Inventory(), name="inventory")
    above = catalogue["reserve_inventory"].contract()
    below = catalogue["reserve_inventory_reversed"].contract()
    assert (above.compensation, above.reversibility) == ("release_inventory", "COMPENSATABLE")
    assert (below.compensation, below.reversibility) == ("release_inventory", "COMPENSATABLE")


def test_compensable_defaults_to_compensatable() -> None:
    """Seed 000: reversibility() default COMPENSATABLE."""
    spec = wrap(Inventory(), name="inventory")["reserve_inventory"]
    assert spec.reversibility is Reversibility.COMPENSATABLE


def test_decorators_return_the_function_unchanged() -> None:
    """The tool stays an ordinary method: callable directly, in a unit test."""
    assert Inventory().reserve_inventory("sku-1") == {
        "reservation_id": "res-8891",
        "sku": "sku-1",
        "qty": 1,
    }


def test_compensation_receives_exactly_the_input_and_the_result() -> None:
    """Seed 000 CompensationContext: input() is the exact JSON arguments, result() what
    the tool returned."""
    inventory = Inventory()
    spec = wrap(inventory, name="inventory")["reserve_inventory"]
    args = {"sku": "sku-42", "qty": 3}
    result = spec.invoke(args)

    spec.compensate(
        CompensationContext(
            saga_id="saga-1",
            tool_name=spec.name,
            input=args,
            result=result,
            idempotency_key="idem-1",
        )
    )

    [ctx] = inventory.released
    assert ctx.input == {"sku": "sku-42", "qty": 3}
    assert ctx.result == {"reservation_id": "res-8891", "sku": "sku-42", "qty": 3}
    assert (ctx.saga_id, ctx.tool_name) == ("saga-1", "reserve_inventory")


def test_compensation_key_derives_from_the_idempotency_key_when_not_given() -> None:
    """R8: the compensation key derives from the forward key, so retries repeat it."""
    ctx = CompensationContext("s", "t", {}, None, idempotency_key="idem-7")
    assert ctx.compensation_key == compensation_key("idem-7")


def test_a_compensation_may_take_no_argument() -> None:
    calls: list[str] = []

    class Hold:
        @tool(description="Place a hold")
        @compensable(by="release")
        def place(self) -> str:
            return "hold-1"

        def release(self) -> None:
            calls.append("released")

    spec = wrap(Hold(), name="hold")["place"]
    spec.compensate(CompensationContext("s", "place", {}, "hold-1", "idem-1"))
    assert calls == ["released"]


class AsyncPayments:
    def __init__(self) -> None:
        self.voided: list[object] = []

    @tool(description="Authorize a payment", lookup="find", verify="is_voided")
    @compensable(by="void", completion_within=30)
    async def authorize(self, amount_cents: int) -> str:
        await asyncio.sleep(0)
        return f"auth-{amount_cents}"

    async def void(self, ctx: CompensationContext) -> Accepted:
        self.voided.append(ctx.result)
        return Accepted("void-op-1")

    async def find(self, idempotency_key: str) -> LookupResult | None:
        return LookupResult.committed("auth-5", "auth-5") if idempotency_key == "k" else None

    async def is_voided(self, ctx: CompensationContext) -> bool:
        return ctx.result in self.voided


def test_an_async_tool_runs_from_sync_code() -> None:
    spec = wrap(AsyncPayments(), name="payments")["authorize"]
    assert spec.is_async
    assert spec.invoke({"amount_cents": 5}) == "auth-5"


def test_an_async_tool_runs_from_async_code() -> None:
    spec = wrap(AsyncPayments(), name="payments")["authorize"]
    assert asyncio.run(spec.ainvoke({"amount_cents": 7})) == "auth-7"


def test_a_sync_tool_runs_from_async_code() -> None:
    spec = wrap(Inventory(), name="inventory")["reserve_inventory_reversed"]
    assert asyncio.run(spec.ainvoke({"sku": "a"})) == "res-1"


def test_sync_invoke_of_an_async_tool_inside_a_running_loop_says_to_use_ainvoke() -> None:
    spec = wrap(AsyncPayments(), name="payments")["authorize"]

    async def inside_loop() -> None:
        spec.invoke({"amount_cents": 1})

    with pytest.raises(RuntimeError, match="ainvoke"):
        asyncio.run(inside_loop())


def test_async_compensation_lookup_and_verify() -> None:
    """R11 lookup by key, R12 accepted-asynchronously and verification, all async."""
    payments = AsyncPayments()
    spec = wrap(payments, name="payments")["authorize"]
    ctx = CompensationContext("s", "authorize", {"amount_cents": 5}, "auth-5", "k")

    assert spec.compensate(ctx) == Accepted("void-op-1")
    assert spec.verify(ctx) is True
    assert spec.lookup("k") == LookupResult(ReconcileResult.COMMITTED, "auth-5", "auth-5")
    assert spec.lookup("other").status is ReconcileResult.NOT_FOUND
    assert asyncio.run(spec.alookup("k")).status is ReconcileResult.COMMITTED
    assert asyncio.run(spec.averify(ctx)) is True


def test_business_rejection_and_declared_types_are_non_retryable() -> None:
    """R9: business rejections are never retried."""

    class LimitExceeded(Exception):
        pass

    class Card:
        @tool(description="Charge", non_retryable=(LimitExceeded,))
        @compensable(by="refund")
        def charge(self) -> str:
            return "ch-1"

        def refund(self) -> None:
            pass

    spec = wrap(Card(), name="card")["charge"]
    assert spec.is_business_rejection(BusinessRejection("no"))
    assert spec.is_business_rejection(LimitExceeded())
    assert not spec.is_business_rejection(TimeoutError())


def test_durations_accept_timedelta_or_seconds() -> None:
    """R11 deadline and R13 reversal window, recorded in milliseconds."""

    class Booking:
        @tool(description="Book", deadline=2.5, reversal_window=timedelta(hours=1))
        @compensable(by="cancel")
        def book(self) -> str:
            return "b-1"

        def cancel(self) -> None:
            pass

    contract = wrap(Booking(), name="booking")["book"].contract()
    assert contract.deadline_ms == 2_500
    assert contract.reversal_window_ms == 3_600_000


def test_irreversible_tool_may_name_a_correction() -> None:
    """An IRREVERSIBLE tool may still name by=: a correction, not an undo."""

    class Mail:
        @tool(description="Email the customer")
        @compensable(by="send_correction", reversibility=Reversibility.IRREVERSIBLE)
        def send_email(self, to: str) -> str:
            return "mail-1"

        def send_correction(self, ctx: CompensationContext) -> None:
            pass

    contract = wrap(Mail(), name="mail")["send_email"].contract()
    assert (contract.reversibility, contract.compensation) == (
        Reversibility.IRREVERSIBLE,
        "send_correction",
    )


def test_description_defaults_to_the_docstring() -> None:
    class Notes:
        @tool(read_only=True)
        def read_note(self, note_id: str) -> str:
            """Read a note by id.

            Longer text the model does not need.
            """
            return ""

    assert wrap(Notes(), name="notes")["read_note"].description == "Read a note by id."


def test_provider_operation_id_from_a_declared_key_or_a_string_result() -> None:
    class Credits:
        @tool(description="Issue a credit", operation_id="credit_id")
        @compensable(by="void")
        def issue(self) -> dict[str, str]:
            return {"credit_id": "cr-9"}

        @tool(description="Hold")
        @compensable(by="void")
        def hold(self) -> str:
            return "hold-3"

        def void(self) -> None:
            pass

    catalogue = wrap(Credits(), name="credits")
    assert catalogue["issue"].provider_operation_id({"credit_id": "cr-9"}) == "cr-9"
    assert catalogue["hold"].provider_operation_id("hold-3") == "hold-3"


# ------------------------------------------------- wrapping existing functions


RELEASED: list[str] = []


def release_seat(reservation_id: str, reason: str = "saga compensation") -> None:
    """An undo function that exists already, with its own signature."""
    RELEASED.append(f"{reservation_id}:{reason}")


def refund_payment(ctx: CompensationContext) -> str:
    return f"refund-{ctx.result}-{ctx.input['amount']}"


class Booking:
    @tool(description="Reserve a seat")
    @compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result["id"]})
    def reserve_seat(self, flight: str) -> dict[str, str]:
        return {"id": f"r-{flight}"}

    @tool(description="Charge")
    @compensable(by=refund_payment)
    def charge(self, amount: int) -> str:
        return "ch-1"

    @tool(description="Hold a seat by method name, args built from the input")
    @compensable(by="drop", args=lambda ctx: {"flight": ctx.input["flight"], "key": ctx.result})
    def hold(self, flight: str) -> str:
        return "h-1"

    def drop(self, flight: str, key: str) -> str:
        return f"dropped {flight} {key}"


def _ctx(tool_name: str, args: dict[str, object], result: object) -> CompensationContext:
    return CompensationContext("s-1", tool_name, args, result, "key-1")


def test_by_takes_a_plain_function_with_args_built_from_input_and_result() -> None:
    catalogue = wrap(Booking(), name="booking")
    spec = catalogue["reserve_seat"]
    assert spec.contract().compensation == "release_seat"
    RELEASED.clear()
    spec.compensate(_ctx("reserve_seat", {"flight": "LX1"}, {"id": "r-LX1"}))
    assert RELEASED == ["r-LX1:saga compensation"]


def test_by_takes_a_plain_function_of_the_context() -> None:
    spec = wrap(Booking(), name="booking")["charge"]
    assert spec.compensate(_ctx("charge", {"amount": 5}, "ch-1")) == "refund-ch-1-5"
    assert asyncio.run(spec.acompensate(_ctx("charge", {"amount": 5}, "ch-1"))) == "refund-ch-1-5"


def test_args_also_work_with_a_method_name() -> None:
    spec = wrap(Booking(), name="booking")["hold"]
    assert spec.compensate(_ctx("hold", {"flight": "LX2"}, "h-1")) == "dropped LX2 h-1"


def test_a_plain_function_with_a_wrong_signature_is_refused_at_wrap_naming_both() -> None:
    def undo(a: str, b: str) -> None:
        pass

    class Bad:
        @tool(description="Book")
        @compensable(by=undo)
        def book(self) -> str:
            return "b"

    with pytest.raises(CatalogueError) as err:
        wrap(Bad(), name="bad")
    message = str(err.value)
    assert "book" in message and "'undo' takes 2 arguments" in message
    assert "args=lambda ctx" in message


def test_args_that_is_not_a_one_argument_callable_is_refused_at_wrap() -> None:
    class Bad:
        @tool(description="Book")
        @compensable(by=release_seat, args=lambda: {})  # type: ignore[arg-type]
        def book(self) -> str:
            return "b"

    with pytest.raises(CatalogueError, match=r"book.*@compensable\(args=<lambda>\) must be"):
        wrap(Bad(), name="bad")


def test_by_that_is_neither_name_nor_callable_is_refused() -> None:
    class Bad:
        @tool(description="Book")
        @compensable(by=42)  # type: ignore[arg-type]
        def book(self) -> str:
            return "b"

    with pytest.raises(CatalogueError, match="neither a method name nor a callable"):
        wrap(Bad(), name="bad")


def test_args_returning_no_mapping_is_a_contract_violation_naming_the_tool() -> None:
    class Odd:
        @tool(description="Book")
        @compensable(by=release_seat, args=lambda ctx: ctx.result)
        def book(self) -> str:
            return "b"

    spec = wrap(Odd(), name="odd")["book"]
    with pytest.raises(ContractViolation, match="tool 'book' returned str"):
        spec.compensate(_ctx("book", {}, "b"))


def test_plain_exceptions_are_classified_as_documented_R9() -> None:
    class SoldOut(Exception):
        pass

    class Flaky(ValueError):
        pass

    class Shop:
        @tool(description="Buy", non_retryable=(SoldOut,), transient=(Flaky,))
        @compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result})
        def buy(self) -> str:
            return "b"

    spec = wrap(Shop(), name="shop")["buy"]
    assert spec.is_business_rejection(SoldOut())  # declared rejection
    assert not spec.is_business_rejection(Flaky())  # declared transient wins over ValueError
    assert not spec.is_business_rejection(TransientError())
    for deterministic in (ValueError(), KeyError("x"), TypeError(), ZeroDivisionError()):
        assert spec.is_business_rejection(deterministic)  # would fail the same way again
    for transient in (ConnectionError(), TimeoutError(), OSError(), RuntimeError()):
        assert not spec.is_business_rejection(transient)


def reserve_seat(flight: str) -> dict[str, str]:
    """Reserve a seat on a flight."""
    return {"id": f"r-{flight}"}


def test_wrap_takes_plain_functions_and_leaves_them_unchanged() -> None:
    reserve = compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result["id"]})(
        reserve_seat
    )
    catalogue = wrap(reserve, name="trip")
    spec = catalogue["reserve_seat"]
    assert spec.description == "Reserve a seat on a flight."
    assert spec.invoke({"flight": "LX3"}) == {"id": "r-LX3"}
    assert spec.input_schema()["required"] == ["flight"]
    assert getattr(reserve_seat, "__sagaline_tool__", None) is None  # the caller's function


def test_a_plain_function_with_no_compensation_is_refused_by_name() -> None:
    def send(to: str) -> None:
        """Send a letter."""

    with pytest.raises(CatalogueError, match="send: is a write tool with no declared compensation"):
        wrap(send, name="post")


class Post:
    @tool(description="Send a letter")
    @compensable(reversibility=Reversibility.IRREVERSIBLE)
    def send_letter(self, to: str) -> str:
        return to

    @tool(description="Read the mailbox", read_only=True)
    def read_mail(self) -> list[str]:
        return []


def test_tool_definitions_come_in_several_vendor_shapes_and_mark_irreversible_tools() -> None:
    catalogue = wrap(Post(), name="post")
    anthropic = {d["name"]: d for d in catalogue.tool_definitions()}
    assert anthropic["send_letter"]["description"] == (
        "Send a letter (IRREVERSIBLE: cannot be undone; runs only after a person approves)"
    )
    assert anthropic["read_mail"]["description"] == "Read the mailbox"
    assert anthropic["send_letter"]["input_schema"]["required"] == ["to"]
    openai = {d["function"]["name"]: d for d in catalogue.tool_definitions("openai")}
    assert openai["send_letter"]["type"] == "function"
    assert openai["send_letter"]["function"]["parameters"]["required"] == ["to"]
    responses = {d["name"]: d for d in catalogue.tool_definitions("openai-responses")}
    assert responses["read_mail"]["type"] == "function"
    mcp = {d["name"]: d for d in catalogue.tool_definitions("mcp")}
    assert mcp["send_letter"]["annotations"]["destructiveHint"] is True
    assert mcp["read_mail"]["annotations"]["readOnlyHint"] is True
    assert "inputSchema" in mcp["read_mail"]
    with pytest.raises(ValueError, match="unknown tool shape 'gemini'"):
        catalogue.tool_definitions("gemini")


def test_a_parameter_saga_call_takes_for_itself_is_refused() -> None:
    class Clock:
        @tool(description="Wait", read_only=True)
        def wait(self, timeout_s: float) -> None:
            pass

    with pytest.raises(CatalogueError, match="parameter 'timeout_s' is reserved"):
        wrap(Clock(), name="clock")


def test_tool_above_staticmethod_or_classmethod_is_still_a_tool() -> None:
    """The decorators' order does not matter, also above ``@staticmethod`` and
    ``@classmethod``: the declarations were written on the descriptor, which wrap()
    looks through, so the tool (and its compensation) silently left the catalogue."""

    class Desk:
        @tool(description="Find a ticket", read_only=True)
        @staticmethod
        def find_ticket(ticket_id: str) -> str:
            return ticket_id

        @tool(description="Open a ticket")
        @compensable(by="close_ticket")
        @classmethod
        def open_ticket(cls, title: str) -> str:
            return f"t-{title}"

        @compensation
        @staticmethod
        def close_ticket(ctx: CompensationContext) -> str:
            return f"closed {ctx.result}"

        @tool(description="List tickets", read_only=True)
        def list_tickets(self) -> list[str]:
            return []

    catalogue = wrap(Desk(), name="desk")
    assert sorted(catalogue) == ["find_ticket", "list_tickets", "open_ticket"]
    assert catalogue["find_ticket"].invoke({"ticket_id": "t-1"}) == "t-1"
    spec = catalogue["open_ticket"]
    assert spec.contract().compensation == "close_ticket"
    assert spec.invoke({"title": "x"}) == "t-x"
    assert spec.compensate(_ctx("open_ticket", {"title": "x"}, "t-x")) == "closed t-x"


class Seats:
    """Its tools name their helpers by the methods themselves, as written in the
    class body: ``by=release_seat``, not ``by="release_seat"``."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def release_seat(self, reservation_id: str) -> None:
        self.released.append(reservation_id)

    def cancel_all(self) -> None:
        self.released.append("all")

    def find_booking(self, key: str) -> LookupResult | None:
        return LookupResult.committed({"id": f"r-{key}"}) if self.released else None

    def seat_is_free(self, ctx: CompensationContext) -> bool:
        return str(ctx.result["id"]) in self.released

    @tool(description="Reserve a seat")
    @compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result["id"]})
    def reserve_seat(self, flight: str) -> dict[str, str]:
        return {"id": f"r-{flight}"}

    @tool(description="Book the whole flight")
    @compensable(by=cancel_all)
    def book_flight(self, flight: str) -> str:
        return flight


class CheckedSeats(Seats):
    @tool(
        description="Reserve a seat, checked",
        lookup=Seats.find_booking,
        verify=Seats.seat_is_free,
    )
    @compensable(by="release_seat", args=lambda ctx: {"reservation_id": ctx.result["id"]})
    def reserve_checked(self, flight: str) -> dict[str, str]:
        return {"id": f"r-{flight}"}


def test_by_given_a_method_of_the_class_itself_runs_it_bound() -> None:
    """``by=release_seat`` in the class body hands over the method's plain function:
    wrap() accepted it as an undo function and called it without the object, so
    every compensation failed at run time (``missing ... 'self'``, or the context
    taken for ``self``)."""
    seats = Seats()
    catalogue = wrap(seats, name="seats")
    spec = catalogue["reserve_seat"]
    assert spec.contract().compensation == "release_seat"
    spec.compensate(_ctx("reserve_seat", {"flight": "LX1"}, {"id": "r-LX1"}))
    catalogue["book_flight"].compensate(_ctx("book_flight", {"flight": "LX1"}, "LX1"))
    assert seats.released == ["r-LX1", "all"]


def test_lookup_and_verify_given_a_method_of_the_class_itself_run_bound() -> None:
    """The same for ``lookup=`` and ``verify=``, which wrap() refused as taking one
    argument too many (``self``)."""
    spec = wrap(CheckedSeats(), name="seats")["reserve_checked"]
    assert (spec.lookup_name, spec.verify_name) == ("find_booking", "seat_is_free")
    assert spec.lookup("LX1") == LookupResult.not_found()
    spec.compensate(_ctx("reserve_checked", {"flight": "LX1"}, {"id": "r-LX1"}))
    assert spec.verify(_ctx("reserve_checked", {"flight": "LX1"}, {"id": "r-LX1"})) is True
    assert spec.lookup("LX1") == LookupResult.committed({"id": "r-LX1"})


def test_a_duration_that_is_no_duration_is_a_wrap_problem_naming_the_tool() -> None:
    """``deadline=float("inf")`` (meant as "no deadline"), ``reversal_window="1h"``,
    ``completion_within=None``-like mistakes raised OverflowError / ValueError /
    TypeError from the decorator at import, naming no tool, instead of being listed
    by wrap() with the catalogue's other problems."""

    def build() -> type:
        class Mail:
            @tool(description="Send", deadline=float("inf"), reversal_window="1h")
            @compensable(by="recall", completion_within=float("nan"))
            def send(self, to: str) -> str:
                return to

            def recall(self, ctx: CompensationContext) -> Accepted:
                return Accepted("op-1")

        return Mail

    with pytest.raises(CatalogueError) as err:
        wrap(build()(), name="mail")
    assert [(p.tool, p.message) for p in err.value.problems] == [
        ("send", "deadline is inf; give a timedelta or a number of seconds"),
        ("send", "reversal_window is '1h'; give a timedelta or a number of seconds"),
        ("send", "completion_within is nan; give a timedelta or a number of seconds"),
    ]


def test_a_free_undo_function_a_class_also_holds_is_still_called_as_it_is() -> None:
    """Only a function written in the class body is bound to the object: a free
    function the class also holds as an attribute is called with the context."""
    given: list[object] = []

    def undo(ctx: CompensationContext) -> None:
        given.append(ctx)

    class Desk:
        release = undo  # also a method of Desk, but by= means the function

        @tool(description="Reserve")
        @compensable(by=undo)
        def reserve(self, x: str) -> str:
            return x

    ctx = _ctx("reserve", {"x": "a"}, "a")
    wrap(Desk(), name="desk")["reserve"].compensate(ctx)
    assert given == [ctx]


def test_a_reversibility_or_collection_that_is_no_such_thing_is_a_wrap_problem() -> None:
    """``@compensable(reversibility="bogus")`` raised ValueError and
    ``@tool(resources=None)`` (or ``non_retryable=None``...) TypeError from the
    decorator at import, naming no tool, instead of being listed by wrap() (R4)."""

    def build() -> type:
        class Shop:
            @tool(description="Hold", resources=None, secret_fields=None)  # type: ignore[arg-type]
            @compensable(reversibility="bogus")  # type: ignore[arg-type]
            def hold(self, sku: str) -> str:
                return sku

            @tool(description="Ship", non_retryable=None, transient=3)  # type: ignore[arg-type]
            @compensable(reversibility=Reversibility.IRREVERSIBLE)
            def ship(self, sku: str) -> str:
                return sku

        return Shop

    with pytest.raises(CatalogueError) as err:
        wrap(build()(), name="shop")
    assert [(p.tool, p.message) for p in err.value.problems] == [
        ("hold", "resources is None; give a list of strings"),
        ("hold", "secret_fields is None; give a list of strings"),
        (
            "hold",
            "reversibility is 'bogus'; use one of REVERSIBLE, COMPENSATABLE, IRREVERSIBLE"
            " (Reversibility)",
        ),
        ("ship", "non_retryable is None; give a list of exception classes"),
        ("ship", "transient is 3; give a list of exception classes"),
    ]


def test_a_decorator_given_twice_with_different_declarations_is_a_wrap_problem() -> None:
    """Two ``@compensable`` (or two ``@tool``) on one method: the outer one silently
    replaced the inner one, so ``by="undo_hold"`` was dropped (and a tool named
    ``"hold_b"`` vanished) with no word, and which one won depended on the order,
    which the docs say does not matter."""

    class Shop:
        @tool(description="Hold")
        @compensable(by="release_hold")
        @compensable(by="undo_hold")
        def hold(self, sku: str) -> str:
            return sku

        @tool(description="Hold A", name="hold_a")
        @tool(description="Hold B", name="hold_b")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def hold_twice(self, sku: str) -> str:
            return sku

        @tool(description="Same twice")
        @tool(description="Same twice")
        @compensable(reversibility=Reversibility.IRREVERSIBLE)
        def same(self, sku: str) -> str:
            return sku

        def release_hold(self, ctx: CompensationContext) -> None:
            pass

        def undo_hold(self, ctx: CompensationContext) -> None:
            pass

    with pytest.raises(CatalogueError) as err:
        wrap(Shop(), name="shop")
    assert [(p.tool, p.message) for p in err.value.problems] == [
        (
            "hold",
            "@compensable is given twice, with different declarations (by='undo_hold'"
            " and by='release_hold'); keep one",
        ),
        (
            "hold_a",
            "@tool is given twice, with different declarations (description='Hold B' and"
            " description='Hold A'; name='hold_b' and name='hold_a'); keep one (declare"
            " another tool with a method of its own)",
        ),
    ]


def test_the_same_declaration_given_again_changes_nothing() -> None:
    """Running ``compensable(by=..., args=lambda ...)(func)`` again (a notebook cell run
    twice) makes a new lambda of the same code: not a second declaration."""

    def hold(sku: str) -> str:
        """Hold a seat."""
        return sku

    def declare() -> None:
        compensable(by=release_seat, args=lambda ctx: {"reservation_id": ctx.result})(hold)

    declare()
    declare()
    spec = wrap(hold, name="desk")["hold"]
    assert spec.compensation == "release_seat"


def test_a_method_given_to_wrap_instead_of_its_object_is_refused_naming_it() -> None:
    """``wrap(Shelf.peek)`` took the method for a plain-function tool: its schema asked
    the model for a ``self`` argument and the call ran the method with whatever JSON
    came as ``self``; ``wrap(Shelf().peek)`` said "method has no method decorated with
    @tool", naming neither the tool nor the class."""

    class Shelf:
        @tool(description="Peek at a shelf", read_only=True)
        def peek(self, sku: str) -> str:
            return sku

    with pytest.raises(CatalogueError) as unbound:
        wrap(Shelf.peek, name="shelf")
    with pytest.raises(CatalogueError) as bound:
        wrap(Shelf().peek, name="shelf")
    assert [(p.tool, p.message) for p in unbound.value.problems] == [
        (
            "peek",
            "wrap() was given Shelf.peek, a method of the class Shelf (it takes self), as"
            " a plain function; pass an object of the class, wrap(Shelf(), ...): every"
            " @tool method of it is served",
        )
    ]
    assert [(p.tool, p.message) for p in bound.value.problems] == [
        (
            "peek",
            "wrap() was given the bound method Shelf.peek; pass the object itself,"
            " wrap(obj, ...): every @tool method of it is served",
        )
    ]


def test_a_context_parameter_with_a_default_is_given_the_context() -> None:
    """``def release(self, ctx: CompensationContext | None = None)`` (so it can also be
    called by hand) was taken for a compensation of no argument: in a saga it ran with
    ``ctx=None``, failed on ``ctx.result`` at every retry and left the hold in place;
    a verification written so was refused as taking "0 arguments (none)"."""

    class Holds:
        def __init__(self) -> None:
            self.given: list[object] = []

        @tool(description="Hold", verify="is_released")
        @compensable(by="release")
        def hold(self, sku: str) -> str:
            return sku

        def release(self, ctx: CompensationContext | None = None) -> None:
            self.given.append(ctx)

        def is_released(self, ctx: CompensationContext | None = None) -> bool:
            self.given.append(ctx)
            return ctx is not None

    holds = Holds()
    spec = wrap(holds, name="holds")["hold"]
    ctx = _ctx("hold", {"sku": "a"}, "a")
    spec.compensate(ctx)
    assert spec.verify(ctx) is True
    assert holds.given == [ctx, ctx]


def test_a_method_given_as_itself_and_overridden_in_a_subclass_runs_the_override() -> None:
    """``by=cancel_all`` in ``Seats`` and a subclass overriding ``cancel_all``: wrap()
    found the function under no name of the object, took it for a free function and
    refused the subclass ("takes 1 arguments (self)"), although the same declaration
    by name works and the docs say a method given as itself is bound like its name."""

    class QuietSeats(Seats):
        def cancel_all(self) -> None:
            self.released.append("quietly")

    seats = QuietSeats()
    spec = wrap(seats, name="seats")["book_flight"]
    assert spec.compensation == "cancel_all"
    spec.compensate(_ctx("book_flight", {"flight": "LX1"}, "LX1"))
    assert seats.released == ["quietly"]

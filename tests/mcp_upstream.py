"""An upstream MCP server for the proxy tests, written with the ``mcp`` SDK: a help desk
with tickets, a card and an outbox. Its state (and a log of every call) lives in the
JSON file named by ``DESK_STATE``, so it survives the proxy (and this process) being
killed, and the tests read the world from it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

STATE = Path(os.environ["DESK_STATE"])
server = MCPServer("desk")


class Ticket(BaseModel):
    id: str
    title: str


class Charge(BaseModel):
    charge_id: str
    amount: int


def _load() -> dict[str, Any]:
    if STATE.exists():
        loaded: dict[str, Any] = json.loads(STATE.read_text())
        return loaded
    return {"tickets": {}, "charges": {}, "refunds": [], "emails": [], "log": []}


def _save(state: dict[str, Any]) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(STATE)


def _logged(tool: str, **args: Any) -> dict[str, Any]:
    state = _load()
    state["log"].append([tool, args])
    return state


@server.tool()
def create_ticket(title: str, request_id: str) -> Ticket:
    """Open a help-desk ticket."""
    state = _logged("create_ticket", title=title)
    ticket = {"id": f"T-{len(state['tickets']) + 1}", "title": title, "key": request_id}
    state["tickets"][ticket["id"]] = ticket
    _save(state)
    if title.startswith("hang"):
        _hang()  # the effect happened; the answer never comes (its caller is killed)
    return Ticket(id=ticket["id"], title=title)


def _hang() -> None:
    """Block until the process that started this server is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


@server.tool()
def find_ticket(request_id: str) -> Ticket:
    """Find the ticket opened with an idempotency key."""
    for ticket in _load()["tickets"].values():
        if ticket["key"] == request_id:
            return Ticket(id=ticket["id"], title=ticket["title"])
    raise ToolError(f"no ticket for {request_id}")


@server.tool()
def delete_ticket(ticket_id: str) -> str:
    """Delete a ticket."""
    state = _logged("delete_ticket", ticket_id=ticket_id)
    state["tickets"].pop(ticket_id, None)
    _save(state)
    return f"deleted {ticket_id}"


@server.tool()
def charge(amount: int) -> Charge:
    """Charge the customer's card (declined above 1000)."""
    state = _logged("charge", amount=amount)
    if amount > 1000:
        _save(state)
        raise ToolError(f"card declined for {amount}")
    charge_id = f"CH-{len(state['charges']) + 1}"
    state["charges"][charge_id] = amount
    _save(state)
    return Charge(charge_id=charge_id, amount=amount)


@server.tool()
def refund(charge_id: str, amount: int) -> str:
    """Refund a charge."""
    state = _logged("refund", charge_id=charge_id, amount=amount)
    state["refunds"].append(charge_id)
    _save(state)
    return f"refunded {charge_id}"


@server.tool()
def send_email(to: str, body: str) -> str:
    """Send an email to the customer."""
    state = _logged("send_email", to=to)
    state["emails"].append({"to": to, "body": body})
    _save(state)
    return f"sent to {to}"


@server.tool()
def list_tickets() -> list[str]:
    """List open tickets."""
    return sorted(_load()["tickets"])


if __name__ == "__main__":
    if os.environ.get("DESK_ENV_OUT"):  # what this server was given, for the tests to see
        Path(os.environ["DESK_ENV_OUT"]).write_text(json.dumps(sorted(os.environ)))
    if os.environ.get("DESK_HTTP_PORT"):  # streamable HTTP instead of stdio
        server.run("streamable-http", host="127.0.0.1", port=int(os.environ["DESK_HTTP_PORT"]))
    else:
        server.run()

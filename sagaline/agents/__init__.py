"""Agents in their own frameworks: an MCP proxy and thin adapters over the saga client.

Each module imports its framework only when used, and the frameworks are optional
extras: ``sagaline[mcp]`` (``mcp_proxy``), ``sagaline[openai-agents]``
(``openai_agents``), ``sagaline[langchain]`` (``langchain``), ``sagaline[pydantic-ai]``
(``pydantic_ai``); importing one without its extra raises a ``ModuleNotFoundError``
that names the extra to install. ``docs/agents.md`` shows each.

:class:`Interrupted` is the base of every adapter's ``Interrupted`` (a run paused for
a person): code that handles any adapter's pause catches it and reads ``pending``.
"""

from sagaline.agents._core import Interrupted

__all__ = ["Interrupted"]

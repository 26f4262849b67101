"""An adapter whose agent framework is not installed says which extra to install.

``pip install sagaline`` brings no agent SDK; importing ``sagaline.agents.langchain``
there used to end in a bare ``No module named 'langchain_core'``, which does not say
that Sagaline has an extra for it. No broker: this is about imports only.
"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# adapter module -> (the pip extra it needs, the top-level modules that extra installs
# and the adapter imports)
ADAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sagaline.agents.mcp_proxy": ("mcp", ("mcp", "mcp_types")),
    "sagaline.agents.openai_agents": ("openai-agents", ("agents",)),
    "sagaline.agents.langchain": ("langchain", ("langchain_core",)),
    "sagaline.agents.pydantic_ai": ("pydantic-ai", ("pydantic_ai",)),
}


def _uninstall(monkeypatch: pytest.MonkeyPatch, adapter: str, roots: tuple[str, ...]) -> None:
    """As on a machine without the framework: its modules, and the adapter that imported
    them, are forgotten (monkeypatch puts them back), and importing them fails."""
    for name in list(sys.modules):
        if name == adapter or name.split(".")[0] in roots:
            monkeypatch.delitem(sys.modules, name)
    for root in roots:
        monkeypatch.setitem(sys.modules, root, None)  # "import of ... halted"


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_an_adapter_without_its_framework_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, adapter: str
) -> None:
    extra, roots = ADAPTERS[adapter]
    _uninstall(monkeypatch, adapter, roots)

    # Still a ModuleNotFoundError: code that catches ImportError keeps working.
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module(adapter)

    message = str(raised.value)
    assert f"pip install 'sagaline[{extra}]'" in message
    assert adapter in message
    missing = (raised.value.name or "").split(".")[0]
    assert missing in roots  # which module was missing, as Python names it


def test_the_extras_the_errors_name_are_the_packages_and_the_docs() -> None:
    """Each extra an adapter's error names is one pyproject.toml declares, and the one
    docs/agents.md's table gives for that module."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    table = (ROOT / "docs" / "agents.md").read_text()
    row = r"^\| `sagaline\[([a-z-]+)\]` \| `([a-z_.]+)` \|"
    documented = {module: extra for extra, module in re.findall(row, table, re.M)}
    assert documented == {adapter: extra for adapter, (extra, _) in ADAPTERS.items()}
    assert {extra for extra, _ in ADAPTERS.values()} <= set(declared)

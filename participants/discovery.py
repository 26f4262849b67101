"""Finding a participant's catalogue from a ``MODULE[:ATTR]`` reference.

Used by ``sagaline catalogue check`` and ``sagaline plan check`` (and by anything
else that starts a participant by name), so they all read a module the same way.

The rule, in order:

1. ``MODULE:ATTR``: the attribute (dotted paths allowed) is a ``Catalogue`` (used as
   is), a list or tuple of participant objects, one participant object, a tool
   function, or a factory: a function taking no argument that returns any of these.
2. ``MODULE`` alone: a module-level ``CATALOGUE`` or ``catalogue`` that is a
   ``Catalogue`` or a factory of one; else a module-level ``PARTICIPANTS`` list;
   else every module-level object whose class has a method decorated with
   ``@tool``, in definition order.

Objects are wrapped with ``name=`` the given name, else the module's
``PARTICIPANT_NAME``, else the default of ``wrap()``; a ``Catalogue`` (given, or
made by a factory) keeps the name ``wrap()`` gave it, whatever ``name=`` says
(``catalogue check --name`` refuses it; ``participant run NAME`` serves it as NAME).
A module that calls ``wrap()`` at import time (or a factory that calls it) and fails
raises its ``CatalogueError`` here, unchanged; any other error of an import or a
factory is a ``DiscoveryError`` naming it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from typing import Any

from participants.catalogue import Catalogue, wrap
from participants.declarations import compensable_declaration, tool_declaration
from participants.errors import CatalogueError, SagalineParticipantError

__all__ = ["DiscoveryError", "load_catalogue"]


class DiscoveryError(SagalineParticipantError):
    """The module could not be imported, or holds nothing to wrap."""


def load_catalogue(reference: str, *, name: str | None = None) -> Catalogue:
    """The catalogue that ``reference`` (``MODULE[:ATTR]``) points at."""
    module_name, _, attr = reference.partition(":")
    module = _import(module_name)
    # An empty name is a name (wrap() refuses it), not "none given".
    wrap_name = name if name is not None else _module_name_setting(module)
    if attr:
        return _from_value(_attribute(module, attr), f"{module_name}:{attr}", wrap_name)

    for candidate in ("CATALOGUE", "catalogue"):
        value = getattr(module, candidate, None)
        if isinstance(value, Catalogue):
            return value
        if _is_factory(value):
            return _from_value(value, f"{module_name}.{candidate}", wrap_name)
    participants = getattr(module, "PARTICIPANTS", None)
    if participants is not None:
        return _from_value(participants, f"{module_name}.PARTICIPANTS", wrap_name)
    found = [v for k, v in vars(module).items() if not k.startswith("_") and _has_tools(v)]
    if not found:
        raise DiscoveryError(
            f"module {module_name!r} holds no participant: define CATALOGUE = wrap(...),"
            " PARTICIPANTS = [YourService(), ...], or a module-level instance of a class"
            " with @tool methods, or name one with MODULE:ATTR"
        )
    return wrap(*found, name=wrap_name)


def _import(module_name: str) -> types.ModuleType:
    # Like `python -m`, look in the working directory first: a service's own module
    # is usually not installed.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except CatalogueError:
        raise
    except ModuleNotFoundError as exc:
        raise DiscoveryError(
            f"cannot import {module_name!r}: {exc}; run from the directory that holds it"
            " or install its package"
        ) from exc
    except Exception as exc:
        raise DiscoveryError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _attribute(module: types.ModuleType, attr: str) -> Any:
    value: Any = module
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise DiscoveryError(f"module {module.__name__!r} has no attribute {attr!r}") from None
    return value


def _from_value(value: Any, where: str, name: str | None) -> Catalogue:
    if isinstance(value, Catalogue):
        return value
    if _is_factory(value):
        try:
            inspect.signature(value).bind()
        except TypeError:
            raise DiscoveryError(
                f"{where} is a function that needs arguments; a catalogue factory must take"
                " none (or name the Catalogue, object or list itself)"
            ) from None
        except ValueError:
            pass  # no signature to check: try the call
        try:
            made = value()
        except CatalogueError:
            raise  # wrap() inside the factory said what is wrong: unchanged, as at import
        except Exception as exc:
            raise DiscoveryError(f"{where}() failed: {type(exc).__name__}: {exc}") from exc
        if _is_factory(made):
            raise DiscoveryError(f"{where}() returned another function, not a catalogue")
        return _from_value(made, f"{where}()", name)
    if inspect.isfunction(value):
        return wrap(value, name=name)  # a tool function: wrap() checks its declarations
    if isinstance(value, (list, tuple)):
        ready = sum(isinstance(v, Catalogue) for v in value)
        if ready:
            # Not participant objects to wrap into one ("Catalogue has no method
            # decorated with @tool" would say the tools are not declared).
            raise DiscoveryError(
                f"{where} holds {ready} catalogue{'s' if ready > 1 else ''}"
                f" ({', '.join(repr(v.name) for v in value if isinstance(v, Catalogue))})"
                " in a list; a reference names one participant's catalogue: point it at"
                " one Catalogue (or a factory of one), one reference per participant"
                ' (plan check: --module once per catalogue, or "modules": [...])'
            )
        return wrap(*value, name=name)
    if inspect.isclass(value) or isinstance(value, types.ModuleType) or _has_tools(value):
        return wrap(value, name=name)  # wrap() explains what is wrong with a class
    raise DiscoveryError(
        f"{where} is a {type(value).__name__}, not a Catalogue, a participant object"
        " or a list of them"
    )


def _is_factory(value: Any) -> bool:
    """A function or bound method that is not itself a declared tool."""
    if not (inspect.isfunction(value) or inspect.ismethod(value)):
        return False
    func = getattr(value, "__func__", value)
    return tool_declaration(func) is None and compensable_declaration(func) is None


def _module_name_setting(module: types.ModuleType) -> str | None:
    value = getattr(module, "PARTICIPANT_NAME", None)
    return value if isinstance(value, str) else None


def _has_tools(value: Any) -> bool:
    """Whether ``value`` is an instance whose class has a ``@tool`` method. A module
    global that raises when asked (a lazy proxy such as ``django.conf.settings`` not
    configured, whose ``__class__`` raises) is none: scanning must not fail on it."""
    try:
        if inspect.isclass(value) or isinstance(value, types.ModuleType) or callable(value):
            return False
        return any(
            tool_declaration(getattr(member, "__func__", member)) is not None
            for klass in inspect.getmro(type(value))
            for member in vars(klass).values()
        )
    except Exception:
        return False

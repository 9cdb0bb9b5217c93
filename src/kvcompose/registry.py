"""Find components by kind and name.

Every component class registers itself with ``@register(kind, name)``. Policies and
configs refer to components by these names, so a config file stays readable and a
third-party package can add components without touching kvcompose: it exposes a
callable under the entry-point group ``kvcompose.components`` that imports (and so
registers) its classes.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points
from typing import Any, Callable, TypeVar

KINDS = ("quantizer", "classifier", "evictor", "pager", "trigger", "filter", "rotation")
ENTRY_POINT_GROUP = "kvcompose.components"

_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}
_plugins_loaded = False

T = TypeVar("T", bound=type)


class UnknownComponentError(KeyError):
    """Raised for a component kind or name that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0])


class ComponentSpecError(TypeError, ValueError):
    """A component given as something other than a name, a ``{"name": ...}`` dict or an instance.

    A ``TypeError`` (the spec has the wrong type) and a ``ValueError`` (it is bad input from a
    config or the command line, reported like the other config errors)."""


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: register a component class as ``name`` of ``kind``.

    The class must be a dataclass (its fields are its configuration) and gets a
    ``name`` class attribute so a component instance knows its registered name.
    """
    _check_kind(kind)

    def wrap(cls: T) -> T:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"component {kind}:{name} must be a dataclass, got {cls!r}")
        existing = _REGISTRY[kind].get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{kind} {name!r} is already registered by {existing.__module__}.{existing.__qualname__}")
        cls.name = name
        cls.kind = kind
        _REGISTRY[kind][name] = cls
        return cls

    return wrap


def get(kind: str, name: str) -> type:
    """Return the class registered as ``name`` of ``kind``; the error lists known names."""
    _check_kind(kind)
    load_plugins()
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY[kind])) or "(none)"
        raise UnknownComponentError(f"unknown {kind} {name!r}; known {kind}s: {known}") from None


def build(kind: str, spec: Any) -> Any:
    """Build a component from a name, a ``{"name": ..., **fields}`` dict, or pass an instance through."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return get(kind, spec)()
    if isinstance(spec, dict):
        if "name" not in spec:
            raise ValueError(f"{kind} config {spec!r} has no 'name'; expected one of: {', '.join(names(kind))}")
        fields = dict(spec)
        cls = get(kind, fields.pop("name"))
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(
                f"{kind} {cls.name!r} has no field(s) {sorted(unknown)}; accepted fields: {sorted(allowed)}"
            )
        return cls(**fields)
    if getattr(spec, "kind", None) == kind and dataclasses.is_dataclass(spec):
        return spec
    article = "an" if kind[0] in "aeiou" else "a"
    raise ComponentSpecError(
        f"cannot build {article} {kind} from {spec!r}; give a name ({', '.join(names(kind))}), "
        f"a dict with 'name', or {article} {kind} instance"
    )


def to_config(component: Any) -> dict | None:
    """The JSON-serializable config of a component instance (inverse of :func:`build`)."""
    if component is None:
        return None
    out = {"name": component.name}
    for f in dataclasses.fields(component):
        value = getattr(component, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def names(kind: str) -> list[str]:
    """Registered names of one kind, sorted."""
    _check_kind(kind)
    load_plugins()
    return sorted(_REGISTRY[kind])


def available() -> dict[str, dict[str, str]]:
    """Everything registered: ``{kind: {name: one-line description}}``."""
    load_plugins()
    return {kind: {n: _summary(c) for n, c in sorted(reg.items())} for kind, reg in _REGISTRY.items()}


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def _check_kind(kind: str) -> None:
    if kind not in _REGISTRY:
        raise UnknownComponentError(f"unknown component kind {kind!r}; known kinds: {', '.join(KINDS)}")


def load_plugins() -> None:
    """Import every plugin registered under the entry-point group (once)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = ep.load()
        if callable(loaded):
            loaded()

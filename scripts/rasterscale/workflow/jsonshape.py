"""The shape of a JSON document, checked fast and named where it fails: the stored plan's files
(:mod:`rasterscale.workflow.storage`, :mod:`rasterscale.workflow.reuse`) are read only when they are of the shape
their writer gives them, so that a file of valid JSON but another shape (another file copied over it, one edited
by hand) is told as damaged, never read as a plan.

A shape is written as: a type (``str``, ``int``: exact, a bool is no integer); None for null; a tuple of
alternatives; ``[shape]`` a list of them; ``{str: shape}`` an object of them; ``{"key": shape, ...}`` an object with
these keys; :class:`Row` ``(shape, ...)`` a list of these, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Row(tuple):
    """A JSON list of fixed length whose members have each its own shape (:func:`check_shape`)."""

    def __new__(cls, *shapes: Any) -> Row:
        return super().__new__(cls, shapes)


_KINDS = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def check_shape(value: Any, shape: Any, where: str) -> None:
    """A ValueError naming the first part of ``value`` (JSON, as json.loads gives it) that is not of ``shape`` (the
    notation of this module; a bool is no integer): a stored file of valid JSON but another shape (another
    file copied over it, one edited by hand) is damaged, never read as a plan. A whole plan of 200,000 scenes is
    checked in a fraction of its json.loads (a predicate made once per shape); the reason is looked for only when
    it fails."""
    if not _predicate(shape)(value):
        _find_misshapen(value, shape, where or "the file")
        raise ValueError(f"{where or 'the file'} is not of its shape")  # not reached: _find_misshapen raises


_PREDICATES: dict[int, tuple[Any, Callable[[Any], bool]]] = {}  # id(shape) -> (the shape, kept alive; its predicate)


def _predicate(shape: Any) -> Callable[[Any], bool]:
    """Whether a JSON value is of ``shape`` (exact types: json.loads makes no subclasses, and a bool is no int); the
    common members (strings, integers) tested in C (map over type), not a Python call each."""
    if id(shape) not in _PREDICATES:
        _PREDICATES[id(shape)] = (shape, _made_predicate(shape))
    return _PREDICATES[id(shape)][1]


def _made_predicate(shape: Any) -> Callable[[Any], bool]:
    if isinstance(shape, Row):
        if all(isinstance(part, type) for part in shape):  # [int, int]
            types = list(shape)
            return lambda v: type(v) is list and list(map(type, v)) == types
        parts = [_predicate(part) for part in shape]
        return lambda v: type(v) is list and len(v) == len(parts) and all(p(m) for p, m in zip(parts, v, strict=False))
    if isinstance(shape, tuple):
        alternatives = [_predicate(part) for part in shape if part is not None]
        nullable = None in shape
        if len(alternatives) == 1:  # a value or null: one call, not a generator's
            only = alternatives[0]
            return (lambda v: v is None or only(v)) if nullable else only
        return lambda v: (nullable and v is None) or any(p(v) for p in alternatives)
    if isinstance(shape, list) or (isinstance(shape, dict) and list(shape) == [str]):
        listed = isinstance(shape, list)
        inner = shape[0] if isinstance(shape, list) else shape[str]

        def members(value: Any) -> Any:
            return value if listed else value.values()

        container = list if listed else dict
        if isinstance(inner, type):  # [str], {str: str}
            return lambda v: type(v) is container and set(map(type, members(v))) <= {inner}
        each = _predicate(inner)
        return lambda v: type(v) is container and all(map(each, members(v)))
    if isinstance(shape, dict):
        keyed = [(key, _predicate(part)) for key, part in shape.items()]
        return lambda v: type(v) is dict and all(key in v and p(v[key]) for key, p in keyed)
    if shape is None:
        return lambda v: v is None
    return lambda v: type(v) is shape


def _find_misshapen(value: Any, shape: Any, where: str) -> None:
    """Raise the ValueError naming the first part of ``value`` not of ``shape`` (:func:`check_shape`'s reason)."""
    if isinstance(shape, Row):
        if not isinstance(value, list) or len(value) != len(shape):
            raise ValueError(f"{where} is {_kind(value)}, not a list of {len(shape)}")
        for index, (member, part) in enumerate(zip(value, shape, strict=True)):
            _find_misshapen(member, part, f"{where}[{index}]")
    elif isinstance(shape, tuple):
        others = [part for part in shape if part is not None]
        if value is not None and len(others) == 1 and not isinstance(others[0], type):  # a list or null: its reason
            _find_misshapen(value, others[0], where)
        elif not any(_predicate(part)(value) for part in shape):
            raise ValueError(f"{where} is {_kind(value)}, not {' or '.join(_described(part) for part in shape)}")
    elif isinstance(shape, list):
        if not isinstance(value, list):
            raise ValueError(f"{where} is {_kind(value)}, not a list")
        for index, member in enumerate(value):
            _find_misshapen(member, shape[0], f"{where}[{index}]")
    elif isinstance(shape, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where} is {_kind(value)}, not an object")
        if list(shape) == [str]:
            for key, member in value.items():
                _find_misshapen(member, shape[str], f"{where}[{key!r}]")
            return
        for key, part in shape.items():
            if key not in value:
                raise ValueError(f"{where} has no key {key!r}")
            _find_misshapen(value[key], part, repr(key) if where == "the file" else f"{where}[{key!r}]")
    elif shape is None:
        if value is not None:
            raise ValueError(f"{where} is {_kind(value)}, not null")
    elif type(value) is not shape:
        raise ValueError(f"{where} is {_kind(value)}, not {_described(shape)}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in reversed(_KINDS.items()) if isinstance(value, kind)), type(value).__name__)


def _described(shape: Any) -> str:
    if shape is None:
        return "null"
    if isinstance(shape, Row):
        return f"a list of {len(shape)}"
    if isinstance(shape, list):
        return "a list"
    if isinstance(shape, dict):
        return "an object"
    return _KINDS.get(shape, getattr(shape, "__name__", str(shape)))

"""Class patches of vLLM's classes, recorded so that ``undo_all`` restores
each class exactly.

Seams are always put on classes, never on instances: a method stored on an
instance shadows its class's, and CPython then looks the name up generically
at every call vLLM makes (no specialized method call: each goes through the
type attribute cache, and what it pushes out of that cache costs vLLM's own
lookups more than the wrapper itself: in one B6 layout, taking one per-step
method's instance wrapper away saved ~17k instructions per step, most of it
in CPython's type lookups). A class wrapper finds its seams through an
instance attribute whose class default is None.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

ATTR = "_kvobs"  # the instance attribute that holds an instance's seams
_MISSING = object()
# (owner class, attribute name, original value or _MISSING if inherited)
_patches: list[tuple[type, str, Any]] = []


def default(cls: type, name: str, value: Any) -> None:
    """A class attribute every instance reads until it has its own: a plain
    attribute load in the per-step wrappers (``self.__dict__`` is looked up
    through the class's MRO on every call and never specialized)."""
    _patches.append((cls, name, cls.__dict__.get(name, _MISSING)))
    setattr(cls, name, value)


def wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)`` (the method it inherits, if
    it has none of its own)."""
    original = cls.__dict__.get(name, _MISSING)
    target = getattr(cls, name)
    wrapper = functools.wraps(target)(make(target))
    wrapper.__kvobs_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)
    _patches.append((cls, name, original))


def watch(cls: type, wrappers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]
          ) -> None:
    """Seams on a class found at run time (a copy engine's worker, a tiering
    manager): its ``_kvobs`` default and each wrapper, once per class."""
    if ATTR not in cls.__dict__:
        default(cls, ATTR, None)
    for name, make in wrappers.items():
        # (getattr: a subclass of a class already watched inherits its wrappers)
        if not getattr(getattr(cls, name, None), "__kvobs_wrapped__", False):
            wrap(cls, name, make)


def forget(obj: Any) -> Any:
    """Remove ``obj``'s seams (its ``_kvobs``, after undo_all took the class
    default) and return them. Never reads ``obj.__dict__``: CPython 3.11
    stops specializing attribute loads on an object whose __dict__ was read,
    vLLM's own included."""
    seams = getattr(obj, ATTR, None)
    with contextlib.suppress(AttributeError):
        delattr(obj, ATTR)
    return seams


def undo_all() -> None:
    while _patches:
        cls, name, original = _patches.pop()
        if original is _MISSING:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def patched() -> bool:
    return bool(_patches)

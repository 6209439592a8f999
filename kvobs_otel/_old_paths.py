"""Old import paths of moved tools, kept for users (docs/architecture.md, "Old paths").

``alias_package(old, new)`` makes ``old`` and every ``old.X`` the very modules
``new`` and ``new.X`` (not copies: classes and module state are shared, and a
string path such as vLLM's ``spec_module_path`` still resolves). Used only by
the alias modules; the runtime never imports it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``old.X`` to the already-named module ``new.X``."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.old + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new + spec.name[len(self.old):])
        # The import system overwrites __spec__ with ours; exec_module puts
        # the module's own back.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state


def alias_package(old: str, new: str) -> ModuleType:
    """The package ``new``, also importable (with its submodules) as ``old``."""
    if not any(isinstance(f, _OldPathFinder) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder(old, new))
    return importlib.import_module(new)

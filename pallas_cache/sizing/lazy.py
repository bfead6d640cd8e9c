"""Names of a package loaded on first use (PEP 562), so a light caller (the command line's
parser, the trace format registry) imports a package without the heavy modules behind it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str]
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__``.

    ``homes`` maps each public name to the module it lives in (relative to ``package`` when it
    starts with ``.``); the value is imported on first use and kept in the package's globals.
    Any other name is the package's submodule of that name, else ``AttributeError``."""
    module_globals = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        module_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(module_globals) | set(homes))

    return __getattr__, __dir__

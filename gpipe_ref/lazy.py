"""Names a package imports on first use (PEP 562's module ``__getattr__``), so that importing it needs no torch."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: str, table: Mapping[str, str],
               namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``table`` is read from its module (relative to
    ``package``) on first use, then kept in ``namespace`` (the package's globals); a submodule's name imports it."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(f".{table[name]}", package), name)
            namespace[name] = value  # read once: later reads find it in the package
            return value
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f".{name}", package)  # as `import gpipe_ref.widgets` would
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__

"""`Patch`: the record of one change to megatron-core's behaviour (what it touches, the versions it applies
to, the source hash of each call site per verified version), and `source_hash`. Its own module, so that a
patch module and the package that lists every patch both import it (no import circle)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass, field

from ...compat import megatron_core_version

__all__ = ["Patch", "source_hash"]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One patch: ``versions`` is the ``[low, high)`` range of megatron-core versions it applies to;
    ``verified`` maps each version it was checked on to ``{call site: source hash}``."""

    name: str
    what: str
    versions: tuple[tuple[int, ...], tuple[int, ...]]
    verified: dict[str, dict[str, str]] = field(default_factory=dict)

    def applies(self, version: str | None = None) -> bool:
        """Whether the installed (or the given) megatron-core version is in this patch's range."""
        found = _version_tuple(version or megatron_core_version())
        low, high = self.versions
        return bool(found) and low <= found < high


def source_hash(call_site: str) -> str:
    """The first 16 hex digits of the sha256 of ``module:qualname``'s source in the installed version."""
    module, qualname = call_site.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]

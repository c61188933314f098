"""The ``FLASH_GDN_*`` switches, read on every call at a fraction of ``os.environ.get``'s cost.

``os.environ.get`` of an unset variable goes through ``Mapping.get`` and a caught KeyError:
~2 us on a CPU host, more on a loaded GPU host, and a forward call reads several switches. The
environment mapping keeps its encoded contents in a dict that every assignment through
``os.environ`` (and pytest's ``monkeypatch.setenv``) updates, so reading that dict sees the
same values; where this Python has no such dict, ``os.environ.get`` is used.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_DATA, dict) and _ENCODE is not None and _DECODE is not None
_KEYS: dict[str, object] = {}


def env_get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``."""
    if not _FAST:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    raw = _DATA.get(key)
    return default if raw is None else _DECODE(raw)

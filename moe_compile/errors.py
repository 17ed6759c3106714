"""Errors of moe_compile that many modules raise, in a leaf module (it imports nothing from the package).

Holds :class:`ConfigError` (moved here from :mod:`moe_compile.config`, which re-exports
it, as does ``moe_compile``): modules that only raise it (the collectives, the sharding
helper) import it from here, so ``config`` may import the collectives to validate
compressor / all-to-all / emulated-link names without an import circle.
"""
from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A bad option: names the key, the value, and what is allowed."""

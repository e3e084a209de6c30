"""Errors of the engine that callers catch by type (kept free of heavy imports)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file and the problem."""

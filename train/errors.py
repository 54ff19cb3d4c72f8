"""Errors shared across train/ that must not pull in the modules raising them (recipe validation imports the
callback registry, and the registry raises RecipeError)."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe (file, base chain or override) is malformed; the message is one sentence for the user."""

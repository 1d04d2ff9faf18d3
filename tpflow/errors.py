"""Errors a user can cause.

Every exception derived from :class:`UserError` is caught by the CLI, printed as one paragraph and turned into exit
status 2, without a traceback. Anything else is a bug in tpflow (or a plugin) and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in a recipe, an option, a path or a component name; the message says how to fix it."""


class UnknownComponentError(UserError, KeyError):
    """A component name that no built-in module or installed plugin registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateComponentError(UserError):
    """Two definitions claim the same (kind, name)."""


class RecipeError(UserError):
    """A recipe that cannot be read or does not validate."""


class RewardError(UserError):
    """A reward that kept failing on the same images, returned something other than a RewardOutput of one score per
    image, called ``sys.exit`` or exceeded its time limit (tpflow/scoring/call.py). A reward that raised is a bug
    (in it, its server or its model), not the user's: that RewardError is chained to the exception and its message
    ends with the reward's last traceback frames, which the CLI prints after the paragraph."""

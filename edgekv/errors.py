"""One exception type for everything a user can get wrong.

The CLI prints ``EdgekvError`` as a single line and exits non-zero; anything
else is a bug and keeps its traceback.
"""


class EdgekvError(Exception):
    """A user-facing error whose message is one self-explanatory line."""


class ModelError(EdgekvError):
    """Missing, corrupt or unsupported model file."""


class StateLayoutError(EdgekvError):
    """A KV state blob this parser does not understand (never guess)."""


class BudgetError(EdgekvError):
    """An impossible budget / ratio / context request."""

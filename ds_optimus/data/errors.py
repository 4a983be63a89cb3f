"""The data package's error (a leaf module)."""


class DataError(ValueError):
    """A data source that cannot be used; the message names it."""

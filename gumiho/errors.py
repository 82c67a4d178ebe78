"""The one exception type users see: a one-line message that says what to do."""


class GumihoError(Exception):
    """Bad input or environment; the CLI prints it as a single line and exits 2."""

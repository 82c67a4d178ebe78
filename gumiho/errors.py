"""The one exception type users see: a one-line message that says what to do."""


class GumihoError(Exception):
    """Bad input or environment; the CLI prints it as a single line and exits 2."""


def cli_errors(main):
    """Wrap a `main(argv=None) -> int`: a GumihoError becomes one `error: ...` line on
    stderr and exit status 2, never a traceback."""
    import functools
    import sys

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except GumihoError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return wrapper

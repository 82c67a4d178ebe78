"""Bad input gets one clear line: the exception users see, the CLI wrapper that prints it,
and argparse pieces that check values before any model is loaded.

Every command's `main(argv=None)` is wrapped by `cli_errors`: a `GumihoError` (or an
argparse error) becomes exactly one `error: ...` line on stderr and exit status 2; Ctrl-C
prints `interrupted` (and how to resume, for long jobs) and exits 130. `GUMIHO_DEBUG=1`
shows the traceback as well. A worker process whose parent set ERROR_FILE_ENV leaves that
line, argparse's included, in the parent's file instead of on stderr.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import select
import signal
import sys
import traceback
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_READER_GONE = 141  # 128 + SIGPIPE: what a shell reports for `yes` in `yes | head`
# Set by a parent command for its worker processes: errors go to this file, not stderr,
# so the parent can report them as its own single line. A RANK_FIELD in it is replaced by
# the process's RANK (processes started by torchrun: gumiho.train.launch).
ERROR_FILE_ENV = "GUMIHO_ERROR_FILE"
RANK_FIELD = "{rank}"


class GumihoError(Exception):
    """Bad input or environment; the CLI prints it as a single line and exits 2."""


def debug() -> bool:
    return os.environ.get("GUMIHO_DEBUG", "") not in ("", "0")


def one_line(text: str) -> str:
    """A message squeezed onto one line (library messages often span several)."""
    return " ".join(str(text).split())


def how_it_ended(status: int) -> str:
    """How a child process with this exit status (Popen's: -N for signal N) ended, for a
    one-line report: `was killed by SIGKILL (out of memory?)`, `exited with status 3`."""
    if status >= 0:
        return f"exited with status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:  # no name: a real-time signal (SIGRTMIN + n), or none known here
        name = f"signal {-status}"
    return f"was killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")


def shell_status(status: int) -> int:
    """The exit status a shell shows for a child's (Popen's -N: 128 + N)."""
    return status if status >= 0 else 128 - status


def error_file(pattern: str, rank: int | str = 0) -> Path:
    """Where process `rank` leaves its line, for an ERROR_FILE_ENV of `pattern`."""
    return Path(pattern.replace(RANK_FIELD, str(rank)))


def left_line(path: Path) -> str | None:
    """The line a worker process left in its error file, or None (it left none: it was
    killed, or ended without an error)."""
    text = path.read_text(encoding="utf-8").strip() if path.is_file() else ""
    return text.splitlines()[0] if text else None


def _close_bars() -> None:
    """End every open progress bar's line: tqdm draws on stderr without a newline, so a
    report after Ctrl-C or an error mid-job would otherwise continue the bar's line."""
    tqdm = sys.modules.get("tqdm")  # never imported here: no bars open
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _to_parent(line: str) -> bool:
    """Leave `line` in the parent's error file where ERROR_FILE_ENV names one (a worker
    process); False where none is named or it cannot be written (the parent is gone)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    try:
        with error_file(path, os.environ.get("RANK", "0")).open("w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        return False
    return True


def reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (`gumiho demo | head`): writing to
    it raises BrokenPipeError, which is not a bug. Where poll cannot tell, False."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)  # POLLERR, POLLHUP unasked
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no stdout
        return False


def _drop_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what it
    still holds for a reader that has gone does not print an `Exception ignored` report."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def _report(line: str) -> None:
    _close_bars()
    if _to_parent(line):
        return
    try:
        sys.stdout.flush()
        if sys.stdout.isatty():
            print(file=sys.stdout, flush=True)  # a streamed answer may be mid-line
    except BrokenPipeError:  # nobody reads the output any more: the line goes to stderr
        _drop_stdout()
    except (AttributeError, OSError, ValueError):  # no stdout (closed, None)
        pass
    print(line, file=sys.stderr, flush=True)


def cli_errors(main=None, *, resume: str | None = None):
    """Wrap a `main(argv=None) -> int`.

    GumihoError -> one `error: ...` line, exit 2. KeyboardInterrupt -> `interrupted` plus
    `resume` (what is kept and how to go on), exit 130. Output piped to a reader that has
    gone (`gumiho demo | head`) stops quietly with 141, as `yes | head`'s `yes` does. Any
    other exception is a bug, not bad input: one `error: internal error ...` line that says
    so, exit 1, and with GUMIHO_DEBUG=1 the full traceback. Use as `@cli_errors` or
    `@cli_errors(resume=...)`.
    """
    if main is None:
        return functools.partial(cli_errors, resume=resume)

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            status = main(argv)
            if sys.stdout is not None:  # here, not at exit, where a reader gone is a report
                sys.stdout.flush()
            return status
        except BrokenPipeError as exc:
            if reader_gone():  # `| head` read what it wanted: stop as `yes | head` stops
                _close_bars()
                _drop_stdout()
                return EXIT_READER_GONE
            return _bug(exc)
        except GumihoError as exc:
            if debug():
                traceback.print_exc()
            _report(f"error: {one_line(exc)}")
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:
            if debug():
                traceback.print_exc()
            _report("interrupted" + (f": {resume}" if resume else ""))
            return EXIT_INTERRUPTED
        except Exception as exc:  # noqa: BLE001 - a bug: say so in one line, keep the trace
            return _bug(exc)

    return wrapper


def _bug(exc: Exception) -> int:
    """cli_errors' report of an unexpected exception (being handled): exit 1, or 2 for
    running out of memory."""
    if debug():
        traceback.print_exc()
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        _report("error: out of memory: use smaller settings (--max-new-tokens, "
                "--total-tokens, batch sizes) or a bigger device")
        return EXIT_BAD_INPUT
    _report(f"error: internal error {type(exc).__name__}: {one_line(exc)[:300]} "
            "(a bug in gumiho; rerun with GUMIHO_DEBUG=1 for the traceback and "
            "report it)")
    return EXIT_BUG


def install_interrupt_hook() -> None:
    """For a process started as a gumiho command (`python -m gumiho.…` or the `gumiho`
    script): Ctrl-C while its modules import (torch takes seconds), before `main` runs,
    prints `interrupted` and exits 130 instead of a traceback. Notebooks are unaffected."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 != "-m" and os.path.basename(argv0) != "gumiho":
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt) and not debug():
            _report("interrupted")  # a worker's goes to its parent's file, as errors do
            os._exit(EXIT_INTERRUPTED)
        previous(kind, value, tb)

    sys.excepthook = hook


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `error: ...` line (no usage block), exit 2."""

    def error(self, message: str):
        line = f"error: {self.prog}: {one_line(message)} (see {self.prog} --help)"
        if not _to_parent(line):  # a worker's goes to its parent's file, as errors do
            print(line, file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1."""
    number = _int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def nonnegative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    number = _int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return number


def nonnegative_float(value: str) -> float:
    """argparse type: a finite number >= 0 (temperatures, tau)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value!r}")
    return number


def probability_arg(value: str) -> float:
    """argparse type: a probability from 0 up to but not including 1 (0 = off)."""
    number = nonnegative_float(value)
    if number >= 1:
        raise argparse.ArgumentTypeError(f"expected a probability below 1, got {value!r}")
    return number


def nucleus_arg(value: str) -> float:
    """argparse type: a top-p share, above 0 and at most 1 (1 = no cut)."""
    number = nonnegative_float(value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a share above 0 and at most 1, got {value!r}")
    return number


def share_arg(value: str) -> float:
    """argparse type: a share from 0 to 1 (min-p; 0 = no cut)."""
    number = nonnegative_float(value)
    if number > 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {value!r}")
    return number


def positive_float(value: str) -> float:
    """argparse type: a finite number above 0 (a repetition penalty)."""
    number = nonnegative_float(value)
    if number == 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {value!r}")
    return number


def penalty_arg(value: str) -> float:
    """argparse type: a number from -2 to 2 (a presence or frequency penalty)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from -2 to 2, got {value!r}") \
            from None
    if not -2 <= number <= 2:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"expected a number from -2 to 2, got {value!r}")
    return number


def logit_bias_arg(value: str) -> tuple[int, float]:
    """argparse type: ID=BIAS, a token id and a number from -100 to 100 (--logit-bias)."""
    wrong = argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS with a bias from -100 to "
                                       f"100 (e.g. 2=-100), got {value!r}")
    token, _, bias = value.partition("=")
    try:
        token_id, number = int(token), float(bias)
    except ValueError:
        raise wrong from None
    if token_id < 0 or not -100 <= number <= 100:  # (NaN fails too)
        raise wrong
    return token_id, number


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def check_positive_int(name: str, value, allow_zero: bool = False) -> int:
    """API check: a real int (not a bool, float or string) >= 1 (>= 0 with allow_zero)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < (0 if allow_zero else 1):
        raise GumihoError(f"{name} must be {'>= 0' if allow_zero else 'at least 1'}, "
                          f"got {value}")
    return value

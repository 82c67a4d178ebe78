"""Work handed from many threads to the one that runs it: the server's generations.

torch's work called from another thread than the one that first ran parallel work ran
1.5-5x slower on a 2-core AMX Xeon (`python scripts/thread_speed.py`), so `gumiho serve`
runs its generations on the main thread, and the HTTP handlers' threads hand them over here.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future


class Stopped(RuntimeError):
    """What a request's thread hears when the worker stopped (Ctrl-C) during its job."""


def stopped() -> Stopped:
    return Stopped("the server stopped (Ctrl-C) during this request")


class Worker:
    """Runs the generations, one at a time, on the thread that calls `run_forever`: the
    main thread in `gumiho serve`. The same torch work called from another thread than the
    one that first ran parallel work ran 1.5-5x slower on a 2-core AMX Xeon (a 1 x 576 by
    576 x 1536 product 40 us on the main thread, 206 us on another; plain decoding 54.5
    against 26.0 tokens/s in bf16, 28.7 against 18.8 in float32: `python
    scripts/thread_speed.py`), so the handlers' threads only hand work over and wait."""

    def __init__(self):
        # (run, fail) pairs: fail() tells the waiting thread the worker stopped
        self.jobs: queue.Queue = queue.Queue()
        self.running = 0  # jobs running now (0 or 1); `jobs.qsize()` wait
        self.stopped = False  # `run_forever` ended: new jobs fail at once
        self._lock = threading.Lock()

    def run_forever(self) -> None:
        """Run jobs as they come until `stop`; Ctrl-C (KeyboardInterrupt) during a job
        ends the job's request with an error and stops this loop, raising it here. Either
        way the requests still waiting their turn (or arriving after) hear that it stopped."""
        try:
            while (job := self.jobs.get()) is not None:
                self.running = 1
                try:
                    job[0]()
                finally:
                    self.running = 0
        finally:  # stopped, by `stop` or Ctrl-C: nothing runs what still waits
            self._fail_waiting()

    def stop(self) -> None:
        self.jobs.put(None)

    def _submit(self, run: Callable[[], None], fail: Callable[[], None]) -> None:
        with self._lock:
            if self.stopped:
                fail()
            else:
                self.jobs.put((run, fail))

    def _fail_waiting(self) -> None:
        with self._lock:
            self.stopped = True
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    return
                if job is not None:
                    job[1]()

    def call(self, fn):
        """fn() run on the worker; its result here (or its exception raised here)."""
        done: Future = Future()

        def job():
            try:
                done.set_result(fn())
            except Exception as exc:  # noqa: BLE001 (handed to the waiting thread)
                done.set_exception(exc)
            except BaseException:  # Ctrl-C: the worker stops; the waiting thread hears so
                done.set_exception(stopped())
                raise
        self._submit(job, lambda: done.set_exception(stopped()))
        return done.result()

    def iterate(self, make: Callable[[], Iterator]) -> Iterator:
        """The items of the iterator `make()` builds and runs on the worker, here as it
        makes them; closing this one (a client gone) stops that one at its next item."""
        items: queue.Queue = queue.Queue()
        cancel = threading.Event()

        def job():
            try:
                source = make()
                try:
                    for item in source:
                        items.put((True, item))
                        if cancel.is_set():
                            break
                finally:
                    source.close()
                items.put((False, None))
            except Exception as exc:  # noqa: BLE001 (raised in the handler's thread)
                items.put((False, exc))
            except BaseException:  # Ctrl-C: the worker stops; the handler hears so
                items.put((False, stopped()))
                raise
        self._submit(job, lambda: items.put((False, stopped())))
        try:
            while True:
                more, item = items.get()
                if not more:
                    if item is not None:
                        raise item
                    return
                yield item
        finally:
            cancel.set()

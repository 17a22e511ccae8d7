"""A rule that fails in a job of several processes ends the job, not a hang.

In a multi-controller job (``jax.distributed``) each process runs its part of one
program, and a collective waits for every part: XLA can neither time it out nor
cancel it. A rule that raises stops its device's part, so every other device, the
failing process's own other devices included, would wait in the next collective
for ever (measured: 4 processes, gloo; JAX's heartbeats see live processes and
never fire). So, once a process has run a jaxdecl op in a program that spans
processes (:func:`join`):

- a rule that raises there publishes its failure in the job's key-value store
  (``jax.distributed``'s coordination service), as it raises (:func:`report`);
- a watcher thread in every process waits for such a failure. On another
  process's failure it writes an error naming that process, the op, the rule and
  the error to stderr and ends the process with :data:`EXIT_STATUS`, at once. The
  failing process's main thread raises the rule's error as usual, and the process
  ends when the script does; if it still runs :data:`GRACE_SECONDS` later (its
  other devices wait in a collective, or the error was caught), its watcher ends
  it. A process whose own rule failed too gets the same grace.

A process of a failed job skips ``jax.distributed``'s shutdown barrier when it
ends (it would wait for processes that have gone): JAX's own exit handler is not
run, nor any registered before jaxdecl joined the job. The process that holds
the job's coordination service (process 0) ends last, once the others have left
(or 10 s past :data:`GRACE_SECONDS` have passed): a process that loses the service ends
with a fatal error of JAX's instead of its own.

An eager call's failure is published only while an eager call that spans
processes runs (:func:`spanning`): a failing call on this process's own arrays
leaves the others alone.

Example:
    >>> from jaxdecl._host import processes
    >>> processes.join()  # outside a jax.distributed job: nothing to watch
    >>> processes.watching()
    False
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

from .. import _compat

#: Seconds a failing process's main thread has to raise the rule's error and end
#: before its watcher ends the process (``JAXDECL_FAILURE_GRACE_SECONDS``).
GRACE_SECONDS = float(os.environ.get("JAXDECL_FAILURE_GRACE_SECONDS", "10"))
#: The exit status of a process that a failure in the job ends.
EXIT_STATUS = 1
#: The key of the job's first failure in the key-value store.
KEY = "jaxdecl/failure"
_WAIT_MS = 600_000  # one wait of the watcher (then it waits again)
_MARGIN_SECONDS = 10  # process 0 waits for the others' leaving this long past the grace
_LONGEST = 2000  # characters of an error that the key-value store carries


class _State:
    lock = threading.Lock()
    job = None  # (client, process index, process count) once joined
    watcher = None
    spanning = 0  # eager calls spanning processes now running
    own = None  # this process's published failure, if any
    stopping = False  # the process ends normally: the watcher stops


def join() -> None:
    """This process runs jaxdecl ops in programs spanning processes: from now on a
    failing rule ends the job (the watcher starts, once)."""
    if _State.watcher is not None:
        return
    job = _compat.distributed_job()
    if job is None:
        return
    with _State.lock:
        if _State.watcher is None:
            _State.job = job
            _State.watcher = threading.Thread(target=_watch, args=(job,), daemon=True,
                                              name="jaxdecl failure watcher")
            _State.watcher.start()
            atexit.register(_at_exit)  # (after JAX's own: it runs first)


def watching() -> bool:
    """This process watches the job for failures."""
    return _State.watcher is not None


@contextlib.contextmanager
def spanning():
    """An eager call whose operands span processes runs meanwhile (its failure is the job's)."""
    join()
    with _State.lock:
        _State.spanning += 1
    try:
        yield
    finally:
        with _State.lock:
            _State.spanning -= 1


def report(error: str, eager: bool) -> None:
    """A rule failed with `error` (``Class.rule (@kind) raised Type: message``): publish it
    when it stops a program that spans processes."""
    job = _State.job
    if job is None or (eager and not _State.spanning):
        return
    client, me, count = job
    text = error if len(error) <= _LONGEST else error[:_LONGEST] + " ..."
    _State.own = text
    try:
        client.key_value_set(KEY, json.dumps({"process": me, "error": text}))
    except Exception:  # noqa: BLE001 - another failure came first (or the job is gone)
        return
    for process in range(count):  # every watcher waits for its own key
        try:
            client.key_value_set(_wake(process), "failure")
        except Exception:  # noqa: BLE001 - (that process is ending)
            pass


def _wake(process: int) -> str:
    """The key process `process`'s watcher waits for: a failure, or its own process's end."""
    return f"{KEY}/wake/{process}"


def _watch(job) -> None:
    client, me, count = job
    while True:  # one long wait at a time: no load on the coordination service meanwhile
        try:
            client.blocking_key_value_get(_wake(me), _WAIT_MS)
            break
        except Exception as error:  # noqa: BLE001 - a timeout, or the job has ended
            if "DEADLINE_EXCEEDED" not in str(error):
                return  # jax.distributed.shutdown(): no failure, nothing to do
    if _State.stopping:
        return  # this process ends normally (_at_exit woke the watcher)
    try:
        found = _failure(client)
    except Exception:  # noqa: BLE001 - the job has ended
        return
    if found is None:
        return
    failed, error = found["process"], found["error"]
    if failed == me or _State.own is not None:
        time.sleep(GRACE_SECONDS)  # the main thread raises the rule's error, and ends
    _end(_stops(failed, error, me, count, at_exit=False))


def _failure(client):
    """The job's published failure, or None (a watcher woken by its own process's end)."""
    try:
        return json.loads(client.key_value_try_get(KEY))
    except Exception as error:
        if "NOT_FOUND" in str(error):
            return None
        raise


def _stops(failed: int, error: str, me: int, count: int, at_exit: bool) -> str:
    """Why this process ends: the job's failure."""
    if failed == me:
        if at_exit:
            return ""  # the rule's error was raised, and ended the script
        return (f"jaxdecl: in process {me} of {count}, {error}, inside a program that spans "
                f"processes, and the process still runs {GRACE_SECONDS:g} s later (the error "
                f"was caught, or the process's other devices wait in a collective that "
                f"cannot finish)")
    message = (f"jaxdecl: process {failed} of {count} failed: {error}. Process {me} stops: "
               f"its part of the program waits for process {failed}'s part, which will not "
               f"come (collectives cannot be cancelled)")
    own = _State.own
    return message + (f". This process failed too: {own}" if own is not None else "")


def _at_exit() -> None:
    """A process of a failed job ends here, before JAX's shutdown barrier (which would
    wait for processes that have gone); any other stops its watcher first."""
    _State.stopping = True
    client, me, count = _State.job
    try:
        found = _failure(client)
    except Exception:  # noqa: BLE001 - the job is gone
        found = None
    if found is not None:
        _end(_stops(found["process"], found["error"], me, count, at_exit=True))
    # Woken, the watcher ends before Python does (a thread still in C++ then would abort it).
    try:
        client.key_value_set(_wake(me), "exit")
    except Exception:  # noqa: BLE001 - jax.distributed.shutdown() ended its wait already
        pass
    _State.watcher.join(timeout=5)


def _end(message) -> None:
    """Ends this process (`message` to stderr first): it leaves the job's key-value
    store a note, and process 0, which holds the store, waits for the others' notes."""
    try:
        sys.stdout.flush()
        if message:
            sys.stderr.write(f"{message}; exit status {EXIT_STATUS}\n")
        sys.stderr.flush()
        client, me, count = _State.job
        client.key_value_set(f"{KEY}/left/{me}", "1")
        if me == 0:  # (the failing process may take its grace, and a little more)
            deadline = time.monotonic() + GRACE_SECONDS + _MARGIN_SECONDS
            while time.monotonic() < deadline and \
                    len(client.key_value_dir_get(f"{KEY}/left/")) < count:
                time.sleep(0.05)
    except BaseException:  # noqa: BLE001 - ending anyway
        pass
    finally:
        os._exit(EXIT_STATUS)

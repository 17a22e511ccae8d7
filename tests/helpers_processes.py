"""Jobs of several local processes (``jax.distributed`` on 127.0.0.1, gloo collectives).

The test side starts a job and waits for it; a process of the job joins it:

    # in a test
    ended = run_job([sys.executable, SCRIPT, ...], processes=4, devices=2, timeout=120)
    # in SCRIPT, before anything else touches jax's backends
    from helpers_processes import join_job
    process, count = join_job()

:func:`run_job` picks a free port (asking the system for one; another run on the
machine that takes it first makes process 0 fail to start the coordination service,
and the job is started again on another port), gives every process its device count
(``XLA_FLAGS``) and its place in the job (``JAXDECL_JOB``), and waits for all of them.
A job whose processes have not all ended by `timeout` is a hang: the ones still
running are killed, and :class:`JobHung` says which. Nothing outlives the call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import tempfile
import time

#: The exit status of a process that could not start the job's coordination service
#: on the port it was given (taken meanwhile): the job is started again elsewhere.
PORT_TAKEN = 75
#: Seconds a process waits for the others to join, and JAX's heartbeat and shutdown
#: timeouts in the jobs the tests start (JAX's defaults are 300, 100 and 300 s).
JOIN_TIMEOUT, HEARTBEAT_TIMEOUT, SHUTDOWN_TIMEOUT = 120, 60, 60


@dataclasses.dataclass
class Ended:
    """One process of a job, after it ended: how, what it printed, when."""

    process: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the job's start to this process's end
    ended_at: float  # when it ended (time.time())

    def last_json(self) -> dict:
        """The last JSON line it printed (its report)."""
        lines = [line for line in self.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise AssertionError(f"process {self.process} printed no report (exit "
                                 f"{self.returncode}):\n{self.stderr[-3000:]}")
        return json.loads(lines[-1])


class JobHung(AssertionError):
    """Processes of a job that did not end by themselves within the time allowed."""


def free_port() -> int:
    """A TCP port no socket on this machine uses now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(command: list, *, processes: int, devices: int, timeout: float,
            env: dict | None = None, tries: int = 3) -> list:
    """Runs `command` as every process of one job; returns each one's :class:`Ended`.

    Raises :class:`JobHung` (after killing them) if some are still running
    `timeout` seconds after the start.
    """
    for _ in range(tries):
        ended = _run_once(command, processes, devices, timeout, env or os.environ)
        if ended[0].returncode != PORT_TAKEN:
            return ended
    raise AssertionError(f"no free port for the job's coordinator in {tries} tries")


def _run_once(command, processes, devices, timeout, env) -> list:
    port = free_port()
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    start = time.monotonic()
    children, files = [], []
    try:
        for i in range(processes):
            # Files, not pipes: a process blocked on a full pipe would stall the job.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            children.append(subprocess.Popen(command, stdout=out, stderr=err, text=True, env=dict(
                env, JAXDECL_JOB=f"{processes},{i},{port}",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())))
        ends, walls = [None] * processes, [None] * processes
        while any(e is None for e in ends):
            for i, child in enumerate(children):
                if ends[i] is None and child.poll() is not None:
                    ends[i], walls[i] = time.monotonic() - start, time.time()
            if ends[0] is not None and children[0].returncode == PORT_TAKEN:
                break  # the others wait for a coordinator that will not come
            if time.monotonic() - start > timeout:
                running = [i for i, e in enumerate(ends) if e is None]
                raise JobHung(f"processes {running} of {processes} were still running "
                              f"{timeout:g} s after the job started; killed. "
                              + _outputs(files, running))
            time.sleep(0.05)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
    results = []
    for i, (child, (out, err)) in enumerate(zip(children, files)):
        out.seek(0)
        err.seek(0)
        results.append(Ended(i, child.returncode, out.read(), err.read(),
                             ends[i] if ends[i] is not None else time.monotonic() - start,
                             walls[i] if walls[i] is not None else time.time()))
        out.close()
        err.close()
    return results


def _outputs(files, which) -> str:
    texts = []
    for i in which:
        out, err = files[i]
        for stream in (out, err):
            stream.seek(0)
        texts.append(f"process {i}: stdout {out.read()[-1500:]!r}, stderr {err.read()[-1500:]!r}")
    return "\n".join(texts)


def job_of_environment():
    """``(processes, process, port)`` that :func:`run_job` gave this process, or None."""
    value = os.environ.get("JAXDECL_JOB")
    return tuple(int(v) for v in value.split(",")) if value else None


def join_job() -> tuple:
    """Joins the job :func:`run_job` started this process in: gloo collectives, the
    test timeouts; returns ``(process, processes)``. A coordinator that cannot start on
    its port exits with :data:`PORT_TAKEN`."""
    import sys

    import jax

    processes, process, port = job_of_environment()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {"initialization_timeout": JOIN_TIMEOUT}
    import inspect

    known = inspect.signature(jax.distributed.initialize).parameters
    # (heartbeat_timeout_seconds came with JAX 0.7, shutdown_timeout_seconds later)
    for name, seconds in (("heartbeat_timeout_seconds", HEARTBEAT_TIMEOUT),
                          ("shutdown_timeout_seconds", SHUTDOWN_TIMEOUT)):
        if name in known:
            timeouts[name] = seconds
    try:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes,
                                   process_id=process, **timeouts)
    except Exception as error:  # noqa: BLE001 - a port taken meanwhile: start again
        if process == 0 and "Failed to start RPC server" in str(error):
            sys.stderr.write(f"port {port} taken: {error}\n")
            sys.stderr.flush()
            os._exit(PORT_TAKEN)
        raise
    return process, processes

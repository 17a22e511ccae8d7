"""Test set-up: two forced host CPU devices, float64 available, dtype tolerances."""

import os

# Must precede the first import of jax anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

#: A deprecated NumPy or JAX API reached by jaxdecl, its tests or the libraries they use
#: fails the run, in this process and in helper subprocesses (subprocess_env). Only from
#: JAX 0.9 on: older releases deprecate what later ones changed (make_mesh's default axis
#: types, jax.core names that libraries such as equinox still read), which jaxdecl
#: handles there on purpose.
DEPRECATIONS_ARE_ERRORS = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 9)


def pytest_configure(config):
    if DEPRECATIONS_ARE_ERRORS:
        config.addinivalue_line("filterwarnings", "error::DeprecationWarning")

TOLERANCES = {
    np.dtype("float16"): 1e-2,
    np.dtype("float32"): 1e-4,
    np.dtype("complex64"): 1e-4,
    np.dtype("float64"): 1e-10,
    np.dtype("complex128"): 1e-10,
}


def tol(dtype) -> float:
    """Relative tolerance for comparing results of `dtype`."""
    return TOLERANCES.get(np.dtype(dtype), 1e-2)


@pytest.fixture(params=["float32", "float64", "complex64", "complex128"])
def inexact_dtype(request):
    return np.dtype(request.param)


def subprocess_env(**variables) -> dict:
    """Environment for a child Python that imports the same jaxdecl as this test run.

    The package's parent folder goes first on PYTHONPATH: the installed copy in
    CI, the source tree when the tests run against a built checkout.
    """
    import jaxdecl

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(jaxdecl.__file__)))
    env = dict(os.environ, **variables)
    if DEPRECATIONS_ARE_ERRORS:  # as in this process
        env["PYTHONWARNINGS"] = ",".join(
            w for w in (env.get("PYTHONWARNINGS"), "error::DeprecationWarning") if w)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _splits_per_shard() -> bool:
    from jaxdecl import _compat

    return _compat.SPLITS_PER_SHARD


#: Rules that reshape a view in place (``x.shape = ...``): NumPy 2.5 deprecates it, so
#: there the in-place changes left to a rule are its views' flags.
RESHAPES_IN_PLACE = pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 5),
    reason="NumPy >= 2.5 deprecates setting an array's shape in place")


#: Tests of ops running per shard under ``jit`` (custom_partitioning with Shardy's
#: reduction and replication factors); older JAX gathers instead, with a warning.
needs_split = pytest.mark.skipif(
    not _splits_per_shard(),
    reason="running a sharding declaration per shard under jit needs JAX >= 0.7")


class HelperFailed(Exception):
    """A helper subprocess exited badly or printed no JSON line."""


def helper_checks(stdout: str, stderr: str, returncode: int) -> dict:
    """The ``{"checks": {...}}`` a helper script printed last (HelperFailed otherwise)."""
    import json

    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode != 0 or not lines:
        raise HelperFailed(f"the helper failed (exit {returncode}):\n{stderr[-3000:]}")
    return json.loads(lines[-1])["checks"]


def run_helper(command: list, timeout: int = 600, **variables) -> dict:
    """Runs a helper script in a fresh interpreter; returns its checks."""
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**variables))
    return helper_checks(done.stdout, done.stderr, done.returncode)


def run_two_processes(command: list, timeout: int = 300, **variables) -> list:
    """Runs `command` + ``[PORT, I]`` as processes 0 and 1 of one ``jax.distributed``
    job on 127.0.0.1; returns each process's checks."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = subprocess_env(**variables)
    children = [subprocess.Popen(command + [port, str(i)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    try:
        outputs = [child.communicate(timeout=timeout) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    return [helper_checks(out, err, child.returncode)
            for (out, err), child in zip(outputs, children)]

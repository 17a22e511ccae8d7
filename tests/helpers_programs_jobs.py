"""Generated programs over a job of several local processes: what each process runs.

``tests/test_programs_processes.py`` starts this script as every process of a job
(``helpers_processes.run_job``: ``jax.distributed`` on 127.0.0.1, gloo), or in one
process over as many devices as the job has, for reference:

    python helpers_programs_jobs.py --seeds N,M,... [--export DIR]
    python helpers_programs_jobs.py --seeds N,M,... --geometry P,K [--export DIR]

Each draw of the "processes" group (``helpers_programs_draw``, over P processes x K
devices) runs as ``helpers_programs.outcome`` runs it, against its jax.numpy twin, with
two differences in the program's run: every input is made from this process's own
blocks (``jax.make_array_from_process_local_data``), and every rule call is recorded
(the rule and the shapes of its arrays). With ``--export DIR`` the draw runs again as
``jax.export`` saved it: process 0 exports the transformed program into DIR, and every
process loads and calls it. One JSON line per draw: ``{"seed", "outcome", "detail",
"seconds", "seen"}``, plus ``"export"``, ``"export_detail"`` and ``"seen_export"``
with ``--export``; ``seen`` lists ``[rule, shapes, calls]`` (a call on this process's
own arrays only counts 1/P: see ``_weight``). The exported run's twin runs under
``jax.jit`` too, so that both results are placed as a compiled program places them.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)


def _option(name):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


from helpers_processes import job_of_environment, join_job  # noqa: E402

JOB = job_of_environment()
if JOB is None:  # one process over the job's devices (before jax starts)
    _processes, _local = (int(v) for v in _option("--geometry").split(","))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_processes * _local}"
    PROCESS = 0
else:
    PROCESS, _processes = join_job()

import jax  # noqa: E402
import jax.export  # noqa: E402, F401 - (older JAX does not import it with jax)
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

jax.config.update("jax_enable_x64", True)

import helpers_programs  # noqa: E402
from helpers_programs_draw import Geometry  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl import _compat  # noqa: E402
from jaxdecl._host import kernels as _kernels  # noqa: E402
from jaxdecl._transforms import eager as _eager  # noqa: E402

GEOMETRY = Geometry(_processes, jax.local_device_count() if JOB else _local)
SEEN: collections.Counter = collections.Counter()
_make_kernel = _kernels.make_kernel
_eager_run = _eager.run
#: The weight of the rule call now running: 1, or 1/P for an eager call on this
#: process's own arrays only. Such a value (the seed cotangent of an eager ``grad``, a
#: jnp array no ``place`` laid out) exists in every process, and every process computes
#: with it: its call runs P times in a job where one process over as many devices runs it
#: once. Weighted so, the calls of all processes add up to the one process's.
_weight = 1


def _recording_kernel(function, *, context, **options):
    """jaxdecl's kernel of a rule, recording each call's arrays' shapes in SEEN."""
    def recorded(*args, **kwargs):
        SEEN[(context, tuple(tuple(a.shape) for a in args if isinstance(a, np.ndarray)))] += \
            _weight
        return function(*args, **kwargs)

    return _make_kernel(recorded, context=context, **options)


def _recording_run(call, operands):
    """jaxdecl's eager run, setting the weight of the rule calls it makes (it blocks)."""
    global _weight
    before = _weight
    if JOB is not None and all(getattr(x, "is_fully_addressable", True) for x in operands):
        _weight = 1 / _processes
    try:
        return _eager_run(call, operands)
    finally:
        _weight = before


_kernels.make_kernel = _recording_kernel  # before any kernel is built
_eager.run = _recording_run  # (the eager path looks it up at each call)


def place(value, mesh, spec):
    """`value` laid out over `mesh` as `spec`, this process giving only its own blocks."""
    if spec is None:
        return jax.numpy.asarray(value)
    sharding = NamedSharding(mesh, spec)
    indices = list(sharding.addressable_devices_indices_map(value.shape).values())
    box = tuple(slice(min(i[d].indices(n)[0] for i in indices),
                      max(i[d].indices(n)[1] for i in indices))
                for d, n in enumerate(value.shape))
    return jax.make_array_from_process_local_data(sharding, value[box], value.shape)


class ExportFailed(RuntimeError):
    """Process 0 could not export the program: its error's text, in every process."""


def exported_call(seed: int, folder: str):
    """``call(function, *args)`` that process 0 exports and every process loads and runs."""
    def call(function, *args):
        path = os.path.join(folder, f"{seed}.exported")
        if PROCESS == 0:
            try:
                data = jax.export.export(jax.jit(function), disabled_checks=jd.disabled_checks())(
                    *args).serialize()
            except Exception as error:  # noqa: BLE001 - every process raises it
                data = b"error: " + helpers_programs._describe(error).encode()
            with open(path + ".part", "wb") as file:
                file.write(data)
            os.replace(path + ".part", path)
        if JOB is not None:  # (its collective outside the program's mesh: JAX 0.6 mixes them)
            with _compat.outside_context_mesh():
                multihost_utils.sync_global_devices(f"exported {seed}")
        with open(path, "rb") as file:
            data = file.read()
        if data.startswith(b"error: "):
            raise ExportFailed(data[7:].decode())
        return jax.export.deserialize(bytearray(data)).call(*args)

    return call


def _seen() -> list:
    found = sorted([rule, [list(s) for s in shapes], calls]
                   for (rule, shapes), calls in SEEN.items())
    SEEN.clear()
    return found


def _run(seed: int, hooks: dict) -> tuple:
    SEEN.clear()
    try:
        result, detail = helpers_programs.outcome(seed, geometry=GEOMETRY, hooks=hooks)
    except Exception as error:  # noqa: BLE001 - a bug of the generator: say so
        result, detail = "error", f"the draw itself failed: {helpers_programs._describe(error)}"
    failed = f"{ExportFailed.__name__}: "
    if result == "error" and detail.startswith(failed) and \
            helpers_programs._refusal(detail[len(failed):]):
        result = "refused"  # (export met the documented refusal the program meets)
    return result, detail[:2000], _seen()


def main() -> None:
    folder = _option("--export")
    for seed in (int(s) for s in _option("--seeds").split(",") if s):
        start = time.perf_counter()
        result, detail, seen = _run(seed, {"place": place})
        line = {"seed": seed, "outcome": result, "detail": detail, "seen": seen}
        if folder is not None:
            hooks = {"place": place, "call": exported_call(seed, folder),
                     "twin_call": lambda function, *args: jax.jit(function)(*args)}
            line["export"], line["export_detail"], line["seen_export"] = _run(seed, hooks)
        line["seconds"] = round(time.perf_counter() - start, 3)
        print(json.dumps(line), flush=True)
    if JOB is not None:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()

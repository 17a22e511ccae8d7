"""Runs generated programs (``helpers_programs_draw.py``) against their jax.numpy twins.

In a fresh interpreter with 4 host CPU devices (2 in each of two processes) and 64-bit
types:

- ``python helpers_programs.py --seed N``: draw N verbosely: its standalone script (paste
  it into a file and run it), the twin's and the program's tracebacks, the outcome; a
  draw of the "processes" group starts two processes of itself and shows both;
- ``python helpers_programs.py --seeds N,M,... [--process I --port PORT]``: the draws
  one by one, one JSON line each as it finishes (``{"seed", "outcome", "detail",
  "seconds", "cpu"}``), and one (``{"seed", "phase": "program"}``) when its twin has
  run, so that a caller sees which draw, and which of its two runs, a crash or a hang
  stopped at; with ``--process``, as process I of two meeting at 127.0.0.1:PORT.
  ``tests/test_programs.py`` runs the draws of one group per process (two for the
  "processes" group), so JAX starts a few times.

The outcome of a draw:

- ``ok``: the program's result equals its twin's (values, devices, and under Explicit
  axes the sharding types: ``helpers_programs_ops.compare``);
- ``wrong``: it differs (the detail says how);
- ``error``: the program raised, its twin did not;
- ``refused``: the program raised a documented refusal (a ``ShardingTypeError`` saying
  that the op needs a newer JAX than this one; on that JAX it is an ``error``);
- ``skip``: the twin raised: the program is not valid JAX, and counts for nothing; or
  its values overflow (beyond ``helpers_programs_ops.LARGEST``): powers chained through
  several ops reach where results depend on the order of evaluation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings


def _option(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


# Must precede the first import of jax: 4 devices, or 2 in each of two processes (a
# module importing this one has set them itself: helpers_programs_jobs.py).
_PROCESS = _option(sys.argv, "--process")
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count="
                               f"{4 if _PROCESS is None else 2}")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

import helpers_programs_ops as ops_module  # noqa: E402
from helpers_programs_draw import TWO_BY_TWO, draw  # noqa: E402

#: A documented refusal names the JAX the program needs; from that version on it is an error.
REFUSAL = re.compile(r"needs JAX >= (\d+)\.(\d+)")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _refusal(text: str) -> bool:
    """Is `text` a documented refusal that this JAX is too old to avoid?"""
    needed = REFUSAL.search(text) if text.startswith("ShardingTypeError") else None
    running = tuple(int(p) for p in jax.__version__.split(".")[:2])
    return needed is not None and running < (int(needed[1]), int(needed[2]))


def _run(program, ops):
    out = program(ops)
    jax.block_until_ready(out)
    return out


def outcome(seed: int, verbose: bool = False, twin_done=lambda: None,
            geometry=TWO_BY_TWO, hooks=None) -> tuple:
    """(outcome, detail) of draw `seed` (over `geometry`'s devices); `verbose` prints
    tracebacks as they happen; `twin_done` is called between the twin's run and the
    program's; `hooks` replace names the program uses (``call(function, *args)``, which
    runs the transformed program, and ``place``) in the program's run, not the twin's,
    except ``twin_call``: the twin's ``call`` (an exported program's twin runs jitted)."""
    drawn = draw(seed, geometry)
    hooks = dict(hooks or {})
    namespace = dict(vars(ops_module), call=hooks.pop(
        "twin_call", lambda function, *args: function(*args)))
    exec(compile(drawn.source, f"<program {seed}>", "exec"), namespace)
    program = namespace["run"]
    with warnings.catch_warnings():
        # jaxdecl's warnings about gathered inputs are documented behaviour.
        warnings.simplefilter("ignore")
        try:
            expected = _run(program, ops_module.TWINS)
        except Exception as error:  # noqa: BLE001 - an invalid program: no verdict
            if verbose:
                traceback.print_exc()
            return "skip", f"the twin raised {_describe(error)}"
        if ops_module.out_of_range(expected):
            return "skip", "the twin's values overflow: no meaningful comparison"
        twin_done()
        namespace.update(hooks)
        try:
            out = _run(program, ops_module.OPS)
            problems = ops_module.compare(out, expected, specs=drawn.specs, rtol=drawn.rtol,
                                          untyped=drawn.untyped)
        except Exception as error:  # noqa: BLE001 - the outcome
            if verbose:
                traceback.print_exc()
            text = _describe(error)
            return ("refused" if _refusal(text) else "error"), text
    return ("wrong", "; ".join(problems)) if problems else ("ok", "")


def _both_processes(seed: int) -> None:
    """Draw `seed` verbosely as two processes of this script; prints what each printed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    # Files, not pipes: a process blocked on a full pipe would stall the other one too.
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]
    children = [subprocess.Popen([sys.executable, __file__, "--seed", str(seed), "--process",
                                  str(i), "--port", port], stdout=file,
                                 stderr=subprocess.STDOUT, text=True)
                for i, file in enumerate(files)]
    for i, (child, file) in enumerate(zip(children, files)):
        child.wait(timeout=600)
        file.seek(0)
        output = file.read()
        if i:  # the script itself is the same in both
            output = output[output.find("# Running"):]
        print(f"######## process {i} (exit {child.returncode})\n{output}")


def main(argv) -> None:
    if _PROCESS is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{_option(argv, '--port')}", num_processes=2,
                                   process_id=int(_PROCESS))
    if argv[0] == "--seed":
        seed = int(argv[1])
        drawn = draw(seed)
        if drawn.processes > 1 and _PROCESS is None:
            _both_processes(seed)
            return
        print(f"# Draw {seed} as a standalone script:\n")
        print(drawn.script(TESTS))
        print(f"# Running draw {seed}: {drawn.summary}\n", flush=True)
        result, detail = outcome(seed, verbose=True)
        print(f"\n{result}: {detail}" if detail else f"\n{result}", flush=True)
    elif argv[0] == "--seeds":
        for seed in (int(s) for s in argv[1].split(",") if s):
            start, cpu = time.perf_counter(), time.process_time()

            def twin_done(seed=seed):
                # If the process dies now, the program killed it, not its twin.
                print(json.dumps({"seed": seed, "phase": "program"}), flush=True)

            try:
                result, detail = outcome(seed, twin_done=twin_done)
            except Exception as error:  # noqa: BLE001 - a bug of the generator: say so
                result, detail = "error", f"the draw itself failed: {_describe(error)}"
            print(json.dumps({"seed": seed, "outcome": result, "detail": detail[:2000],
                              "seconds": round(time.perf_counter() - start, 3),
                              "cpu": round(time.process_time() - cpu, 3)}), flush=True)
    else:
        raise SystemExit(__doc__)
    if _PROCESS is not None:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])

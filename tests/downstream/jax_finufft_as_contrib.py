"""A pytest plugin: another project's own tests, with ``jax_finufft`` resolved to contrib.

``pytest -p jax_finufft_as_contrib`` (this folder on ``PYTHONPATH``; ``tools/run-downstream``
does it all) puts ``jaxdecl.contrib.finufft`` and its ``options`` into ``sys.modules`` under
jax-finufft's names before the project's conftest or tests import anything, and refuses
every other ``jax_finufft`` module, installed or not, naming it: the tests then run against
contrib or not at all. At the end it reports what contrib's kernels did (plans, executes)
and fails the run if they never ran, so a project that quietly skips where its import
fails cannot pass for the wrong reason.

Example (the summary line it prints)::

    contrib.finufft served jax_finufft: 412 executes (type 1: 200, 2: 212, 3: 0), 57 plans
"""

import importlib.abc
import sys

NAMES = ("jax_finufft", "jax_finufft.options")


class RefuseTheRealPackage(importlib.abc.MetaPathFinder):
    """Any ``jax_finufft`` module not aliased here is an ImportError, never the real one."""

    def find_spec(self, name, path=None, target=None):
        if name == "jax_finufft" or name.startswith("jax_finufft."):
            raise ImportError(f"{name}: this run resolves jax_finufft to "
                              f"jaxdecl.contrib.finufft, which has only {', '.join(NAMES)}",
                              name=name)
        return None


def _install() -> None:
    already = [name for name in sys.modules if name.split(".")[0] == "jax_finufft"]
    if already:
        raise RuntimeError(f"jax_finufft was imported before the plugin ({already}): load it "
                           "with `-p jax_finufft_as_contrib`, ahead of the project's conftest")
    import jaxdecl.contrib.finufft as contrib
    from jaxdecl.contrib.finufft import options

    sys.meta_path.insert(0, RefuseTheRealPackage())
    sys.modules.update({"jax_finufft": contrib, "jax_finufft.options": options})


_install()


def executes() -> dict:
    """Kernel executes by finufft type so far in this process, and the plans made."""
    from jaxdecl.contrib.finufft import _library

    counts = _library.counters()
    return {"plans": counts["plans_made"],
            **{t: counts[f"executed_type{t}"] for t in (1, 2, 3)}}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    done = executes()
    total = sum(done[t] for t in (1, 2, 3))
    terminalreporter.write_line(
        f"contrib.finufft served jax_finufft: {total} executes (type 1: {done[1]}, "
        f"2: {done[2]}, 3: {done[3]}), {done['plans']} plans")
    # (with pytest-xdist each worker counts its own: run these without -n)


def pytest_sessionfinish(session, exitstatus):
    if session.testscollected and not sum(executes()[t] for t in (1, 2, 3)):
        sys.stderr.write("jax_finufft_as_contrib: contrib.finufft's kernels never ran: the "
                         "project's tests did not reach it, so they prove nothing about it\n")
        session.exitstatus = 1

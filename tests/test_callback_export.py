"""jd.pure_callback in saved programs: what jax.pure_callback cannot do.

Mirrors jaxdecl/_callback/ops.py (__getstate__/__setstate__: a callback saved by its
import path). A program exported in one process runs in a fresh one that imports the
callbacks' module; a lambda or a closure is refused at export, naming it.
"""

import os
import sys

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_helper

import jaxdecl as jd

HELPER = os.path.join(os.path.dirname(__file__), "helpers_callback.py")


def test_exported_programs_run_in_a_fresh_process(tmp_path):
    assert run_helper([sys.executable, HELPER, "save", str(tmp_path)]) == {"saved": True}
    checks = run_helper([sys.executable, HELPER, "load", str(tmp_path)])
    assert checks.pop("kernels_before") == 0  # nothing but the artifacts to go by
    assert checks == {"forward": True, "vmap": True, "grad": True}


def test_a_process_without_the_callbacks_module_is_told_what_to_import(tmp_path):
    run_helper([sys.executable, HELPER, "save", str(tmp_path)])
    checks = run_helper([sys.executable, HELPER, "bare", str(tmp_path)])
    assert "import callbacks_saved" in checks["forward"], checks["forward"]


def _export(callback):
    def f(x):
        return jd.pure_callback(callback, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return jax.export.export(jax.jit(f), disabled_checks=jd.disabled_checks())(jnp.ones(3))


def test_a_lambda_is_refused_at_export_naming_it():
    with pytest.raises(jd.ExportError, match=r"pure_callback\(<lambda> \(.*"
                                             r"test_callback_export.py:\d+\)\).*a lambda"):
        _export(lambda x: x + 1)


def test_a_closure_is_refused_at_export_naming_it():
    scale = np.float64(3.0)

    def scaled(x):
        return x * scale

    with pytest.raises(jd.ExportError, match=r"scaled \(.*\).*inside a function"):
        _export(scaled)


def test_a_module_level_callback_exports_and_runs_here():
    exported = _export(np.sin)
    np.testing.assert_allclose(exported.call(jnp.ones(3)), np.sin(np.ones(3)), rtol=1e-12)

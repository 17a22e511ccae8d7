"""Rules compute inside XLA what they compute outside it: subnormal numbers are kept.

XLA's CPU runtime computes with flush-to-zero and denormals-are-zero set, and
keeps them set while it calls a custom call; the dispatcher runs every rule
(Python or C) in Python's usual environment instead, and gives XLA its own
back after the rule.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops import compile_c

import jaxdecl as jd

TINY = np.array([1e-310, 2.2e-308, -4e-320, 3.0], np.float64)  # three subnormal results


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Halve(jd.Primitive):
    """x / 2 and x * 1e-300 (both under the smallest normal for the subnormal inputs)."""

    @jd.abstract
    def shapes(self, x):
        return _same(x), _same(x)

    @jd.forward
    def apply(self, x):
        return x * 0.5, x * 1e-300


def _outside(x):
    x = np.asarray(x)
    return x * 0.5, x * 1e-300


def _bits(values):
    return [np.asarray(v).view(np.int64).tolist() for v in values]


@pytest.mark.parametrize("how", ["eager", "jit", "vmap", "grad_forward"])
def test_a_python_rule_keeps_subnormals_as_numpy_does_outside_jit(how):
    x = jnp.asarray(TINY)
    expected = _bits(_outside(TINY))
    assert expected[0][0] != 0  # the reference does keep them
    if how == "eager":
        got = Halve()(x)
    elif how == "jit":
        got = jax.jit(Halve())(x)
    elif how == "vmap":
        got = jax.jit(jax.vmap(Halve()))(x.reshape(2, 2))
        got = [g.reshape(4) for g in got]
    else:  # the forward inside a jitted vjp
        got, _ = jax.jit(lambda v: jax.vjp(Halve(), v))(x)
    assert _bits(got) == expected


def test_xla_keeps_its_own_environment_around_the_rule():
    # jax.numpy under jit flushes subnormals (XLA's choice); a rule in the same
    # program does not change that, before or after it runs.
    def program(v):
        before = v * 0.5
        half, _ = Halve()(v)
        return before, half, v * 0.5

    before, half, after = jax.jit(program)(jnp.asarray(TINY))
    flushed = np.asarray(jax.jit(lambda v: v * 0.5)(jnp.asarray(TINY)))
    assert _bits([before, after]) == _bits([flushed, flushed])
    assert _bits([half]) == _bits(_outside(TINY)[:1])


C_SOURCE = textwrap.dedent(r"""
    #include "jaxdecl.h"

    /* out = x * 0.5 (float64) */
    int halve(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
              int64_t nout, char* message, int64_t message_size) {
      int64_t n = 1;
      for (int64_t i = 0; i < in[0].rank; ++i) n *= in[0].dims[i];
      const double* x = (const double*)in[0].data;
      for (int64_t i = 0; i < n; ++i) ((double*)out[0].data)[i] = x[i] * 0.5;
      return 0;
    }
""")


def test_a_c_kernel_keeps_subnormals_as_outside_jit(tmp_path):
    library = compile_c(C_SOURCE, tmp_path, name="halve")

    class CHalve(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        apply = jd.forward(jd.cfunction(library.halve, keepalive=library))

    expected = _bits(_outside(TINY)[:1])
    direct = np.empty(4)
    CHalve.apply(TINY, out=direct)  # the kernel called from Python (ctypes)
    assert _bits([direct]) == expected
    assert _bits([jax.jit(CHalve())(jnp.asarray(TINY))]) == expected
    assert _bits([jax.jit(jax.vmap(CHalve()))(jnp.asarray(TINY).reshape(2, 2)).reshape(4)]) \
        == expected

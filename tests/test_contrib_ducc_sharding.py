"""contrib.ducc sharding declarations, checked here and on 4 host devices.

The declarations themselves are checked in this process; the multi-device
behaviour (no gather in the compiled HLO, DUCC called on each device's block,
values equal to the unsharded op and to ``jnp.fft``) runs in one subprocess
with 4 forced host devices (``helpers_ducc_sharding.py``).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import needs_split, subprocess_env

import jaxdecl as jd
from jaxdecl.contrib import ducc

HELPER = os.path.join(os.path.dirname(__file__), "helpers_ducc_sharding.py")


def _declared(op, *inputs):
    """The op's @sharding method applied to example inputs."""
    structs = [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in inputs]
    return op.partition(*structs)


@pytest.mark.parametrize("axes, replicate", [
    ((1,), ("d1",)), ((0, 2), ("d0", "d2")), ((-1,), ("d2",)), (None, ("d0", "d1", "d2")),
])
def test_fft_transformed_axes_are_replicated(axes, replicate):
    x = np.zeros((2, 3, 4), np.complex128)
    for op in (ducc.c2c(axes=axes), ducc.genuine_fht(axes=axes)):
        arg = x if isinstance(op, ducc.c2c) else x.real
        assert _declared(op, arg) == jd.ShardingRule("d0 d1 d2 -> d0 d1 d2",
                                                     replicate=replicate)


def test_point_and_row_ops_declare_their_batch_independent():
    rule = _declared(ducc.u2nu(), np.zeros((5, 2)), np.zeros((4, 6), np.complex128))
    assert rule == jd.ShardingRule("p k, g0 g1 -> p", replicate=("k", "g0", "g1"))
    rule = _declared(ducc.dirty2vis(1e-5, 1e-5), np.zeros((5, 3)), np.zeros(2),
                     np.zeros((32, 32)))
    assert rule == jd.ShardingRule("r t, c, x y -> r c", replicate=("t", "x", "y"))


RESIZING = {
    "r2c": (ducc.r2c(axes=(1,)), [np.zeros((4, 6))],
            dict(rule="d0 d1 -> d0 m", replicate=("d1", "m"))),
    "c2r": (ducc.c2r(6, axes=(0,)), [np.zeros((4, 5), np.complex128)],
            dict(rule="d0 d1 -> m d1", replicate=("d0", "m"))),
    "healpix": (ducc.healpix_synthesis(2, 3), [np.zeros((1, ducc.nalm(3)), np.complex128)],
                dict(rule="c l -> c p0", replicate=("c", "l", "p0"))),
    "synthesis_2d": (ducc.synthesis_2d("GL", 4, 7, 3), [np.zeros((1, 10), np.complex128)],
                     dict(rule="c l -> c p0 p1", replicate=("c", "l", "p0", "p1"))),
    "nu2u": (ducc.nu2u((4, 6)), [np.zeros((5, 2)), np.zeros(5, np.complex128)],
             dict(rule="p k, p -> g0 g1", replicate=("k", "g0", "g1"), reduce=("p",))),
    "vis2dirty": (ducc.vis2dirty(32, 32, 1e-5, 1e-5),
                  [np.ones((5, 3)), np.array([1e9, 2e9]), np.zeros((5, 2), np.complex128)],
                  dict(rule="r t, c, r c -> x y", replicate=("t", "x", "y"),
                                  reduce=("r", "c"))),
}


@pytest.mark.parametrize("name", sorted(RESIZING))
def test_ops_with_result_only_dims(name):
    """Result-only dims are declared replicate; the rule fits the op's own shapes."""
    op, args, rule = RESIZING[name]
    assert _declared(op, *args) == jd.ShardingRule(**rule)
    op(*args)


@pytest.mark.parametrize("op, args", [
    (ducc.c2c(axes=(1,)), [np.arange(24.0).reshape(4, 6) * (1 + 0.5j)]),
    (ducc.genuine_fht(axes=(0,)), [np.arange(24.0).reshape(4, 6)]),
    (ducc.u2nu(), [np.linspace(0, 6, 8).reshape(4, 2), np.ones((4, 6), np.complex128)]),
    (ducc.dirty2vis(1e-5, 1e-5), [np.array([[100.0, 50, 0], [30, -20, 0], [5, 5, 0],
                                            [-70, 10, 0]]), np.array([1e9, 1.2e9]),
                                  np.eye(32)]),
])
def test_check_passes_with_the_declaration(op, args):
    """jd.check (which also verifies sharding declarations) accepts the ops."""
    jd.check(op, *args)


@needs_split
def test_multi_device():
    completed = subprocess.run([sys.executable, HELPER], capture_output=True, text=True,
                               timeout=300, env=subprocess_env())
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    assert completed.returncode == 0 and lines, completed.stderr[-3000:]
    checks = json.loads(lines[-1])["checks"]
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) >= 61

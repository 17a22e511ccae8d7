"""jaxdecl.contrib.finufft: values against direct sums and jax-finufft, every transformation.

References: the sums term by term in jax.numpy (``helpers_finufft``), whose own
derivatives are the derivatives' references, and jax-finufft 1.3.1 where it is
installed (its ``vmap`` needs JAX < 0.10). Multi-device runs are in
``helpers_finufft_sharding.py`` (4 host devices; 2 processes).
"""

import os
import sys
import threading

import jax
import numpy as np
import pytest
from conftest import needs_split, run_helper, run_two_processes
from helpers_finufft import (
    MODES,
    REAL,
    call,
    inputs,
    loss,
    peer,
    random_complex,
    random_points,
    reference,
    relative_error,
    type1,
)

pytest.importorskip("finufft")

import jaxdecl as jd
from jaxdecl.contrib import finufft as nf
from jaxdecl.contrib.finufft import _library, _ops, _options

jax_finufft, PEER_MISSING = peer()  # the comparisons with jax-finufft skip without it
if jax_finufft is not None:
    from jax_finufft.options import Opts as PeerOpts

needs_peer = pytest.mark.skipif(jax_finufft is None, reason=str(PEER_MISSING))
HELPER = os.path.join(os.path.dirname(__file__), "helpers_finufft_sharding.py")

EPS = {np.complex128: 1e-12, np.complex64: 1e-6}
TOL = {np.complex128: 1e-9, np.complex64: 2e-4}
ONE = nf.Opts(nthreads=1)


# --- values ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_values_match_the_direct_sum(nufft_type, dim, dtype):
    source, points = inputs(np.random.default_rng(dim), nufft_type, dim, dtype)
    iflag = 1 if nufft_type == 1 else -1
    got = call(nufft_type, source, points, eps=EPS[dtype], opts=ONE)
    assert got.dtype == dtype
    assert relative_error(got, reference(nufft_type, source, points, iflag)) < TOL[dtype]


@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_sign_and_mode_order(nufft_type):
    source, points = inputs(np.random.default_rng(4), nufft_type, 2)
    for iflag in (1, -1):
        for modeord in (False, True) if nufft_type != 3 else (False,):
            got = call(nufft_type, source, points, iflag=iflag, eps=1e-12,
                       opts=nf.Opts(modeord=modeord, nthreads=1))
            expected = reference(nufft_type, source, points, iflag, modeord)
            assert relative_error(got, expected) < 1e-9, (iflag, modeord)


# (values shape, coordinate shapes) for type 1 in 1-D: jax-finufft's broadcasting rules.
SHAPES = [((7,), [(7,)]), ((3, 7), [(7,)]), ((3, 7), [(3, 7)]), ((2, 3, 7), [(2, 7)]),
          ((2, 3, 7), [(1, 1, 7)]), ((2, 3, 7), [(2, 1, 7)]), ((2, 3, 7), [(1, 3, 7)]),
          ((1, 7), [(4, 7)]), ((4, 7), [(7,), (1, 7)])]


def _broadcast_reference(source, points):
    """Type 1 by plain broadcasting: every leading position its own points."""
    dim = len(points)
    lead = np.broadcast_shapes(*[p.shape[:-1] for p in points])
    if source.ndim == len(lead) + 2:
        lead, points = lead + (1,), [p[..., None, :] for p in points]
    lead = np.broadcast_shapes(lead, source.shape[:-1])
    src = np.broadcast_to(source, lead + source.shape[-1:]).reshape(-1, 1, source.shape[-1])
    pts = tuple(np.broadcast_to(p, lead + p.shape[-1:]).reshape(-1, p.shape[-1]) for p in points)
    return np.asarray(type1(pts, src, MODES[dim], 1)).reshape(lead + MODES[dim])


@pytest.mark.parametrize("shapes", SHAPES, ids=[str(s) for s in SHAPES])
def test_broadcasting(shapes):
    rng = np.random.default_rng(5)
    source_shape, point_shapes = shapes
    source = random_complex(rng, source_shape)
    points = [random_points(rng, s) for s in point_shapes]
    got = nf.nufft1(MODES[len(points)], source, *points, eps=1e-12, opts=ONE)
    expected = _broadcast_reference(source, points)
    assert got.shape == expected.shape and relative_error(got, expected) < 1e-9
    if jax_finufft is not None:
        theirs = jax_finufft.nufft1(MODES[len(points)], source, *points, eps=1e-12)
        assert relative_error(got, theirs) < 1e-12


@needs_peer
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_same_values_as_jax_finufft(nufft_type, dtype):
    source, points = inputs(np.random.default_rng(6), nufft_type, 2, dtype, lead=(3,))
    ours = call(nufft_type, source, points, eps=EPS[dtype], opts=ONE)
    peer_call = {1: lambda *a, **k: jax_finufft.nufft1(MODES[2], *a, **k),
                 2: jax_finufft.nufft2, 3: jax_finufft.nufft3}[nufft_type]
    peer = peer_call(source, *points, eps=EPS[dtype], opts=PeerOpts(nthreads=1))
    assert relative_error(ours, peer) < (1e-13 if dtype == np.complex128 else 1e-6)
    # jax-finufft's own options are accepted too: a one-import switch.
    again = call(nufft_type, source, points, eps=EPS[dtype], opts=PeerOpts(nthreads=1))
    assert relative_error(again, ours) == 0


def test_real_strengths_are_promoted():
    rng = np.random.default_rng(7)
    x = random_points(rng, 9)
    c = rng.standard_normal(9)
    np.testing.assert_allclose(nf.nufft1(6, c, x, eps=1e-12), nf.nufft1(6, c + 0j, x, eps=1e-12))


def test_empty_inputs_give_zeros():
    x = np.zeros(0)
    assert np.all(nf.nufft1(4, np.zeros(0, np.complex128), x) == 0)
    assert nf.nufft2(np.ones(4, np.complex128), x).shape == (0,)
    assert nf.nufft1(4, np.zeros((0, 3), np.complex128), np.zeros(3)).shape == (0, 4)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("run, words", [
    (lambda: nf.nufft1(4, np.ones(3, np.complex128), np.ones(3, np.float32)),
     ["nufft1", "float64", "float32", "astype"]),
    (lambda: nf.nufft1(4, np.ones(3, np.int32), np.ones(3)), ["nufft1", "complex64", "int32"]),
    (lambda: nf.nufft1((4, 4), np.ones(3, np.complex128), np.ones(3)),
     ["output_shape", "1 integers"]),
    (lambda: nf.nufft2(np.ones((4, 4), np.complex128), *[np.ones(3)] * 4),
     ["nufft2", "1, 2 or 3"]),
    (lambda: nf.nufft3(np.ones(3, np.complex128), np.ones(3), np.ones(2), np.ones(2)),
     ["nufft3", "as many target arrays"]),
    (lambda: nf.nufft1(4, np.ones((2, 5, 3), np.complex128), np.ones((3, 3))),
     ["nufft1", "do not broadcast", "(2, 5, 3)"]),
    (lambda: nf.nufft1(4, np.ones(3, np.complex128), np.ones(3), opts="fast"),
     ["opts", "Opts", "'fast'"]),
    (lambda: nf.Opts(nthreads="many"), ["Opts.nthreads", "int", "'many'"]),
])
def test_errors_name_the_function_and_the_argument(run, words):
    with pytest.raises((TypeError, ValueError)) as info:
        run()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_finufft_errors_reach_the_caller():
    with pytest.raises(Exception, match="finufft_makeplan failed with code 7"):
        nf.nufft1(4, np.ones(3, np.complex128), np.ones(3), opts=nf.Opts(upsampfac=0.5))
    # The process keeps working.
    assert nf.nufft1(4, np.ones(3, np.complex128), np.zeros(3)).shape == (4,)


# --- options --------------------------------------------------------------------------------


def test_options_are_coerced_and_hashable():
    opts = nf.Opts(modeord=1, debug=0, nthreads="2", spread_sort=1)
    assert opts.modeord is True and opts.nthreads == 2
    assert opts.spread_sort == nf.options.SpreadSort.Sort
    assert hash(opts) == hash(nf.Opts(modeord=True, nthreads=2, spread_sort=1))


def test_nested_options_choose_per_direction():
    nested = nf.NestedOpts(forward=nf.Opts(nthreads=1), backward=nf.Opts(nthreads=3),
                           type2=nf.Opts(nthreads=5))
    config = np.frombuffer(_options.pack(1, 1e-6, 1, nested).tobytes(), _options.CONFIG_DTYPE)
    assert int(config["forward"]["nthreads"][0]) == 1
    assert int(config["transpose"]["nthreads"][0]) == 3
    by_type = nf.NestedOpts(type1=nf.Opts(nthreads=4), type2=nf.Opts(nthreads=5))
    config = np.frombuffer(_options.pack(1, 1e-6, 1, by_type).tobytes(), _options.CONFIG_DTYPE)
    # No backward: the transpose (a type 2) takes the nested options' type2 entry.
    assert (int(config["forward"]["nthreads"][0]), int(config["transpose"]["nthreads"][0])) \
        == (4, 5)
    source, points = inputs(np.random.default_rng(8), 1, 1)
    assert relative_error(call(1, source, points, eps=1e-12, opts=nested),
                          reference(1, source, points, 1)) < 1e-9


# --- jd.check, kernels, plans ---------------------------------------------------------------


def _op_inputs(rng, nufft_type, dim, dtype, eps, sets=2, batch=2, m=9, k=6):
    """(op, its inputs) in the ops' layout: points (T, M), values (T, B, ...)."""
    real = REAL[dtype]
    points = tuple(random_points(rng, (sets, m), real) for _ in range(dim))
    targets = tuple(random_points(rng, (sets, k), real, scale=3.0) for _ in range(dim))
    if nufft_type == 1:
        op = _ops.Type1Op(MODES[dim], eps, 1, ONE)
        return op, (op.config, points, random_complex(rng, (sets, batch, m), dtype))
    if nufft_type == 2:
        op = _ops.Type2Op(eps, -1, ONE)
        return op, (op.config, points, random_complex(rng, (sets, batch) + MODES[dim], dtype))
    op = _ops.Type3Op(eps, -1, ONE)
    return op, (op.config, points, targets, random_complex(rng, (sets, batch, m), dtype))


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_check_passes(nufft_type, dim, dtype):
    """jd.check's default tolerances where finufft is asked for better than they allow: every
    rule, the derivatives in the points and each input alone included, vmap, sharding."""
    op, args = _op_inputs(np.random.default_rng(22 + dim), nufft_type, dim, dtype, EPS[dtype])
    jd.check(op, *args)


@pytest.mark.parametrize("nufft_type", [1, 2])
def test_check_at_the_default_accuracy(nufft_type):
    """At finufft's default eps=1e-6 in complex128, types 1 and 2 pass jd.check's float64
    tolerances: their forward and transpose kernels are exact adjoints (the same spreading
    and FFT, read backwards), and a slice of the points spreads onto the same grid."""
    op, args = _op_inputs(np.random.default_rng(28), nufft_type, 2, np.complex128, 1e-6)
    jd.check(op, *args)


def test_check_of_type3_at_the_default_accuracy_needs_rtol():
    """Type 3 is accurate to about eps only: its grid follows the extent of the points and
    targets, so its transpose (the grid of the other side) and a slice of the points differ by
    about eps, and finite differences see eps-sized steps. The documented rtol=100·eps."""
    eps = 1e-6
    op, args = _op_inputs(np.random.default_rng(28), 3, 2, np.complex128, eps)
    with pytest.raises(AssertionError, match="Type3Op"):
        jd.check(op, *args)
    with pytest.warns(UserWarning, match="finite differences resolve the derivatives of Type3Op"):
        jd.check(op, *args, rtol=100 * eps)


def test_vmap_runs_one_batched_transform():
    rng = np.random.default_rng(23)
    x = random_points(rng, 17)
    sources = random_complex(rng, (6, 17))
    f = jax.jit(jax.vmap(lambda s: nf.nufft1(8, s, x, eps=1e-9, opts=ONE)))
    f(sources).block_until_ready()
    before = _library.counters()
    f(sources).block_until_ready()
    after = _library.counters()
    assert after["executed_type1"] - before["executed_type1"] == 1
    assert after["transforms_type1"] - before["transforms_type1"] == 6


def test_repeated_points_skip_setpts_and_grad_runs_two_transforms():
    rng = np.random.default_rng(24)
    source, (x,) = inputs(rng, 1, 1, lead=())
    g = jax.jit(jax.grad(loss(lambda s: nf.nufft1(10, s, x, eps=1e-9, opts=ONE))))
    g(source).block_until_ready()
    before = _library.counters()
    g(source).block_until_ready()
    after = _library.counters()
    assert after["transforms_type1"] - before["transforms_type1"] == 1  # the forward
    assert after["transforms_type2"] - before["transforms_type2"] == 1  # its transpose
    assert after["setpts_run"] == before["setpts_run"]  # the same points as last time
    assert after["setpts_skipped"] - before["setpts_skipped"] == 2
    moved = x + 0.1
    nf.nufft1(10, source, moved, eps=1e-9, opts=ONE).block_until_ready()
    assert _library.counters()["setpts_run"] == after["setpts_run"] + 1


def test_plans_kept_are_bounded():
    rng = np.random.default_rng(25)
    source, (x,) = inputs(rng, 1, 1, lead=())
    for n in range(6, 20):
        nf.nufft1(n, source, x, eps=1e-9, opts=ONE).block_until_ready()
    assert _library.counters()["idle_plans"] <= 8
    _library.clear_plans()
    assert _library.counters()["idle_plans"] == 0


def test_threads_calling_at_once():
    rng = np.random.default_rng(26)
    work = [inputs(rng, t, 2, lead=(3,)) for t in (1, 2, 3) for _ in range(2)]
    types = [t for t in (1, 2, 3) for _ in range(2)]
    fns = [jax.jit(lambda s, *p, t=t: call(t, s, p, eps=1e-12, opts=ONE)) for t in types]
    expected = [reference(t, s, p, 1 if t == 1 else -1) for t, (s, p) in zip(types, work)]
    errors = [None] * len(work)

    def run(i):
        for _ in range(5):
            errors[i] = max(errors[i] or 0, relative_error(fns[i](work[i][0], *work[i][1]),
                                                           expected[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(errors) < 1e-9, errors


# --- several devices and processes ----------------------------------------------------------


@needs_split
def test_four_devices():
    checks = run_helper([sys.executable, HELPER, "devices"])
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) >= 45


@needs_split
def test_two_processes():
    outputs = run_two_processes([sys.executable, HELPER, "processes"])
    for process, checks in enumerate(outputs):
        failed = {name: value for name, value in checks.items() if value is not True}
        assert not failed, (process, failed)

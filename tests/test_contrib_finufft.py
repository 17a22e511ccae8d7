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
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_split, run_helper, run_two_processes
from helpers_finufft import random_complex, random_points, relative_error, type1, type2, type3

pytest.importorskip("finufft")

import jaxdecl as jd
from jaxdecl.contrib import finufft as nf
from jaxdecl.contrib.finufft import _derivatives, _library, _ops, _options

try:
    import jax_finufft
    from jax_finufft.options import Opts as PeerOpts
except ImportError:  # the comparisons with jax-finufft are skipped
    jax_finufft = None

needs_peer = pytest.mark.skipif(jax_finufft is None, reason="jax-finufft is not installed")
needs_points = pytest.mark.skipif(
    not _ops.PARTLY_LINEAR, reason="differentiating the points needs partly linear ops")
HELPER = os.path.join(os.path.dirname(__file__), "helpers_finufft_sharding.py")

EPS = {np.complex128: 1e-12, np.complex64: 1e-6}
TOL = {np.complex128: 1e-9, np.complex64: 2e-4}
REAL = {np.complex128: np.float64, np.complex64: np.float32}
ONE = nf.Opts(nthreads=1)
MODES = {1: (10,), 2: (6, 5), 3: (4, 5, 3)}


def inputs(rng, nufft_type, dim, dtype=np.complex128, m=23, k=9, lead=(2,)):
    """(source, coordinate arrays) of the public functions: points shared by `lead`."""
    points = [random_points(rng, m, REAL[dtype]) for _ in range(dim)]
    if nufft_type == 3:
        points += [random_points(rng, k, REAL[dtype], scale=4.0) for _ in range(dim)]
    shape = lead + (MODES[dim] if nufft_type == 2 else (m,))
    return random_complex(rng, shape, dtype), points


def reference(nufft_type, source, points, iflag, modeord=False):
    """The direct sum of the public function on (..., M) or (..., N) values, shared points."""
    dim = len(points) // 2 if nufft_type == 3 else len(points)
    core = dim if nufft_type == 2 else 1
    lead = source.shape[:source.ndim - core]
    values = jnp.reshape(source, (1, -1) + source.shape[len(lead):])
    sets = tuple(jnp.asarray(p)[None] for p in points)
    if nufft_type == 1:
        out = type1(sets, values, MODES[dim], iflag, modeord)
    elif nufft_type == 2:
        out = type2(sets, values, iflag, modeord)
    else:
        out = type3(sets[:dim], sets[dim:], values, iflag)
    return jnp.reshape(out, lead + out.shape[2:])


def call(nufft_type, source, points, **kw):
    if nufft_type == 1:
        dim = len(points)
        return nf.nufft1(MODES[dim], source, *points, **kw)
    return (nf.nufft2 if nufft_type == 2 else nf.nufft3)(source, *points, **kw)


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
        peer = jax_finufft.nufft1(MODES[len(points)], source, *points, eps=1e-12)
        assert relative_error(got, peer) < 1e-12


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


# --- transformations with respect to the strengths --------------------------------------------


def _loss(f):
    return lambda *a: jnp.sum(jnp.abs(f(*a)) ** 2)


@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_derivatives_in_the_strengths(nufft_type):
    rng = np.random.default_rng(9)
    source, points = inputs(rng, nufft_type, 2)
    iflag = 1 if nufft_type == 1 else -1
    ours = lambda s: call(nufft_type, s, points, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda s: reference(nufft_type, s, points, iflag)  # noqa: E731
    t = random_complex(rng, source.shape)
    assert relative_error(jax.jit(jax.grad(_loss(ours)))(source),
                          jax.grad(_loss(ref))(source)) < 1e-9
    (y, dy), (y_ref, dy_ref) = jax.jvp(ours, (source,), (t,)), jax.jvp(ref, (source,), (t,))
    assert relative_error(y, y_ref) < 1e-9 and relative_error(dy, dy_ref) < 1e-9
    ct = random_complex(rng, y.shape)
    assert relative_error(jax.vjp(ours, source)[1](ct)[0], jax.vjp(ref, source)[1](ct)[0]) < 1e-9
    y_lin, lin = jax.linearize(ours, source)
    assert relative_error(lin(t), dy_ref) < 1e-9 and relative_error(y_lin, y_ref) < 1e-9
    (transposed,) = jax.linear_transpose(ours, source)(ct)
    assert relative_error(transposed, jax.linear_transpose(ref, source)(ct)[0]) < 1e-9


def test_jacobians_and_hessian_in_the_strengths():
    rng = np.random.default_rng(10)
    source, (x,) = inputs(rng, 1, 1, lead=())
    imag = source.imag

    def as_real(f):  # R^M -> R^2N: the real parameters of the strengths
        return lambda a: jnp.concatenate([f(a + 1j * imag).real, f(a + 1j * imag).imag])

    ours = as_real(lambda s: nf.nufft1(10, s, x, eps=1e-12, opts=ONE))
    ref = as_real(lambda s: reference(1, s, [x], 1))
    a = source.real
    for jac in (jax.jacfwd, jax.jacrev):
        assert relative_error(jax.jit(jac(ours))(a), jax.jit(jac(ref))(a)) < 1e-9
    energy = lambda f: lambda a: jnp.sum(f(a) ** 4)  # noqa: E731
    assert relative_error(jax.jit(jax.hessian(energy(ours)))(a),
                          jax.jit(jax.hessian(energy(ref)))(a)) < 1e-8


@pytest.mark.parametrize("in_axes, out_axes", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_vmap_nestings(in_axes, out_axes):
    rng = np.random.default_rng(11)
    x = random_points(rng, 13)
    source = random_complex(rng, (3, 4, 13))  # vmap twice over the leading dims
    f = lambda s: nf.nufft1(10, s, x, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda s: reference(1, s, [x], 1)  # noqa: E731
    moved = source if in_axes == 0 else np.swapaxes(source, 0, 1)

    def nest(g):
        return jax.vmap(jax.vmap(g), in_axes=in_axes, out_axes=out_axes)

    assert relative_error(jax.jit(nest(f))(moved), nest(ref)(moved)) < 1e-9


def test_vmap_over_points_and_mixed_axes():
    rng = np.random.default_rng(12)
    xs = random_points(rng, (3, 11))
    modes = random_complex(rng, (3, 6, 5))
    ys = random_points(rng, (11,))
    f = lambda m, x, y: nf.nufft2(m, x, y, eps=1e-12, opts=ONE)  # noqa: E731
    got = jax.vmap(f, in_axes=(0, 0, None))(modes, xs, ys)
    expected = np.stack([reference(2, modes[i], [xs[i], ys], -1) for i in range(3)])
    assert relative_error(got, expected) < 1e-9
    got = jax.vmap(f, in_axes=(None, 0, None))(modes[0], xs, ys)  # shared modes, own points
    expected = np.stack([reference(2, modes[0], [xs[i], ys], -1) for i in range(3)])
    assert relative_error(got, expected) < 1e-9
    grad = jax.vmap(jax.grad(_loss(lambda m: f(m, ys, ys))))(modes)
    expected = jax.vmap(jax.grad(_loss(lambda m: reference(2, m, [ys, ys], -1))))(modes)
    assert relative_error(grad, expected) < 1e-9


def test_scan_and_checkpoint():
    rng = np.random.default_rng(13)
    source, (x,) = inputs(rng, 1, 1, lead=())
    op = lambda s: nf.nufft2(nf.nufft1(10, s, x, eps=1e-12, opts=ONE), x, iflag=-1,  # noqa: E731
                             eps=1e-12, opts=ONE) / 23
    ref = lambda s: reference(2, reference(1, s, [x], 1), [x], -1) / 23  # noqa: E731

    def scanned(f):
        return lambda s: jnp.sum(jnp.abs(jax.lax.scan(lambda c, _: (f(c), None), s, None,
                                                      length=3)[0]) ** 2)

    assert relative_error(jax.jit(jax.grad(scanned(op)))(source),
                          jax.grad(scanned(ref))(source)) < 1e-8
    assert relative_error(jax.grad(scanned(jax.checkpoint(op)))(source),
                          jax.grad(scanned(ref))(source)) < 1e-8


# --- derivatives in the points ----------------------------------------------------------------


def _layout(rng, nufft_type, dim, sets=2, batch=2, m=11, k=7):
    """(op, points, targets, source) in the ops' (T, B, ...) layout."""
    points = tuple(random_points(rng, (sets, m)) for _ in range(dim))
    targets = tuple(random_points(rng, (sets, k), scale=3.0) for _ in range(dim))
    if nufft_type == 1:
        return _ops.Type1Op(MODES[dim], 1e-12, 1, ONE), points, (), \
            random_complex(rng, (sets, batch, m))
    if nufft_type == 2:
        return _ops.Type2Op(1e-12, -1, ONE), points, (), \
            random_complex(rng, (sets, batch) + MODES[dim])
    return _ops.Type3Op(1e-12, -1, ONE), points, targets, random_complex(rng, (sets, batch, m))


def _reference_of(op, nufft_type):
    if nufft_type == 1:
        return lambda points, targets, source: type1(points, source, op.n_modes, op.iflag)
    if nufft_type == 2:
        return lambda points, targets, source: type2(points, source, op.iflag)
    return lambda points, targets, source: type3(points, targets, source, op.iflag)


PUSH = {1: _derivatives.push1, 2: _derivatives.push2, 3: _derivatives.push3}
PULL = {1: _derivatives.pull1, 2: _derivatives.pull2, 3: _derivatives.pull3}


@pytest.mark.parametrize("nufft_type, dim", [(1, 1), (1, 3), (2, 2), (2, 3), (3, 1), (3, 3)])
def test_derivative_rules_against_the_direct_sum(nufft_type, dim):
    """The rules of _derivatives (what @jvp and @vjp run): tangents that are None (symbolic
    zeros) and cotangents that are not wanted cost nothing and change nothing else."""
    rng = np.random.default_rng(14 + dim)
    op, points, targets, source = _layout(rng, nufft_type, dim)
    ref = _reference_of(op, nufft_type)
    primals = (points, targets, source)
    tangents = (tuple(random_points(rng, p.shape) for p in points),
                tuple(random_points(rng, s.shape) for s in targets),
                random_complex(rng, source.shape))
    jvp = jax.jit(lambda t: jax.jvp(ref, primals, t)[1])  # linear in t: zeros stand for None
    push = jax.jit(PUSH[nufft_type], static_argnums=0)
    coords = primals[:2] if nufft_type == 3 else primals[:1]
    patterns = [(True, True, True), (True, True, False), (False, False, True)]
    patterns += [(False, True, False)] if nufft_type == 3 else []
    for present in patterns:
        given = [t if on else None for t, on in zip(tangents, present)]
        zeros = [t if on else jax.tree_util.tree_map(jnp.zeros_like, t)
                 for t, on in zip(tangents, present)]
        got = push(op, op.config, *coords, source, *given[:len(coords)], given[2])
        assert relative_error(got, jvp(tuple(zeros))) < 1e-9, present
    ct = random_complex(rng, got.shape)
    expected = jax.jit(lambda c: jax.vjp(ref, *primals)[1](c))(ct)
    expected = expected[:len(coords)] + expected[2:]
    pull = jax.jit(PULL[nufft_type], static_argnums=0, static_argnames="wanted")
    for wanted in [(True,) * len(coords) + (True,), (False,) * len(coords) + (True,),
                   (True,) * len(coords) + (False,)]:
        got = pull(op, op.config, *coords, source, ct, wanted=wanted)
        for value, reference_value, want in zip(got, expected, wanted):
            if not want:
                assert value is None
                continue
            flat = lambda tree: np.concatenate([np.ravel(v) for v in  # noqa: E731
                                                jax.tree_util.tree_leaves(tree)])
            assert relative_error(flat(value), flat(reference_value)) < 1e-9, wanted


@needs_points
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_grad_and_hessian_in_the_points(nufft_type):
    rng = np.random.default_rng(20)
    source, points = inputs(rng, nufft_type, 2, lead=())
    iflag = 1 if nufft_type == 1 else -1
    ours = lambda *p: call(nufft_type, source, p, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda *p: reference(nufft_type, source, p, iflag)  # noqa: E731
    argnums = tuple(range(len(points)))
    got = jax.jit(jax.grad(_loss(ours), argnums=argnums))(*points)
    expected = jax.grad(_loss(ref), argnums=argnums)(*points)
    for a, b in zip(got, expected):
        assert relative_error(a, b) < 1e-8
    rest = points[1:]
    hessian = jax.jit(jax.hessian(lambda p: _loss(ours)(p, *rest)))(points[0])
    expected = jax.jit(jax.hessian(lambda p: _loss(ref)(p, *rest)))(points[0])
    assert relative_error(hessian, expected) < 1e-7
    for jac in (jax.jacfwd, jax.jacrev):
        assert relative_error(jax.jit(jac(lambda p: ours(p, *rest).real))(points[0]),
                              jax.jit(jac(lambda p: ref(p, *rest).real))(points[0])) < 1e-8


def test_points_are_not_differentiated_without_partly_linear_ops():
    if _ops.PARTLY_LINEAR:
        pytest.skip("the points are differentiable")
    rng = np.random.default_rng(21)
    source, points = inputs(rng, 1, 1, lead=())
    with pytest.raises(Exception, match="points"):
        jax.grad(_loss(lambda x: nf.nufft1(10, source, x)))(points[0])


# --- jd.check, kernels, plans ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_check_passes(nufft_type, dtype):
    rng = np.random.default_rng(22)
    dim = {1: 2, 2: 1, 3: 3}[nufft_type]
    op, points, targets, source = _layout(rng, nufft_type, dim, m=9, k=6)
    real = REAL[dtype]
    op = type(op)(*((op.n_modes,) if nufft_type == 1 else ()), EPS[dtype], op.iflag, ONE)
    points = tuple(p.astype(real) for p in points)
    targets = tuple(s.astype(real) for s in targets)
    coords = (points, targets) if nufft_type == 3 else (points,)
    jd.check(op, op.config, *coords, source.astype(dtype))


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
    g = jax.jit(jax.grad(_loss(lambda s: nf.nufft1(10, s, x, eps=1e-9, opts=ONE))))
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


def _transforms(run) -> dict:
    """Transforms (n_trans summed) by finufft type that a second call of `run` executes."""
    jax.block_until_ready(run())
    before = _library.counters()
    jax.block_until_ready(run())
    after = _library.counters()
    return {t: after[f"transforms_type{t}"] - before[f"transforms_type{t}"] for t in (1, 2, 3)}


def test_derivatives_transform_only_what_is_asked():
    """Tangents of the strengths alone never transform anything for the points (2-D: a
    points' part would add two transforms to each derivative)."""
    rng = np.random.default_rng(27)
    source, points = inputs(rng, 1, 2, lead=())
    f = lambda s, *p: nf.nufft1(MODES[2], s, *p, eps=1e-9, opts=ONE)  # noqa: E731
    jvp = jax.jit(lambda s, t, *p: jax.jvp(lambda u: f(u, *p), (s,), (t,)))
    assert _transforms(lambda: jvp(source, source, *points)) == {1: 2, 2: 0, 3: 0}
    grad = jax.jit(jax.grad(_loss(f)))
    assert _transforms(lambda: grad(source, *points)) == {1: 1, 2: 1, 3: 0}
    if not _ops.PARTLY_LINEAR:
        return
    # With respect to the points alone: their two transforms, none for the strengths.
    grad = jax.jit(jax.grad(_loss(f), argnums=(1, 2)))
    assert _transforms(lambda: grad(source, *points)) == {1: 1, 2: 2, 3: 0}
    tangent = jax.jit(lambda s, x, y, dx: jax.jvp(lambda a: f(s, a, y), (x,), (dx,)))
    assert _transforms(lambda: tangent(source, *points, points[0])) == {1: 2, 2: 0, 3: 0}
    both = jax.jit(jax.grad(_loss(f), argnums=(0, 1, 2)))  # one stacked call of 3 transforms
    assert _transforms(lambda: both(source, *points)) == {1: 1, 2: 3, 3: 0}


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
    assert len(checks) >= 20


@needs_split
def test_two_processes():
    outputs = run_two_processes([sys.executable, HELPER, "processes"])
    for process, checks in enumerate(outputs):
        failed = {name: value for name, value in checks.items() if value is not True}
        assert not failed, (process, failed)

"""Derivatives of jaxdecl.contrib.finufft (``_derivatives``, ``_ops``): every transformation,
with respect to the strengths, the points, and both, against the derivatives of the direct sums
(``helpers_finufft``); kernel counters prove what each derivative transforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_finufft import (
    MODES,
    REAL,
    call,
    inputs,
    loss,
    random_complex,
    random_points,
    reference,
    relative_error,
    type1,
    type2,
    type3,
)

pytest.importorskip("finufft")

import jaxdecl as jd
from jaxdecl.contrib import finufft as nf
from jaxdecl.contrib.finufft import _derivatives, _library, _ops

ONE = nf.Opts(nthreads=1)
SIGN = {1: 1, 2: -1, 3: -1}  # jax-finufft's default signs
EPS = {np.complex128: 1e-12, np.complex64: 1e-6}
#: Relative errors of first derivatives (float32: eps 1e-6 and rounding, amplified by k or s).
TOL = {np.complex128: 1e-8, np.complex64: 1e-3}


# --- with respect to the strengths ------------------------------------------------------------


@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_derivatives_in_the_strengths(nufft_type):
    rng = np.random.default_rng(9)
    source, points = inputs(rng, nufft_type, 2)
    iflag = 1 if nufft_type == 1 else -1
    ours = lambda s: call(nufft_type, s, points, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda s: reference(nufft_type, s, points, iflag)  # noqa: E731
    t = random_complex(rng, source.shape)
    assert relative_error(jax.jit(jax.grad(loss(ours)))(source),
                          jax.grad(loss(ref))(source)) < 1e-9
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
    grad = jax.vmap(jax.grad(loss(lambda m: f(m, ys, ys))))(modes)
    expected = jax.vmap(jax.grad(loss(lambda m: reference(2, m, [ys, ys], -1))))(modes)
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


# --- with respect to the points, and both ----------------------------------------------------


def _upcast(tree):
    """Inputs in double precision: the references run there, whatever the op's precision."""
    return jax.tree_util.tree_map(
        lambda v: np.asarray(v, np.complex128 if np.iscomplexobj(v) else np.float64), tree)


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_first_derivatives_in_strengths_and_points(nufft_type, dtype):
    """jvp, vjp, linearize and grad with respect to every input at once, and each alone."""
    rng = np.random.default_rng(30 + nufft_type)
    source, points = inputs(rng, nufft_type, 2, dtype)
    ours = lambda s, *p: call(nufft_type, s, p, eps=EPS[dtype], opts=ONE)  # noqa: E731
    ref = lambda s, *p: reference(nufft_type, s, p, SIGN[nufft_type])  # noqa: E731
    primals = (source, *points)
    tangents = (random_complex(rng, source.shape, dtype),
                *[random_points(rng, p.shape, REAL[dtype]) for p in points])
    y, dy = jax.jit(lambda p, t: jax.jvp(ours, p, t))(primals, tangents)
    y_ref, dy_ref = jax.jvp(ref, _upcast(primals), _upcast(tangents))
    assert y.dtype == dy.dtype == dtype
    assert relative_error(y, y_ref) < TOL[dtype] and relative_error(dy, dy_ref) < TOL[dtype]
    y_lin, lin = jax.linearize(ours, *primals)
    assert relative_error(lin(*tangents), dy_ref) < TOL[dtype]
    ct = random_complex(rng, y.shape, dtype)
    got = jax.jit(lambda p, c: jax.vjp(ours, *p)[1](c))(primals, ct)
    expected = jax.vjp(ref, *_upcast(primals))[1](_upcast(ct))
    for name, a, b in zip(["source", "x", "y", "s", "t"], got, expected):
        assert a.dtype == (dtype if name == "source" else REAL[dtype]), name
        assert relative_error(a, b) < TOL[dtype], name
    for argnums in [(0,), (1, 2), (0, 1)] + ([(3,)] if nufft_type == 3 else []):
        got = jax.jit(jax.grad(loss(ours), argnums=argnums))(*primals)
        expected = jax.grad(loss(ref), argnums=argnums)(*_upcast(primals))
        for a, b in zip(got, expected):
            assert relative_error(a, b) < TOL[dtype], argnums


@pytest.mark.parametrize("nufft_type", [1, 2, 3])
def test_jacobians_and_hessians_mixing_strengths_and_points(nufft_type):
    """Second derivatives through the traceable rules: hessian blocks in (strengths, x, and a
    target for type 3), jacfwd and jacrev of both at once."""
    rng = np.random.default_rng(35)
    source, points = inputs(rng, nufft_type, 1 if nufft_type != 2 else 2, lead=(), m=9, k=5)
    imag = source.imag
    argnums = (0, 1, 2) if nufft_type == 3 or len(points) == 2 else (0, 1)

    def as_real(f):  # the real parts of the strengths and the coordinates -> R^2N
        def g(a, *p):
            out = f(a + 1j * imag, *p)
            return jnp.concatenate([out.real.ravel(), out.imag.ravel()])
        return g

    ours = as_real(lambda s, *p: call(nufft_type, s, p, eps=1e-12, opts=ONE))
    ref = as_real(lambda s, *p: reference(nufft_type, s, p, SIGN[nufft_type]))
    args = (source.real, *points)
    for jac in (jax.jacfwd, jax.jacrev):
        got = jax.jit(jac(ours, argnums=argnums))(*args)
        expected = jax.jit(jac(ref, argnums=argnums))(*args)
        for a, b in zip(got, expected):
            assert relative_error(a, b) < 1e-8, jac.__name__
    energy = lambda f: lambda *a: jnp.sum(f(*a) ** 4)  # noqa: E731
    got = jax.jit(jax.hessian(energy(ours), argnums=argnums))(*args)
    expected = jax.jit(jax.hessian(energy(ref), argnums=argnums))(*args)
    for i in range(len(argnums)):
        for j in range(len(argnums)):
            assert relative_error(got[i][j], expected[i][j]) < 1e-7, (i, j)


def test_vmap_nestings_through_the_points():
    """vmap over points and strengths nested both ways, around grad and jvp in both."""
    rng = np.random.default_rng(36)
    xs = random_points(rng, (3, 13))
    cs = random_complex(rng, (4, 13))
    f = lambda c, x: nf.nufft1(10, c, x, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda c, x: reference(1, c, [x], 1)  # noqa: E731

    def nest(g):  # outer: the point sets; inner: the strengths (the points shared)
        return jax.vmap(jax.vmap(g, in_axes=(0, None)), in_axes=(None, 0))

    def swapped(g):  # outer: the strengths; inner: the point sets
        return jax.vmap(jax.vmap(g, in_axes=(None, 0)), in_axes=(0, None))

    for wrap in (nest, swapped):
        for derivative in (lambda h: jax.grad(loss(h), argnums=(0, 1)),
                           lambda h: lambda c, x: jax.jvp(h, (c, x), (c, jnp.cos(x)))[1]):
            got = jax.jit(wrap(derivative(f)))(cs, xs)
            expected = wrap(derivative(ref))(cs, xs)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
                assert relative_error(a, b) < 1e-8, wrap.__name__
    # A batch of point sets against one set of strengths, differentiated in the points.
    got = jax.jit(jax.vmap(jax.jacfwd(lambda x: f(cs[0], x).real)))(xs)
    expected = jax.vmap(jax.jacfwd(lambda x: ref(cs[0], x).real))(xs)
    assert relative_error(got, expected) < 1e-8


def test_scan_and_checkpoint_through_the_points():
    """Points that move in a scan (each step a type 2 at the last step's points), under grad
    with respect to the modes and the starting points, with and without checkpoint."""
    rng = np.random.default_rng(37)
    modes = random_complex(rng, (6, 5)) / 30
    x0, y0 = random_points(rng, (2, 17))

    def walk(transform):
        def step(carry, _):
            x, y = carry
            v = transform(modes, x, y)
            return (x + v.real, y + v.imag), None

        def run(f, x, y):
            (x, y), _ = jax.lax.scan(step, (x, y), None, length=3)
            return jnp.sum(jnp.sin(x) * y)
        return run

    ours = lambda f, x, y: nf.nufft2(f, x, y, eps=1e-12, opts=ONE)  # noqa: E731
    ref = lambda f, x, y: reference(2, f, [x, y], -1)  # noqa: E731
    expected = jax.grad(walk(ref), argnums=(1, 2))(modes, x0, y0)
    for transform in (ours, jax.checkpoint(ours)):
        got = jax.jit(jax.grad(walk(transform), argnums=(1, 2)))(modes, x0, y0)
        for a, b in zip(got, expected):
            assert relative_error(a, b) < 1e-8


def test_linear_transpose_in_the_points_is_refused():
    rng = np.random.default_rng(38)
    source, (x,) = inputs(rng, 1, 1, lead=())
    # With respect to the strengths: the transpose (a type 2), as for any linear map.
    ct = random_complex(rng, (10,))
    (got,) = jax.linear_transpose(lambda c: nf.nufft1(10, c, x, eps=1e-12, opts=ONE), source)(ct)
    expected = jax.linear_transpose(lambda c: reference(1, c, [x], 1), source)(ct)[0]
    assert relative_error(got, expected) < 1e-9
    with pytest.raises(jd.MissingRuleError, match="Type1Op is linear in 'source' only, so JAX "
                                                  "cannot transpose it with respect to 'points"):
        jax.linear_transpose(lambda v: nf.nufft1(10, source, v, eps=1e-12, opts=ONE), x)(ct)


# --- what each derivative transforms ----------------------------------------------------------


def _transforms(run) -> dict:
    """(transforms, execute calls) by finufft type that a second call of `run` runs."""
    jax.block_until_ready(run())
    before = _library.counters()
    jax.block_until_ready(run())
    after = _library.counters()
    return ({t: after[f"transforms_type{t}"] - before[f"transforms_type{t}"] for t in (1, 2, 3)},
            {t: after[f"executed_type{t}"] - before[f"executed_type{t}"] for t in (1, 2, 3)})


# (type, derivative, transforms by type, execute calls by type) in 2-D (type 3: x, y -> s, t).
# The forward runs once (type 1: a type 1; type 2: a type 2; type 3: a type 3); a tangent or a
# cotangent of the strengths adds one transform (type 1's cotangent is a type 2, and back), and
# one per coordinate whose tangent is present or whose cotangent is wanted, stacked into one
# execute. A derivative in the strengths alone transforms nothing for the points.
COUNTED = [
    (1, "jvp source", {1: 2}, {1: 2}),
    (1, "grad source", {1: 1, 2: 1}, {1: 1, 2: 1}),
    (1, "jvp x", {1: 2}, {1: 2}),
    (1, "grad x y", {1: 1, 2: 2}, {1: 1, 2: 1}),
    (1, "grad source x y", {1: 1, 2: 3}, {1: 1, 2: 1}),
    (2, "jvp source", {2: 2}, {2: 2}),
    (2, "grad source", {2: 1, 1: 1}, {2: 1, 1: 1}),
    (2, "jvp x", {2: 2}, {2: 2}),
    (2, "grad x y", {2: 3}, {2: 2}),
    (2, "grad source x y", {2: 3, 1: 1}, {2: 2, 1: 1}),
    (3, "jvp source", {3: 2}, {3: 2}),
    (3, "grad source", {3: 2}, {3: 2}),
    (3, "jvp x", {3: 2}, {3: 2}),
    (3, "jvp s", {3: 2}, {3: 2}),
    (3, "grad x y", {3: 3}, {3: 2}),
    (3, "grad s t", {3: 3}, {3: 2}),
    (3, "grad source x y s t", {3: 6}, {3: 3}),
]


@pytest.mark.parametrize("nufft_type, derivative, transforms, executes", COUNTED,
                         ids=[f"type{c[0]}-{c[1]}" for c in COUNTED])
def test_derivatives_transform_only_what_is_asked(nufft_type, derivative, transforms, executes):
    rng = np.random.default_rng(27)
    source, points = inputs(rng, nufft_type, 2, lead=())
    f = lambda *a: call(nufft_type, a[0], a[1:], eps=1e-9, opts=ONE)  # noqa: E731
    args = (source, *points)
    kind, *names = derivative.split()
    argnums = tuple(["source", "x", "y", "s", "t"].index(n) for n in names)
    if kind == "grad":
        run = jax.jit(jax.grad(loss(f), argnums=argnums))
    else:
        (i,) = argnums

        def run(*a):
            return jax.jvp(lambda v: f(*a[:i], v, *a[i + 1:]), (a[i],), (a[i] * 0.5,))

        run = jax.jit(run)
    counted = _transforms(lambda: run(*args))
    expected = tuple({t: d.get(t, 0) for t in (1, 2, 3)} for d in (transforms, executes))
    assert counted == expected

"""contrib.finufft's masked points (``mask=``): a padded call is the unpadded call.

Callers pad point sets to a fixed size (a jit needs static shapes). With ``mask`` False at
the padding, finufft never sees a padded point: every value and derivative is the unpadded
call's (zero where padded), padding may hold NaN, and the C kernels' counters show that only
the kept points were given to finufft. References: the same call on the unpadded points, and
the direct sums of ``helpers_finufft``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_split
from helpers_finufft import MODES, random_complex, random_points, reference, relative_error
from jax.test_util import check_grads

pytest.importorskip("finufft")

import jaxdecl as jd
from jaxdecl.contrib import finufft as nf
from jaxdecl.contrib.finufft import _library, _ops

ONE = nf.Opts(nthreads=1)
EPS = {np.complex128: 1e-12, np.complex64: 1e-6}
TOL = {np.complex128: 1e-9, np.complex64: 2e-4}
REAL = {np.complex128: np.float64, np.complex64: np.float32}


def padded(rng, dim, kept, size, dtype, fill=np.nan):
    """Points (d arrays of `size`), the first `kept` real and the rest `fill`, shuffled with
    their mask (padding anywhere, not only at the end); the kept points alone, in order."""
    points = [random_points(rng, kept, REAL[dtype]) for _ in range(dim)]
    order = rng.permutation(size)
    mask = np.zeros(size, bool)
    mask[order[:kept]] = True
    full = []
    for x in points:
        y = np.full(size, fill, REAL[dtype])
        y[np.flatnonzero(mask)] = x
        full.append(y)
    return tuple(full), mask, tuple(points)


def spread(values, mask, fill=np.nan):
    """Values at the kept points, placed at their positions of a padded array (`fill` else)."""
    out = np.full(values.shape[:-1] + mask.shape, fill, values.dtype)
    out[..., np.flatnonzero(mask)] = values
    return out


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_type1_of_padded_points_is_type1_of_the_kept_ones(dim, dtype):
    rng = np.random.default_rng(dim)
    points, mask, kept = padded(rng, dim, 40, 64, dtype)
    source = random_complex(rng, (40,), dtype)
    modes = MODES[dim]
    want = nf.nufft1(modes, source, *kept, eps=EPS[dtype], opts=ONE)
    got = nf.nufft1(modes, spread(source, mask), *points, eps=EPS[dtype], opts=ONE, mask=mask)
    assert got.dtype == dtype and not np.isnan(np.asarray(got)).any()
    assert relative_error(got, want) < TOL[dtype]
    assert relative_error(got, reference(1, source, kept, 1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("dim", [1, 2])
def test_type2_at_padded_points_is_zero_there_and_the_unpadded_values_elsewhere(dim, dtype):
    rng = np.random.default_rng(10 + dim)
    points, mask, kept = padded(rng, dim, 30, 50, dtype)
    modes = random_complex(rng, (3,) + (8,) * dim, dtype)  # 3 transforms sharing the points
    want = np.asarray(nf.nufft2(modes, *kept, eps=EPS[dtype], opts=ONE))
    got = np.asarray(nf.nufft2(modes, *points, eps=EPS[dtype], opts=ONE, mask=mask))
    assert got.shape == (3, 50)
    assert (got[:, ~mask] == 0).all()
    assert relative_error(got[:, mask], want) < TOL[dtype]


def test_padding_is_never_given_to_finufft():
    rng = np.random.default_rng(0)
    points, mask, kept = padded(rng, 1, 100, 1000, np.complex128)
    source = random_complex(rng, (1000,), np.complex128)
    before = _library.counters()["points_set"]
    jax.block_until_ready(nf.nufft1(16, source, *points, eps=1e-9, opts=ONE, mask=mask))
    assert _library.counters()["points_set"] - before == 100


def test_a_set_with_no_points_left_transforms_to_zeros():
    x = np.full(5, np.nan)
    mask = np.zeros(5, bool)
    assert (np.asarray(nf.nufft1(8, np.ones(5, complex), x, eps=1e-9, mask=mask)) == 0).all()
    assert (np.asarray(nf.nufft2(np.ones(8, complex), x, eps=1e-9, mask=mask)) == 0).all()


def test_every_point_set_has_a_mask_of_its_own():
    """A batch of point sets (leading dims), each padded differently, under jit and vmap."""
    rng = np.random.default_rng(3)
    sets = [padded(rng, 2, kept, 24, np.complex128) for kept in (24, 10, 0, 17)]
    xs = np.stack([s[0][0] for s in sets]), np.stack([s[0][1] for s in sets])
    masks = np.stack([s[1] for s in sets])
    modes = random_complex(rng, (4, 6, 6), np.complex128)
    batched = jax.jit(lambda f, x, y, m: nf.nufft2(f, x, y, eps=1e-12, mask=m))
    mapped = jax.vmap(lambda f, x, y, m: nf.nufft2(f, x, y, eps=1e-12, mask=m))
    for got in (batched(modes, *xs, masks), mapped(modes, *xs, masks)):
        got = np.asarray(got)
        for i, (_, mask, kept) in enumerate(sets):
            assert (got[i, ~mask] == 0).all()
            if mask.any():
                want = np.asarray(nf.nufft2(modes[i], *kept, eps=1e-12))
                assert relative_error(got[i, mask], want) < 1e-9


@pytest.mark.parametrize("nufft_type", [1, 2])
def test_derivatives_are_the_unpadded_call_s_and_zero_at_the_padding(nufft_type):
    rng = np.random.default_rng(nufft_type)
    points, mask, kept = padded(rng, 1, 20, 32, np.complex128, fill=0.5)
    x, (x_kept,) = points[0], kept
    if nufft_type == 1:
        c = random_complex(rng, (20,), np.complex128)
        c_padded = spread(c, mask, fill=0.0)

        def unpadded(c, x):
            return jnp.sum(jnp.abs(nf.nufft1(8, c, x, eps=1e-12)) ** 2)

        def masked(c, x):
            return jnp.sum(jnp.abs(nf.nufft1(8, c, x, eps=1e-12, mask=mask)) ** 2)

        want_c, want_x = jax.grad(unpadded, argnums=(0, 1))(c, x_kept)
        got_c, got_x = jax.grad(masked, argnums=(0, 1))(c_padded, x)
    else:
        f = random_complex(rng, (8,), np.complex128)
        weights = random_complex(rng, (32,), np.complex128)

        def unpadded(f, x):
            return jnp.sum(jnp.abs(weights[mask] * nf.nufft2(f, x, eps=1e-12)) ** 2)

        def masked(f, x):
            return jnp.sum(jnp.abs(weights * nf.nufft2(f, x, eps=1e-12, mask=mask)) ** 2)

        want_c, want_x = jax.grad(unpadded, argnums=(0, 1))(f, x_kept)
        got_c, got_x = jax.grad(masked, argnums=(0, 1))(f, x)
        want_c = spread(np.asarray(want_c), np.ones(8, bool))  # the modes are not padded
    got_c, got_x = np.asarray(got_c), np.asarray(got_x)
    assert (got_x[~mask] == 0).all()
    assert relative_error(got_x[mask], want_x) < 1e-8
    if nufft_type == 1:
        assert (got_c[~mask] == 0).all()
        assert relative_error(got_c[mask], want_c) < 1e-8
    else:
        assert relative_error(got_c, want_c) < 1e-8
    # The jvp agrees with the vjp, and finite differences with both (check_grads).
    fun = (lambda c, x: nf.nufft1(8, c, x, eps=1e-12, mask=mask)) if nufft_type == 1 else \
        (lambda c, x: nf.nufft2(c, x, eps=1e-12, mask=mask))
    first = c_padded if nufft_type == 1 else f
    check_grads(fun, (first, x), order=2, modes=("fwd", "rev"), eps=1e-5,
                              atol=1e-5, rtol=1e-5)


def test_nan_padding_gives_finite_gradients():
    x = np.array([0.1, np.nan, -1.0, np.nan])
    mask = ~np.isnan(x)
    c = np.array([1.0 + 1j, np.nan, 2.0, np.nan])

    def loss(c, x):
        return jnp.sum(jnp.abs(nf.nufft1(6, c, x, eps=1e-12, mask=mask)) ** 2)

    got_c, got_x = jax.grad(loss, argnums=(0, 1))(c, x)
    assert np.isfinite(np.asarray(got_c)).all() and np.isfinite(np.asarray(got_x)).all()


def test_a_mask_that_is_not_bool_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"nufft2: mask must be a bool array"):
        nf.nufft2(np.ones(8, complex), np.zeros(4), mask=np.ones(4, int))
    with pytest.raises(ValueError, match=r"nufft1: the shapes do not broadcast.*mask \(3,\)"):
        nf.nufft1(8, np.ones(4, complex), np.zeros(4), mask=np.ones(3, bool))


@needs_split
def test_sharded_over_the_points_on_host_devices_matches_one_device():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 host devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("p",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    rng = np.random.default_rng(7)
    points, mask, kept = padded(rng, 1, 30, 64, np.complex128, fill=0.0)
    c = spread(random_complex(rng, (30,), np.complex128), mask, fill=0.0)
    one = nf.nufft1(8, c, points[0], eps=1e-12, mask=mask)
    args = [jax.device_put(a, split) for a in (c, points[0], mask)]
    fun = jax.jit(lambda c, x, m: nf.nufft1(8, c, x, eps=1e-12, mask=m))
    assert relative_error(fun(*args), one) < 1e-10
    assert "all-gather" not in fun.lower(*args).compile().as_text()


@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("nufft_type", [1, 2])
def test_check_passes_on_the_masked_ops(nufft_type, dim, dtype):
    """jd.check on the ops themselves (points (T, M), a mask per set, values (T, B, ...)):
    linearity and adjointness of the masked transposes, the derivatives in the points against
    finite differences, vmap against a loop, the sharding declarations."""
    rng = np.random.default_rng(40 + dim)
    sets, batch, m = 2, 2, 9
    points = tuple(random_points(rng, (sets, m), REAL[dtype]) for _ in range(dim))
    mask = rng.random((sets, m)) < 0.6
    if nufft_type == 1:
        op = _ops.MaskedType1Op(MODES[dim], EPS[dtype], 1, ONE)
        values = random_complex(rng, (sets, batch, m), dtype)
    else:
        op = _ops.MaskedType2Op(EPS[dtype], -1, ONE)
        values = random_complex(rng, (sets, batch) + MODES[dim], dtype)
    jd.check(op, op.config, points, mask, values)


def test_in_a_scan_under_checkpoint_with_a_mask_per_step():
    """lax.scan over padded point sets (the mask a scanned operand), under jax.checkpoint and
    grad: each step is the unpadded call of its kept points."""
    rng = np.random.default_rng(11)
    steps = [padded(rng, 1, kept, 16, np.complex128, fill=0.0) for kept in (16, 5, 9)]
    xs = np.stack([s[0][0] for s in steps])
    masks = np.stack([s[1] for s in steps])
    f = random_complex(rng, (8,), np.complex128)

    @jax.checkpoint
    def step(total, inputs):
        x, mask = inputs
        values = nf.nufft2(f, x, eps=1e-12, mask=mask)
        return total + jnp.sum(jnp.abs(values) ** 2), values

    def loss(x):
        return jax.lax.scan(step, 0.0, (x, masks))[0]

    want = sum(float(jnp.sum(jnp.abs(nf.nufft2(f, *kept, eps=1e-12)) ** 2))
               for _, _, kept in steps)
    assert abs(float(jax.jit(loss)(xs)) - want) < 1e-9 * want
    grad = np.asarray(jax.grad(loss)(xs))
    for g, (_, mask, (x_kept,)) in zip(grad, steps):
        assert (g[~mask] == 0).all()
        want_g = jax.grad(lambda x: jnp.sum(jnp.abs(nf.nufft2(f, x, eps=1e-12)) ** 2))(x_kept)
        assert relative_error(g[mask], want_g) < 1e-8

"""jaxdecl ops inside the JAX ecosystem, each program against its jax.numpy twin.

Each test runs one program twice: with two jaxdecl ops whose rules are NumPy
(``Tanh`` and the multilinear ``MatVec``) and with ``jnp.tanh`` and
``jnp.matmul`` in their place, and compares the values to rounding. The
libraries are optional (``pip install ".[ecosystem]"``, part of the ``test``
extra); a test whose library is missing is skipped, naming it, and so is one whose library
this Python cannot install (flax on Python 3.10 and 3.15), with pyproject.toml's marker
as the reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_extras import need

import jaxdecl as jd

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)


class Tanh(jd.Primitive):
    """tanh(x), elementwise."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.tanh(x, out=out)

    @jd.jvp
    def push(self, x, dx):
        return (1 - np.tanh(x) ** 2) * dx

    @jd.vjp
    def pull(self, x, ct):
        return (1 - np.tanh(x) ** 2) * ct


class MatVec(jd.Primitive, multilinear=True):
    """a @ x for a matrix a and a vector x: linear in each."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], jnp.result_type(a.dtype, x.dtype))

    @jd.forward
    def apply(self, a, x):
        return a @ x

    @jd.transpose(wrt="a")
    def transpose_a(self, x, ct):
        return np.outer(ct, x)

    @jd.transpose(wrt="x")
    def transpose_x(self, a, ct):
        return a.T @ ct


OPS = (Tanh(), MatVec())
TWINS = (jnp.tanh, jnp.matmul)


def assert_twins(run, rtol=1e-10, atol=1e-12):
    """``run(tanh, matvec)`` gives the same pytree with jaxdecl's ops as with jax.numpy's."""
    got, want = run(*OPS), run(*TWINS)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)
    return got


def _data(rows=16, columns=3, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, columns)))
    w = jnp.asarray(rng.standard_normal(columns))
    return x, jnp.tanh(x @ w) + 0.05 * jnp.asarray(rng.standard_normal(rows))


def test_optax_training_steps():
    optax = pytest.importorskip("optax")
    x, y = _data()

    def run(tanh, matvec):
        def loss(p):
            return jnp.mean((tanh(matvec(x, p["w"]) + p["b"]) - y) ** 2)

        optimizer = optax.adam(0.1)
        params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
        state = optimizer.init(params)

        @jax.jit
        def step(params, state):
            value, grads = jax.value_and_grad(loss)(params)
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        losses = []
        for _ in range(5):
            params, state, value = step(params, state)
            losses.append(value)
        return params, jnp.stack(losses)

    params, losses = assert_twins(run)
    assert losses[-1] < losses[0]


def _spd(n=5, seed=1):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    return jnp.asarray(m @ m.T + n * np.eye(n)), jnp.asarray(rng.standard_normal(n))


@pytest.mark.parametrize("solver", ["CG", "LU"])
def test_lineax_solve_with_a_jaxdecl_matvec(solver):
    lx = pytest.importorskip("lineax")
    a, b = _spd()

    def run(tanh, matvec):
        def solve(a, b):
            operator = lx.FunctionLinearOperator(
                lambda v: matvec(a, v), jax.ShapeDtypeStruct(b.shape, b.dtype),
                tags=lx.positive_semidefinite_tag)
            # LU materialises the matrix: the matvec under vmap, once per column.
            method = lx.CG(rtol=1e-13, atol=1e-13) if solver == "CG" else lx.LU()
            return lx.linear_solve(operator, b, method).value

        value = jax.jit(solve)(a, b)
        grads = jax.grad(lambda a, b: jnp.sum(solve(a, b) ** 2), argnums=(0, 1))(a, b)
        return value, grads

    value, _ = assert_twins(run, rtol=1e-9)
    np.testing.assert_allclose(value, np.linalg.solve(a, b), rtol=1e-9)


def test_optimistix_root_find_and_its_implicit_gradient():
    optx = pytest.importorskip("optimistix")
    a, _ = _spd(3)
    c = jnp.asarray([0.3, -0.2, 0.5])

    def run(tanh, matvec):
        def residual(y, c):
            return tanh(matvec(a, y)) / 10 + y - c

        def root(c):
            solver = optx.Newton(rtol=1e-12, atol=1e-12)
            return optx.root_find(residual, solver, jnp.zeros(3), args=c).value

        return jax.jit(root)(c), jax.jacrev(root)(c)  # the derivative: implicit function theorem

    assert_twins(run, rtol=1e-9)


@pytest.mark.parametrize("adjoint", ["RecursiveCheckpointAdjoint", "BacksolveAdjoint",
                                     "ForwardMode"])
def test_diffrax_vector_field_and_gradient_through_the_solve(adjoint):
    diffrax = pytest.importorskip("diffrax")
    a, y0 = _spd(3)
    a = -a / 5

    def run(tanh, matvec):
        def field(t, y, a):
            return tanh(matvec(a, y))

        def final(a, y0):
            solution = diffrax.diffeqsolve(
                diffrax.ODETerm(field), diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.1, y0=y0,
                args=a, adjoint=getattr(diffrax, adjoint)(), max_steps=16)
            return solution.ys[-1]

        def loss(a, y0):
            value = jnp.sum(final(a, y0) ** 2)
            return value, value

        derivative = jax.jacfwd if adjoint == "ForwardMode" else jax.grad
        return jax.jit(derivative(loss, argnums=(0, 1), has_aux=True))(a, y0)

    assert_twins(run, rtol=1e-9)


def test_numpyro_nuts_over_a_likelihood_that_calls_ops():
    numpyro = pytest.importorskip("numpyro")
    import numpyro.distributions as dist
    from numpyro.infer import MCMC, NUTS

    x, y = _data(rows=20)

    def run(tanh, matvec):
        def model(x, y):
            w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]))
            numpyro.sample("y", dist.Normal(tanh(matvec(x, w)), 0.1), obs=y)

        mcmc = MCMC(NUTS(model, max_tree_depth=4), num_warmup=20, num_samples=20,
                    progress_bar=False)
        mcmc.run(jax.random.key(0), x, y)
        return mcmc.get_samples()["w"]

    samples = assert_twins(run, rtol=1e-7, atol=1e-9)
    assert samples.shape == (20, 3)


def test_flax_nnx_module_passes_its_params_to_ops():
    need("flax", minversion="0.11")
    optax = pytest.importorskip("optax")
    from flax import nnx

    x, y = _data()

    def run(tanh, matvec):
        class Layer(nnx.Module):
            def __init__(self, rngs):
                self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 3)) / 3)
                self.v = nnx.Param(jnp.ones(3))

            def __call__(self, row):  # the Params themselves reach the ops, as in jnp
                return jnp.sum(self.v * tanh(matvec(self.w, row)))

        def loss(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        model = Layer(nnx.Rngs(0))
        eager = model(x[0])
        jvp = jax.jvp(lambda w: tanh(w), (model.w,), (nnx.Param(jnp.ones((3, 3))),))
        grads = nnx.grad(loss)(model)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        losses = jnp.stack([step(model, optimizer) for _ in range(3)])
        return eager, jvp, grads, nnx.state(model, nnx.Param), losses

    *_, losses = assert_twins(run)
    assert losses[-1] < losses[0]


def test_equinox_module_with_ops_and_an_op_that_is_a_module():
    eqx = pytest.importorskip("equinox")
    x, y = _data()

    @jd.primitive
    class Leaky(eqx.Module):
        """max(x, slope x): the op's configuration is the module's field."""

        slope: float = 0.1

        @jd.abstract
        def shapes(self, v):
            return jax.ShapeDtypeStruct(v.shape, v.dtype)

        @jd.forward
        def apply(self, v):
            return np.where(v > 0, v, self.slope * v)

        @jd.vjp
        def pull(self, v, ct):
            return np.where(v > 0, ct, self.slope * ct)

    def leaky_twin(v, slope=0.1):
        return jnp.where(v > 0, v, slope * v)

    def run(tanh, matvec):
        leaky = Leaky() if tanh is OPS[0] else leaky_twin

        class Layer(eqx.Module):
            w: jax.Array
            v: jax.Array
            activation: object  # an op (its config static) or a function

            def __call__(self, row):
                return jnp.dot(self.v, self.activation(tanh(matvec(self.w, row))))

        model = Layer(jnp.eye(3) + 0.1, jnp.ones(3), leaky)
        loss = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)
        value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
        return model(x[0]), value, (grads.w, grads.v)

    assert_twins(run)

"""Ops that saved programs call (tests/test_export.py): a module of the user's own.

A process that loads a saved program imports this module and nothing else of
the tests: the program rebuilds its kernels from their recipes.
"""

import dataclasses

import jax
import numpy as np
import scipy.linalg

import jaxdecl as jd


@dataclasses.dataclass(frozen=True)
class Options:
    power: int
    label: str


class Weighted(jd.Primitive):
    """y = w * x**p: elementwise, its configuration an array and a dataclass."""

    def __init__(self, weights, options=Options(2, "weighted")):
        self.weights = np.asarray(weights)
        self.options = options

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(self.weights.astype(x.dtype), x ** self.options.power, out=out)

    @jd.vjp
    def pull(self, x, ct):
        p = self.options.power
        return np.conj(self.weights * p * x ** (p - 1)) * ct


class Scale(jd.Primitive, linear=True, sharding="i -> i"):
    """y = factor * x: linear, differentiated by its transpose."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return (self.factor * x).astype(x.dtype)

    @jd.transpose
    def back(self, ct):
        return (np.conj(self.factor) * ct).astype(ct.dtype)


class MatVec(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    """A @ x, split over rows or the contraction (partial sums added)."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        return a @ x

    @jd.vjp
    def pull(self, a, x, ct):
        return np.outer(ct, np.conj(x)), np.conj(a).T @ ct


class RowNorms(jd.Primitive, sharding="n k -> n", replicate=("k",)):
    """Per-row 2-norms squared: every row needs all its columns."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape[:1], x.dtype)

    @jd.forward
    def apply(self, x):
        return (x * x).sum(axis=1)

    @jd.vjp
    def pull(self, x, ct):
        return 2 * x * ct[:, None]


class Solve(jd.Primitive):
    """x = A^-1 b with the LU factors kept for the derivative (residuals)."""

    @jd.abstract
    def shapes(self, a, b):
        return jax.ShapeDtypeStruct(b.shape, b.dtype)

    @jd.residuals
    def keeps(self, a, b):
        return {"lu": jax.ShapeDtypeStruct(a.shape, a.dtype),
                "piv": jax.ShapeDtypeStruct(a.shape[:1], np.int32)}

    @jd.forward
    def apply(self, a, b, *, saved=None):
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            saved["lu"][...], saved["piv"][...] = lu, piv
        return scipy.linalg.lu_solve((lu, piv), b).astype(b.dtype)

    @jd.vjp
    def pull(self, a, b, ct, *, saved, result):
        lam = scipy.linalg.lu_solve((saved["lu"], saved["piv"]), ct, trans=1)
        return -np.outer(lam, result), lam


class Tree(jd.Primitive):
    """Saved state through __getstate__/__setstate__: a lookup table rebuilt on load."""

    def __init__(self, offsets):
        self.offsets = tuple(offsets)
        self.table = {i: float(o) for i, o in enumerate(offsets)}  # (derived state)

    def __getstate__(self):
        return {"offsets": self.offsets}

    def __setstate__(self, state):
        self.__init__(state["offsets"])

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x + np.array([self.table[i % len(self.table)] for i in range(x.shape[-1])],
                            dtype=x.dtype)

    @jd.vjp
    def pull(self, x, ct):
        return ct


class Wave(jd.Primitive, linear=("c",), sharding="i, i -> i"):
    """c * sin(x): linear in c (a @transpose), differentiable in x through a @jvp that
    takes None for a zero tangent and a @vjp that takes which cotangents are wanted."""

    @jd.abstract
    def shapes(self, x, c):
        return jax.ShapeDtypeStruct(c.shape, c.dtype)

    @jd.forward
    def apply(self, x, c):
        return c * np.sin(x)

    @jd.transpose
    def apply_t(self, x, ct):
        return np.sin(x) * ct

    @jd.jvp(zeros=True)
    def push(self, x, c, dx, dc):
        return (0 if dx is None else c * np.cos(x) * dx) + (0 if dc is None else np.sin(x) * dc)

    @jd.vjp
    def pull(self, x, c, ct, *, wanted):
        return (c * np.cos(x) * ct if wanted[0] else None), (np.sin(x) * ct if wanted[1] else None)


class Opaque(jd.Primitive):
    """Holds an object with no saved form: export refuses, naming the attribute."""

    def __init__(self):
        self.handle = object()

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x


# --- the programs, and their jax.numpy twins ----------------------------------------------

W = np.linspace(0.5, 2.0, 8)
A = np.eye(8) * 3 + np.arange(64.0).reshape(8, 8) / 100


def program(x, m):
    """Every kind of op in one function of a vector x (8,) and a matrix m (8, 4)."""
    y = Weighted(W)(x) + Scale(1.5)(x)
    y = Solve()(A, y)
    z = MatVec()(m, x[:4]) + RowNorms()(m)
    return jax.numpy.sum(y * z) + jax.numpy.sum(Tree((1.0, 2.0))(m) ** 2)


def twin(x, m):
    jnp = jax.numpy
    y = jnp.asarray(W) * x ** 2 + 1.5 * x
    y = jnp.linalg.solve(jnp.asarray(A), y)
    z = m @ x[:4] + (m * m).sum(axis=1)
    return jnp.sum(y * z) + jnp.sum((m + jnp.array([1.0, 2.0, 1.0, 2.0])) ** 2)


def derivatives(x, m):
    """A partly linear op's derivatives, each in one of its inputs: a vjp asked for one
    cotangent, a transpose, a jvp that carries one tangent."""
    c = m[:, 0]

    def loss(x, c):
        return jax.numpy.sum(Wave()(x, c) ** 2)

    return (jax.grad(loss, 0)(x, c), jax.grad(loss, 1)(x, c),
            jax.jvp(lambda x: Wave()(x, c), (x,), (x,))[1])


def derivatives_twin(x, m):
    c = m[:, 0]

    def loss(x, c):
        return jax.numpy.sum((c * jax.numpy.sin(x)) ** 2)

    return (jax.grad(loss, 0)(x, c), jax.grad(loss, 1)(x, c),
            jax.jvp(lambda x: c * jax.numpy.sin(x), (x,), (x,))[1])

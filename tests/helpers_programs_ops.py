"""The ops of the generated programs, their ``jax.numpy`` twins, and what a program uses.

Every generated program (``helpers_programs_draw.py``) is a script whose ``run(ops)``
builds inputs, applies ops from ``ops`` and transforms, and returns the result. It runs
twice, with ``OPS`` (jaxdecl ops) and with ``TWINS`` (classes with the same constructor
that compute the same function in ``jax.numpy``); ``compare`` then says how the two
results differ. A script imports this module, after setting ``XLA_FLAGS`` and
``jax_enable_x64`` itself:

    >>> op, twin = OPS.Quad(0.5), TWINS.Quad(0.5)
    >>> x = np.linspace(0.5, 1.5, 4)
    >>> compare(op(x), twin(x), specs=False, rtol=1e-10)
    []

The ops, one per way of declaring one (all with NumPy rules):

- ``Quad(c)``: x + c x², declared elementwise (``"... n -> ... n"``), its forward
  writing into ``out=``, vectorized over a ``vmap`` batch;
- ``Mul()``: x1 · x2², two inputs declared elementwise (the README's example);
- ``Tanh(c)``: tanh(c x), no sharding declaration (it runs once, on gathered inputs;
  under Explicit axes its result is typed like its input);
- ``SinRes()``: sin, keeping cos(x) as a residual (``@jd.residuals``, ``residuals=``);
- ``Scale(c)``: c · x, ``linear=True`` with a ``@transpose``;
- ``MatVec()``: ``sum(a * x, -1)``, ``multilinear=True``, ``reduce=("k",)``;
- ``CumSum()``: a cumulative sum along the last dim, linear, ``replicate=("n",)``;
- ``Wave()``: c · sin(x), partly linear (``linear=("c",)``, a NumPy ``@transpose``), its
  traceable ``@jvp(zeros=True)`` calling the op itself: every order of derivative;
- ``MulZ()``: x1 · x2² with a ``@jvp(zeros=True)`` and a ``@vjp`` taking ``wanted``
  (NumPy rules: each derivative carries only the tangents and cotangents it needs);
- ``Expm1(c)``: expm1(c x) through ``jd.pure_callback`` (``vmap_method="sequential"``),
  its derivative from a ``jax.custom_jvp`` whose tangent is a second callback's exp(c x)
  times the tangent, as ``jax.pure_callback`` users write it.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdecl as jd
from jaxdecl import _compat

__all__ = ["OPS", "TWINS", "AxisType", "P", "blend", "compare", "cotangent", "jax", "jnp",
           "make_mesh", "np", "place", "set_mesh", "tangent", "total", "values"]


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Quad(jd.Primitive, batch="vectorized", sharding="... n -> ... n"):
    def __init__(self, c=0.25):
        self.c = c

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, x, out=out)
        out *= self.c
        out += x

    @jd.jvp
    def push(self, x, dx):
        return (1 + 2 * self.c * x) * dx

    @jd.vjp
    def pull(self, x, ct):
        return (1 + 2 * self.c * x) * ct


class Mul(jd.Primitive, batch="vectorized", sharding="... n, ... n -> ... n"):
    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2, *, out):
        np.multiply(x1, x2 ** 2, out=out)

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        return x2 ** 2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2 ** 2 * ct, 2 * x1 * x2 * ct


class Tanh(jd.Primitive):
    def __init__(self, c=1.0):
        self.c = c

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return np.tanh(self.c * x)

    @jd.jvp
    def push(self, x, dx, *, result):
        return self.c * (1 - result ** 2) * dx

    @jd.vjp
    def pull(self, x, ct):
        return self.c * (1 - np.tanh(self.c * x) ** 2) * ct


class SinRes(jd.Primitive, sharding="... n -> ... n", residuals={"cos": "... n"}):
    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.residuals
    def keeps(self, x):
        return {"cos": _same(x)}

    @jd.forward
    def apply(self, x, *, saved=None):
        if saved is not None:
            saved["cos"][...] = np.cos(x)
        return np.sin(x)

    @jd.jvp
    def push(self, x, dx, *, saved):
        return saved["cos"] * dx

    @jd.vjp
    def pull(self, x, ct, *, saved):
        return saved["cos"] * ct


class Scale(jd.Primitive, linear=True, batch="vectorized", sharding="... n -> ... n"):
    def __init__(self, c=2.0):
        self.c = c

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, self.c, out=out)

    @jd.transpose
    def apply_t(self, ct):
        return self.c * ct


class MatVec(jd.Primitive, multilinear=True, sharding="b k, k -> b", reduce=("k",)):
    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        return a @ x

    @jd.transpose(wrt="a")
    def t_a(self, x, ct):
        return np.outer(ct, x)

    @jd.transpose(wrt="x")
    def t_x(self, a, ct):
        return a.T @ ct


class CumSum(jd.Primitive, linear=True, sharding="... n -> ... n", replicate=("n",)):
    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return np.cumsum(x, axis=-1)

    @jd.transpose
    def apply_t(self, ct):
        return np.cumsum(ct[..., ::-1], axis=-1)[..., ::-1]


class Wave(jd.Primitive, linear=("c",), batch="vectorized", sharding="... n, ... n -> ... n"):
    @jd.abstract
    def shapes(self, x, c):
        return _same(c)

    @jd.forward
    def apply(self, x, c):
        return (c * np.sin(x)).astype(c.dtype)

    @jd.transpose
    def apply_t(self, x, ct):
        return (np.sin(x) * ct).astype(ct.dtype)

    @jd.jvp(zeros=True, traceable=True)
    def push(self, x, c, dx, dc):
        out = None if dx is None else self(x + np.pi / 2, c * dx)  # c cos(x) dx
        if dc is not None:
            out = self(x, dc) if out is None else out + self(x, dc)
        return out


class MulZ(jd.Primitive, sharding="... n, ... n -> ... n"):
    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2 ** 2

    @jd.jvp(zeros=True)
    def push(self, x1, x2, dx1, dx2):
        out = np.zeros_like(x1)
        if dx1 is not None:
            out += x2 ** 2 * dx1
        if dx2 is not None:
            out += 2 * x1 * x2 * dx2
        return out

    @jd.vjp
    def pull(self, x1, x2, ct, *, wanted):
        return (x2 ** 2 * ct if wanted[0] else None), (2 * x1 * x2 * ct if wanted[1] else None)


def _np_expm1(x, c):
    return np.expm1(c * x)


def _np_exp(x, c):
    return np.exp(c * x)


def _callback_expm1(c):
    @jax.custom_jvp
    def expm1(x):
        return jd.pure_callback(_np_expm1, _same(x), x, np.asarray(c, x.dtype),
                                vmap_method="sequential")

    @expm1.defjvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        grow = jd.pure_callback(_np_exp, _same(x), x, np.asarray(c, x.dtype),
                                vmap_method="sequential")
        return expm1(x), c * grow * dx

    return expm1


class Expm1:
    """Not a class of jaxdecl's: a function calling ``jd.pure_callback``."""

    def __init__(self, c=0.5):
        self.c = c
        self._call = _callback_expm1(c)

    def __call__(self, x):
        return self._call(x)


class _Twin:
    """A jax.numpy twin: the op's constructor, and ``__call__`` computing its function."""

    def __init__(self, *config):
        self.config = config


class QuadTwin(_Twin):
    def __call__(self, x):
        c = self.config[0] if self.config else 0.25
        return x + c * x * x


class MulTwin(_Twin):
    def __call__(self, x1, x2):
        return x1 * x2 ** 2


class TanhTwin(_Twin):
    def __call__(self, x):
        return jnp.tanh((self.config[0] if self.config else 1.0) * x)


class SinResTwin(_Twin):
    def __call__(self, x):
        return jnp.sin(x)


class ScaleTwin(_Twin):
    def __call__(self, x):
        return (self.config[0] if self.config else 2.0) * x


class MatVecTwin(_Twin):
    # Not a @ x: over Explicit axes JAX refuses a contraction along a sharded dim.
    def __call__(self, a, x):
        return jnp.sum(a * x, axis=-1)


class CumSumTwin(_Twin):
    def __call__(self, x):
        return jnp.cumsum(x, axis=-1)


class WaveTwin(_Twin):
    def __call__(self, x, c):
        return c * jnp.sin(x)


class Expm1Twin(_Twin):
    def __call__(self, x):
        return jnp.expm1((self.config[0] if self.config else 0.5) * x)


OPS = types.SimpleNamespace(Quad=Quad, Mul=Mul, Tanh=Tanh, SinRes=SinRes, Scale=Scale,
                            MatVec=MatVec, CumSum=CumSum, Wave=Wave, MulZ=MulZ, Expm1=Expm1)
TWINS = types.SimpleNamespace(Quad=QuadTwin, Mul=MulTwin, Tanh=TanhTwin, SinRes=SinResTwin,
                              Scale=ScaleTwin, MatVec=MatVecTwin, CumSum=CumSumTwin,
                              Wave=WaveTwin, MulZ=MulTwin, Expm1=Expm1Twin)


# ---------------------------------------------------------------------------------------
# What a program's script uses
# ---------------------------------------------------------------------------------------

def set_mesh(mesh):
    """``jax.set_mesh(mesh)``; ``jax.sharding.use_mesh`` on JAX 0.6, which has no set_mesh."""
    setter = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    return setter(mesh)


def make_mesh(name: str, axis_type: str):
    """The (4,) mesh "d" (``name="1d"``) or the (2, 2) mesh "x", "y" (``"2d"``)."""
    kind = getattr(AxisType, axis_type)
    if name == "1d":
        return jax.make_mesh((4,), ("d",), axis_types=(kind,))
    return jax.make_mesh((2, 2), ("x", "y"), axis_types=(kind, kind))


def values(rng, shape, dtype):
    """Values in [0.5, 1.5] (plus an imaginary part in [-0.5, 0.5] if complex)."""
    value = rng.uniform(0.5, 1.5, shape)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        value = value + 1j * rng.uniform(-0.5, 0.5, shape)
    return np.asarray(value).astype(dtype)


def place(value, mesh, spec):
    """`value` laid out over `mesh` as `spec`, or on the default device if `spec` is None."""
    if spec is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def total(out):
    """A real scalar of a result: the sum of the real parts of all its leaves."""
    return sum(jnp.real(leaf).sum() for leaf in jax.tree.leaves(out))


def tangent(x):
    """The tangent a jvp or linearize pushes for input `x` (laid out as `x`)."""
    return jnp.cos(x)


def cotangent(out):
    """The cotangent a vjp pulls back for a result (laid out as the result)."""
    return jax.tree.map(jnp.cos, out)


def blend(carry, out):
    """A scan step's next carry: mixed with the step's first result where that has the
    carry's shape and dtype (so the op's result flows into the next step), squashed to
    stay bounded for complex values too."""
    leaf = jax.tree.leaves(out)[0]
    if leaf.shape != carry.shape or leaf.dtype != carry.dtype:
        return 0.9 * carry
    want = jax.typeof(carry).sharding
    if jax.typeof(leaf).sharding.spec != want.spec:
        # Under Explicit axes a scan's carry keeps its type: reshard as a user would.
        leaf = _compat.reshard(leaf, want)  # jax.sharding.reshard, on every JAX
    return 0.5 * carry + 0.25 * leaf / (1 + jnp.abs(leaf))


# ---------------------------------------------------------------------------------------
# Comparing a program's result with its twin's
# ---------------------------------------------------------------------------------------

def _spec_tuple(spec, ndim) -> tuple:
    entries = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        if isinstance(entry, (tuple, list)):
            entry = tuple(entry) if len(entry) > 1 else entry[0] if entry else None
        entries.append(entry)
    return tuple(entries)


def _devices(leaf):
    sharding = getattr(leaf, "sharding", None)
    return None if sharding is None else set(sharding.device_set)


def _unplaced_like(leaf, want) -> bool:
    """`leaf` is uncommitted on one device where `want` is replicated over a mesh.

    JAX leaves the gradient of a residual-free linear map there too
    (``jax.grad(lambda a: jnp.sum(-a))(a)`` of a replicated ``a``); a twin that
    lands on the mesh owes it to a constant JAX placed there as a residual
    (``2.0 * a``). Both are the whole value, placed nowhere in particular.
    """
    spec = getattr(getattr(want, "sharding", None), "spec", None)
    return (isinstance(leaf, jax.Array) and not leaf.committed
            and len(leaf.sharding.device_set) == 1
            and spec is not None and all(entry is None for entry in spec))


def _gathered(leaf):
    """The whole value of a result, also one that spans several processes."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


#: Magnitudes beyond this (or inf/nan) in a twin's results: the program overflows.
LARGEST = 1e30


def out_of_range(expected) -> bool:
    """The twin's results are not finite or beyond :data:`LARGEST`."""
    for leaf in jax.tree.leaves(expected):
        value = np.abs(_gathered(leaf))
        if value.size and (not np.all(np.isfinite(value)) or float(value.max()) > LARGEST):
            return True
    return False


def compare(out, expected, *, specs: bool, rtol: float = 1e-10, untyped=()) -> list:
    """How `out` differs from its twin's `expected` (empty: it does not).

    Values to `rtol` (1e-4 where a float32 input enters: its rounding reaches float64
    results too), relative to the largest expected magnitude; the devices each result
    lives on; with ``specs``, each result's sharding type (Explicit axes:
    ``jax.typeof(leaf).sharding.spec``), except for results shaped like an input on no
    mesh (`untyped` shapes: its cotangent has no type to follow).
    """
    out_leaves, out_tree = jax.tree.flatten(out)
    exp_leaves, exp_tree = jax.tree.flatten(expected)
    if out_tree != exp_tree:
        return [f"structure {out_tree} != {exp_tree}"]
    problems = []
    for k, (leaf, want) in enumerate(zip(out_leaves, exp_leaves)):
        got, wanted = _gathered(leaf), _gathered(want)
        if got.shape != wanted.shape or got.dtype != wanted.dtype:
            problems.append(f"leaf {k}: {got.dtype}{list(got.shape)} != "
                            f"{wanted.dtype}{list(wanted.shape)}")
            continue
        tol = max(rtol, 1e-4 if wanted.dtype in (np.float32, np.complex64) else 0.0)
        finite = np.abs(wanted[np.isfinite(wanted)])
        scale = 1.0 + (float(np.max(finite)) if finite.size else 0.0)
        if not np.allclose(got, wanted, rtol=tol, atol=tol * scale, equal_nan=True):
            error = np.abs(got - wanted)
            error = float(np.max(np.where(np.isnan(error), np.inf, error)))
            problems.append(f"leaf {k}: values differ by up to {error:.3g} (scale {scale:.3g})")
        mine, theirs = _devices(leaf), _devices(want)
        if mine is not None and theirs is not None and mine != theirs and \
                not _unplaced_like(leaf, want):
            problems.append(f"leaf {k}: on {len(mine)} device(s), the twin's on {len(theirs)}")
        if specs and tuple(got.shape) not in untyped:
            typed, twin = jax.typeof(leaf).sharding.spec, jax.typeof(want).sharding.spec
            if _spec_tuple(typed, got.ndim) != _spec_tuple(twin, got.ndim):
                problems.append(f"leaf {k}: type {jax.typeof(leaf)}, the twin's "
                                f"{jax.typeof(want)}")
    return problems

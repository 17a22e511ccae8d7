"""The sharding matrix's cells, run in a fresh interpreter with 4 host CPU devices.

Run as ``python helpers_sharding_matrix.py MODE CELLS [PORT PROCESS]``, CELLS a
comma-separated list of ``KIND/TRANSFORM`` names; prints one JSON line ``{"checks":
{cell: true | "what was seen"}}``. One process computes all the cells of a mode, so
JAX's import and start-up are paid once per mode (``tests/test_sharding_matrix.py``).

A cell applies one transform (``build``) to one op kind (``KINDS``) under one mode
(``MODES``: a mesh and a way of running on it) and checks, leaf by leaf:

1. the values of every addressable shard against the same transform of the kind's
   pure ``jax.numpy`` reference, run unsharded on one device;
2. the result's sharding: under Explicit axes its type's spec
   (``jax.typeof(out).sharding.spec``), which the kind declares (for ``hessian``: the
   type JAX's own ops give the reference); under Auto axes and in ``shard_map``, that
   the result is laid out over the mesh, and as the kind declares where it runs per
   shard;
3. where the op runs per shard (a declared op whose inputs are split only along
   factors it may split, or any op inside a ``shard_map`` over every mesh axis): no
   ``all-gather`` and no ``all-to-all`` in the compiled HLO; for the forward, that each
   device's rule call saw its own block (an undeclared op: one call, whole) and which
   lowering jit chose (``Kind.lowering``).

A cell that cannot be done (the ``hessian`` of an op whose rules are NumPy
functions; on JAX < 0.9, adding up partial results over Explicit axes) must fail
with an error that names the op and the fix, under ``jit`` before any rule runs; the
cell then checks that error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable

# 4 devices in one process; 2 in each of the two processes of the `processes` mode.
_DEVICES = os.environ.get("JAXDECL_TEST_DEVICES", "4")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ops import random_array  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl import _compat  # noqa: E402

CALLS: list = []  # (rule, shape of its first operand) per forward call of an op below


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------------------
# Op kinds: small ops with NumPy rules (or traceable ones), each with a jax.numpy twin
# ---------------------------------------------------------------------------------------

class Cube(jd.Primitive, batch="vectorized", sharding="b n -> b n"):
    """x**3, elementwise over both dims: at 8 x 16 on 4 devices the fast (batch
    partitioner) lowering; with a size-1 dim or 6 rows, the partitioning callback."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        CALLS.append(("forward", x.shape))
        return x ** 3

    @jd.jvp
    def push(self, x, dx):
        return 3 * x ** 2 * dx

    @jd.vjp
    def pull(self, x, ct):
        return 3 * x ** 2 * ct


class Plain(jd.Primitive):
    """Cube without a sharding declaration: it runs once, on gathered inputs."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        CALLS.append(("forward", x.shape))
        return x ** 3

    @jd.jvp
    def push(self, x, dx):
        return 3 * x ** 2 * dx

    @jd.vjp
    def pull(self, x, ct):
        return 3 * x ** 2 * ct


class Sin(jd.Primitive, sharding="b n -> b n"):
    """sin, whose traceable @jvp calls Cos (another declared op): every order of
    derivative binds declared ops, so second derivatives run per shard too. Its rules
    loop over a vmap batch (the default batch="loop"), which the batch partitioner
    cannot split: vmapped, it takes the callback lowering."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        CALLS.append(("forward", x.shape))
        return np.sin(x)

    @jd.jvp(traceable=True)
    def push(self, x, dx):
        return Cos()(x) * dx


class Cos(jd.Primitive, sharding="b n -> b n"):
    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return np.cos(x)

    @jd.jvp(traceable=True)
    def push(self, x, dx):
        return -Sin()(x) * dx


class RowFFT(jd.Primitive, linear=True, batch="vectorized", sharding="b n -> b n",
             replicate=("n",)):
    """The DFT of each row: rows independent, each row needed whole (callback lowering)."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        CALLS.append(("forward", x.shape))
        return np.fft.fft(x, axis=-1)

    @jd.transpose
    def apply_t(self, ct):  # the DFT matrix is symmetric
        return np.fft.fft(ct, axis=-1)


class MatVec(jd.Primitive, multilinear=True, sharding="b k, k -> b", reduce=("k",)):
    """a @ x, linear in each input: partial sums over k are added across devices."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        CALLS.append(("forward", a.shape))
        return a @ x

    @jd.transpose(wrt="a")
    def t_a(self, x, ct):
        return np.outer(ct, x)

    @jd.transpose(wrt="x")
    def t_x(self, a, ct):
        return a.T @ ct


class Affine(jd.Primitive, batch="vectorized", sharding="b n, b n -> b n"):
    """x and a dict {"w", "c"} in, a dict {"y": x * w + c, "z": x * x} out."""

    @jd.abstract
    def shapes(self, x, p):
        return {"y": _same(x), "z": _same(x)}

    @jd.forward
    def apply(self, x, p):
        CALLS.append(("forward", x.shape))
        return {"y": x * p["w"] + p["c"], "z": x * x}

    @jd.jvp
    def push(self, x, p, dx, dp):
        return {"y": dx * p["w"] + x * dp["w"] + dp["c"], "z": 2 * x * dx}

    @jd.vjp
    def pull(self, x, p, ct):
        return ct["y"] * p["w"] + 2 * x * ct["z"], {"w": x * ct["y"], "c": ct["y"]}


class RowScale(jd.Primitive, batch="vectorized", sharding="b n, b -> b n"):
    """x**2 * k per row, with an integer k (no tangent, no cotangent)."""

    @jd.abstract
    def shapes(self, x, k):
        return _same(x)

    @jd.forward
    def apply(self, x, k):
        CALLS.append(("forward", x.shape))
        return (x ** 2 * k[..., None]).astype(x.dtype)

    @jd.jvp
    def push(self, x, k, dx):
        return (2 * x * k[..., None] * dx).astype(x.dtype)

    @jd.vjp
    def pull(self, x, k, ct):
        return (2 * x * k[..., None] * ct).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Kind:
    """One op kind: the op, its reference, example inputs and how they are split."""

    op: Callable
    ref: Callable
    args: Callable  # rng -> tuple of inputs (NumPy arrays or dicts of them)
    specs: dict  # mesh name -> per input, a PartitionSpec (a dict of them for a dict)
    out_spec: dict  # mesh name -> the result's PartitionSpec(s), as the kind declares
    diff: tuple = (0,)  # positions of the differentiable inputs
    # Declared, and its inputs split only along factors it may split. An undeclared op
    # runs once on whole values (per block, inside a shard_map); under Explicit axes its
    # results are typed like the input of their shape.
    splits: bool = True
    linear: str = ""  # "linear" or "multilinear": linear_transpose applies
    holomorphic: bool = False  # complex inputs: hessian of a holomorphic loss
    summed: dict = dataclasses.field(default_factory=dict)  # mesh -> axes splitting reduce=
    # Words of the error a hessian must raise (its type first); () when hessians work.
    second_order: tuple = ()
    # How jit lowers the forward on several devices under Auto axes: "split" (one call
    # that XLA's batch partitioner splits) or "callback" (custom_partitioning).
    lowering: str = "callback"


def _numpy_rules(name: str) -> tuple:
    """A hessian of an op whose rules are NumPy functions: the error names it and the fix."""
    return ("MissingRuleError", name, "traceable=True")


def _cube_kind(shape, dtype, specs, lowering="callback"):
    return Kind(Cube(), lambda x: x ** 3, lambda rng: (random_array(rng, shape, dtype),),
                {m: (s,) for m, s in specs.items()}, specs,
                second_order=_numpy_rules("Cube"), lowering=lowering)


KINDS = {
    # elementwise, fast lowering (every dim divides the 4 devices)
    "elementwise": _cube_kind((8, 16), "float32", {"1d": P("d"), "2d": P("x", "y")},
                              lowering="split"),
    # elementwise with traceable rules that bind declared ops: hessian per shard
    "traceable": Kind(
        Sin(), jnp.sin, lambda rng: (random_array(rng, (8, 16), "float64"),),
        {"1d": (P(None, "d"),), "2d": (P("y", "x"),)}, {"1d": P(None, "d"), "2d": P("y", "x")},
        lowering="split"),
    "undeclared": Kind(
        Plain(), lambda x: x ** 3, lambda rng: (random_array(rng, (8, 16), "float64"),),
        {"1d": (P("d"),), "2d": (P("x", "y"),)}, {"1d": P("d"), "2d": P("x", "y")},
        splits=False, second_order=_numpy_rules("Plain")),
    # rows over both axes of the 2-D mesh (one spec entry naming two axes)
    "replicate": Kind(
        RowFFT(), lambda x: jnp.fft.fft(x, axis=-1),
        lambda rng: (random_array(rng, (8, 16), "complex128"),),
        {"1d": (P("d"),), "2d": (P(("x", "y")),)}, {"1d": P("d"), "2d": P(("x", "y"))},
        linear="linear", holomorphic=True),
    "reduce": Kind(
        # (not a @ x: under Explicit axes JAX refuses a contraction over a sharded dim)
        MatVec(), lambda a, x: jnp.sum(a * x, axis=-1),
        lambda rng: (random_array(rng, (8, 12), "float64"), random_array(rng, (12,), "float64")),
        {"1d": (P(None, "d"), P("d")), "2d": (P("x", "y"), P("y"))},
        {"1d": P(), "2d": P("x")}, diff=(0, 1), linear="multilinear",
        summed={"1d": ("d",), "2d": ("y",)}),
    "pytree": Kind(
        Affine(), lambda x, p: {"y": x * p["w"] + p["c"], "z": x * x},
        lambda rng: (random_array(rng, (8, 16), "float64"),
                     {"w": random_array(rng, (8, 16), "float64"),
                      "c": random_array(rng, (8, 16), "float64")}),
        {"1d": (P("d"), {"w": P("d"), "c": P("d")}),
         "2d": (P("x", "y"), {"w": P("x", "y"), "c": P("x", "y")})},
        {"1d": {"y": P("d"), "z": P("d")}, "2d": {"y": P("x", "y"), "z": P("x", "y")}},
        diff=(0, 1), second_order=_numpy_rules("Affine"), lowering="split"),
    "nondiff": Kind(
        RowScale(), lambda x, k: (x ** 2 * k[:, None]).astype(x.dtype),
        lambda rng: (random_array(rng, (8, 16), "float64"),
                     rng.integers(-3, 4, 8).astype(np.int32)),
        {"1d": (P("d"), P("d")), "2d": (P("x", "y"), P("x"))},
        {"1d": P("d"), "2d": P("x", "y")},
        second_order=_numpy_rules("RowScale")),
    # 6 rows: split over "x" of the 2-D mesh, whole on the 1-D one (the callback lowering)
    "uneven": _cube_kind((6, 16), "float64", {"1d": P(None, "d"), "2d": P("x", "y")}),
    "size1": _cube_kind((1, 16), "float32", {"1d": P(None, "d"), "2d": P(None, ("x", "y"))}),
}


# ---------------------------------------------------------------------------------------
# Transforms: each turns f (the op or its reference) into a function of flat inputs
# ---------------------------------------------------------------------------------------

def _is_spec(s) -> bool:
    return isinstance(s, P)


def _loss(out):
    """Σ|o|² over the result's leaves: a real scalar."""
    return sum(jnp.sum(jnp.real(o * jnp.conj(o))) for o in jax.tree.leaves(out))


def _cube_sum(out):
    """Σ o³ over the result's leaves: holomorphic (for complex hessians), and with a
    hessian that depends on the input even for a linear op."""
    return sum(jnp.sum(o * o * o) for o in jax.tree.leaves(out))


def _with(args, diff, values):
    full = list(args)
    for i, v in zip(diff, values):
        full[i] = v
    return full


@dataclasses.dataclass
class Built:
    """A transform of f, its inputs (NumPy) and their specs, and the result's specs."""

    fn: Callable
    inputs: tuple
    in_specs: tuple
    out_spec: object  # pytree of PartitionSpecs, or None where the kind cannot say
    inside: bool = False  # under shard_map: transform the block function (vmap, scan, cond)


def _drop_axis(spec_tree, axis):
    """Every PartitionSpec in the tree without mesh axis `axis` (which a batch dim takes)."""

    def drop(spec):
        entries = []
        for entry in spec:
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            kept = tuple(a for a in axes if a != axis)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return P(*entries)

    return jax.tree.map(drop, spec_tree, is_leaf=_is_spec)


def _lead(spec_tree, entry):
    return jax.tree.map(lambda s: P(entry, *s), spec_tree, is_leaf=_is_spec)


def _batch_axis(mesh_name: str) -> str:
    """The mesh axis that splits the batch of the `vmap` transform."""
    return "d" if mesh_name == "1d" else "x"


def build(transform: str, kind: Kind, f, mesh_name: str, rng, blocks: bool = False) -> Built:
    """The cell's function of `f`; `blocks`: f runs on blocks, under shard_map."""
    args = kind.args(rng)
    specs, out_spec = kind.specs[mesh_name], kind.out_spec[mesh_name]
    n, diff = len(args), kind.diff
    diff_specs = tuple(specs[i] for i in diff)
    out_struct = jax.eval_shape(kind.ref, *args)

    def tangents():
        return tuple(jax.tree.map(lambda a: random_array(rng, np.shape(a), np.result_type(a)),
                                  args[i]) for i in diff)

    def cotangent():
        return jax.tree.map(lambda s: random_array(rng, s.shape, s.dtype), out_struct)

    def of_diff(full):  # f as a function of the differentiable inputs
        return lambda *d: f(*_with(full, diff, d))

    if transform == "forward":
        return Built(f, args, specs, out_spec)
    if transform == "jvp":
        def jvp(*a):
            return jax.jvp(of_diff(a[:n]), [a[i] for i in diff], list(a[n:]))
        return Built(jvp, args + tangents(), specs + diff_specs, (out_spec, out_spec))
    if transform == "linearize":
        def linearized(*a):
            return jax.linearize(of_diff(a[:n]), *[a[i] for i in diff])[1](*a[n:])
        return Built(linearized, args + tangents(), specs + diff_specs, out_spec)
    if transform == "vjp":
        def vjp(*a):
            out, pull = jax.vjp(of_diff(a[:n]), *[a[i] for i in diff])
            return out, pull(a[n])
        return Built(vjp, args + (cotangent(),), specs + (out_spec,), (out_spec, diff_specs))
    if transform in ("grad", "checkpoint"):
        g = jax.checkpoint(f) if transform == "checkpoint" else f

        def grad(*a):
            loss = lambda *d: _loss(g(*_with(a, diff, d)))
            return jax.grad(loss, argnums=tuple(range(len(diff))))(*[a[i] for i in diff])
        return Built(grad, args, specs, diff_specs)
    if transform == "linear_transpose":
        # A linear op: with respect to all its inputs; a multilinear one: to the last.
        wrt = diff if kind.linear == "linear" else diff[-1:]

        def transposed(*a):
            return jax.linear_transpose(lambda *d: f(*_with(a[:n], wrt, d)),
                                        *[a[i] for i in wrt])(a[n])
        return Built(transposed, args + (cotangent(),), specs + (out_spec,),
                     tuple(specs[i] for i in wrt))
    if transform == "hessian":
        first = diff[0]

        def hessian(*a):
            return jax.hessian(lambda v: _cube_sum(f(*_with(a, (first,), (v,)))),
                               holomorphic=kind.holomorphic)(a[first])
        return Built(hessian, args, specs, None)
    if transform == "vmap":
        # A batch of 4 split over the first mesh axis; the inputs' other splits keep
        # the remaining axes.
        axis = _batch_axis(mesh_name)
        batched = tuple(jax.tree.map(lambda a: np.stack([a + k for k in range(4)]), x)
                        for x in args)
        return Built(jax.vmap(f), batched, _lead(_drop_axis(specs, axis), axis),
                     _lead(_drop_axis(out_spec, axis), axis), inside=True)
    if transform == "scan":
        stacked = tuple(jax.tree.map(lambda a: np.stack([a, a + 1]), x) for x in args)

        def scanned(*a):
            return lax.scan(lambda carry, x: (carry, f(*x)), 0, a)[1]
        return Built(scanned, stacked, _lead(specs, None), _lead(out_spec, None), inside=True)
    if transform == "cond":
        def branches(p, *a):
            negated = lambda *b: jax.tree.map(jnp.negative, f(*b))
            return lax.cond(p, f, negated, *a), lax.cond(jnp.logical_not(p), f, negated, *a)
        return Built(branches, (np.bool_(True),) + args, (P(),) + specs, (out_spec, out_spec),
                     inside=True)
    raise ValueError(f"unknown transform {transform!r}")


# ---------------------------------------------------------------------------------------
# Modes: a mesh and a way of running on it
# ---------------------------------------------------------------------------------------

def _mesh(name: str, axis_type):
    if name == "1d":
        return jax.make_mesh((4,), ("d",), axis_types=(axis_type,))
    return jax.make_mesh((2, 2), ("x", "y"), axis_types=(axis_type, axis_type))


def _place(mesh, inputs, specs):
    def put(spec, value):
        return jax.tree.map(
            lambda v: jax.make_array_from_callback(
                np.shape(v), NamedSharding(mesh, spec), lambda index: np.asarray(v)[index]),
            value)

    return tuple(jax.tree.map(put, s, v, is_leaf=_is_spec) for s, v in zip(specs, inputs))


def _manual_only(spec_tree, manual):
    """The specs restricted to the manual mesh axes (a partial shard_map's in/out specs)."""
    for axis in {"d", "x", "y"} - set(manual):
        spec_tree = _drop_axis(spec_tree, axis)
    return spec_tree


@dataclasses.dataclass(frozen=True)
class Mode:
    mesh: str  # "1d" or "2d"
    axis_type: str  # "Auto" or "Explicit"
    jit: bool = True
    manual: tuple | None = None  # shard_map over these mesh axes (None: no shard_map)
    split_free: bool = True  # inputs split along the mesh axes a shard_map leaves Auto too


MODES = {
    "auto-1d": Mode("1d", "Auto"),
    "auto-2d": Mode("2d", "Auto"),
    "explicit-1d": Mode("1d", "Explicit"),
    "explicit-2d": Mode("2d", "Explicit"),
    "explicit_eager-1d": Mode("1d", "Explicit", jit=False),
    "explicit_eager-2d": Mode("2d", "Explicit", jit=False),
    "shard_map-1d": Mode("1d", "Auto", manual=("d",)),
    "shard_map-2d": Mode("2d", "Auto", manual=("x", "y")),
    "partial-2d": Mode("2d", "Auto", manual=("x",), split_free=False),
    "partial_free-2d": Mode("2d", "Auto", manual=("x",)),
    "processes-1d": Mode("1d", "Auto"),
}


def _summed(kind: Kind, mode: Mode, transform: str) -> tuple:
    """The mesh axes over which the op's partial results are added up (under vmap the
    batch takes the axis that would split the sum)."""
    return tuple(a for a in kind.summed.get(mode.mesh, ())
                 if not (transform == "vmap" and a == _batch_axis(mode.mesh)))


def _under_shard_map(mode: Mode, kind: Kind, mesh, transform: str, f) -> Built:
    """The cell's function with `f` (the op or its reference) inside ``jax.shard_map``.

    The block function adds up a reduce= op's partial results over the manual axes
    that split its sum. Transforms of the block (vmap, scan, cond) run inside the
    shard_map; derivatives differentiate through it from outside.
    """
    manual = mode.manual
    axes = tuple(a for a in _summed(kind, mode, transform) if a in manual)
    names = {"axis_names": set(manual)} if manual != tuple(mesh.axis_names) else {}
    block = (lambda *a: jax.lax.psum(f(*a), axes)) if axes else f

    def mapped(fn, in_specs, out_spec):
        return jax.shard_map(fn, mesh=mesh, in_specs=_manual_only(in_specs, manual),
                             out_specs=_manual_only(out_spec, manual), **names)

    inner = build(transform, kind, block, mode.mesh, np.random.default_rng(0), blocks=True)
    if inner.inside:
        built = dataclasses.replace(inner, fn=mapped(inner.fn, inner.in_specs, inner.out_spec))
    else:
        whole = mapped(block, kind.specs[mode.mesh], kind.out_spec[mode.mesh])
        built = build(transform, kind, whole, mode.mesh, np.random.default_rng(0), blocks=True)
    if not mode.split_free:  # inputs and results split along the manual axes only
        built.in_specs = _manual_only(built.in_specs, manual)
        built.out_spec = _manual_only(built.out_spec, manual)
    return built


def _spec_tuple(spec, ndim):
    entries = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        if isinstance(entry, (tuple, list)) and len(entry) == 1:
            entry = entry[0]
        entries.append(tuple(entry) if isinstance(entry, list) else entry)
    return tuple(entries)


def _local_shape(shape, spec, mesh):
    sizes = dict(mesh.shape)
    out = []
    for n, entry in zip(shape, _spec_tuple(spec, len(shape))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.append(n // math.prod(sizes[a] for a in axes))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------

def _tolerance(dtype) -> float:
    return 1e-4 if np.dtype(dtype) in (np.float32, np.complex64) else 1e-10


def _compare_values(out, expected) -> list:
    problems = []
    out_leaves, out_tree = jax.tree.flatten(out)
    exp_leaves, exp_tree = jax.tree.flatten(expected)
    if out_tree != exp_tree:
        return [f"structure {out_tree} != {exp_tree}"]
    for k, (a, e) in enumerate(zip(out_leaves, exp_leaves)):
        e = np.asarray(e)
        if tuple(a.shape) != e.shape or a.dtype != e.dtype:
            problems.append(f"leaf {k}: {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}")
            continue
        tol = _tolerance(e.dtype)
        for shard in a.addressable_shards:
            got, want = np.asarray(shard.data), e[shard.index]
            if not np.allclose(got, want, rtol=tol, atol=tol):
                error = float(np.max(np.abs(got - want))) if got.shape == want.shape else "shape"
                problems.append(f"leaf {k} shard {shard.index}: max error {error}")
                break
    return problems


def _compare_shardings(out, want, mesh, explicit: bool) -> list:
    """Explicit: each result type's spec is `want`'s; else each result is over the mesh
    (and has `want`'s spec where the kind says)."""
    problems = []
    leaves = jax.tree.leaves(out)
    wanted = [None] * len(leaves) if want is None else jax.tree.leaves(want, is_leaf=_is_spec)
    if len(wanted) != len(leaves):
        return [f"{len(leaves)} results for {len(wanted)} specs"]
    devices = set(mesh.devices.flat)
    for k, (leaf, spec) in enumerate(zip(leaves, wanted)):
        if explicit:
            typed = jax.typeof(leaf).sharding.spec
            if spec is not None and _spec_tuple(typed, leaf.ndim) != _spec_tuple(spec, leaf.ndim):
                problems.append(f"leaf {k}: type {jax.typeof(leaf)}, expected spec {spec}")
            continue
        sharding = leaf.sharding
        if set(sharding.device_set) != devices:
            problems.append(f"leaf {k}: on {len(sharding.device_set)} devices, not the mesh's")
        elif spec is not None and _spec_tuple(sharding.spec, leaf.ndim) != \
                _spec_tuple(spec, leaf.ndim):
            problems.append(f"leaf {k}: sharding {sharding.spec}, expected {spec}")
    return problems


def _gathers(text: str) -> list:
    return [w for w in ("all-gather", "all-to-all") if w in text]


def _expect_error(words: tuple, run, traced: bool) -> list:
    """The cell must raise an error whose type and message have `words` (the error's
    type first); if `traced`, before any rule runs."""
    CALLS.clear()
    try:
        run()
    except Exception as error:  # noqa: BLE001 - reported to the test
        text = f"{type(error).__name__}: {error}"
        missing = [w for w in words if w not in text]
        problems = [f"error lacks {missing}: {text[:400]}"] if missing else []
        if traced and CALLS:
            problems.append(f"rules ran before the error: {CALLS[:3]}")
        return problems
    return ["no error"]


def run_cell(mode: Mode, kind_name: str, transform: str, mesh) -> list:
    """The problems found in one cell (empty: it passed)."""
    kind = KINDS[kind_name]
    explicit = mode.axis_type == "Explicit"
    if mode.manual is not None:
        built = _under_shard_map(mode, kind, mesh, transform, kind.op)
        ref_fn = _under_shard_map(mode, kind, mesh, transform, kind.ref).fn
    else:
        built = build(transform, kind, kind.op, mode.mesh, np.random.default_rng(0))
        ref_fn = build(transform, kind, kind.ref, mode.mesh, np.random.default_rng(0)).fn
    fn = jax.jit(built.fn) if mode.jit else built.fn
    context = jax.set_mesh(mesh) if explicit else contextlib.nullcontext()
    error = ()
    if explicit and _summed(kind, mode, transform) and not _compat.EXPLICIT_REDUCTIONS:
        # Adding up partial results over Explicit axes needs JAX >= 0.9.
        error = ("ShardingTypeError", type(kind.op).__name__, "JAX >= 0.9", "Reshard")
    elif transform == "hessian":
        error = kind.second_order
    if error:
        with context:
            placed = _place(mesh, built.inputs, built.in_specs)
            if mode.jit:  # traced before it runs: no rule may run before the error
                return _expect_error(error, lambda: fn.lower(*placed), traced=True)
            # op by op, the forward (and its first derivative) may run first
            return _expect_error(error, lambda: fn(*placed), traced=False)

    # The reference: the same transform of the jax.numpy twin, unsharded on one device.
    unsharded = build(transform, kind, kind.ref, mode.mesh, np.random.default_rng(0))
    expected = jax.device_get(jax.jit(unsharded.fn)(*unsharded.inputs))
    # Per-shard work: a declared op, or any op on the blocks of a shard_map over every
    # mesh axis. An undeclared op elsewhere runs once on whole values (its results typed
    # like the input of their shape, a slice of the whole each): it gathers its inputs.
    per_shard = kind.splits or mode.manual == tuple(mesh.axis_names)
    with context:
        placed = _place(mesh, built.inputs, built.in_specs)
        text = None
        if mode.jit:
            lowered = fn.lower(*placed)
            compiled = lowered.compile()
            text = compiled.as_text()
            CALLS.clear()
            out = compiled(*placed)
        else:
            CALLS.clear()
            out = fn(*placed)
        jax.block_until_ready(out)
        calls = list(CALLS)
        want = built.out_spec
        if not (explicit or per_shard):
            want = None  # Auto axes, an op that runs once: where its results go is XLA's
        elif want is None and explicit and per_shard:  # hessian: the types JAX's own ops give
            ref_out = (jax.jit(ref_fn) if mode.jit else ref_fn)(*placed)
            want = jax.tree.map(lambda r: jax.typeof(r).sharding.spec, ref_out)
    problems = [f"value: {p}" for p in _compare_values(out, expected)]
    problems += [f"sharding: {p}" for p in _compare_shardings(out, want, mesh, explicit)]
    if text is not None and per_shard and _gathers(text):
        problems.append(f"hlo: {_gathers(text)}")
    if transform == "forward":
        problems += _check_calls(mode, kind, built, mesh, calls)
    if transform in ("forward", "vmap") and mode.jit and mode.manual is None:
        problems += _check_lowering(explicit, kind, transform, lowered.as_text())
    return problems


def _check_lowering(explicit: bool, kind: Kind, transform: str, text: str) -> list:
    """The op took the lowering its kind and the mode call for. Under Explicit axes a
    declared op lowers as a shard_map of its rule, with no partitioning callback; under
    vmap, rules that loop over the batch (batch="loop") cannot take the split lowering."""
    found = [name for marker, name in (("jaxdecl_dispatch_split", "split"),
                                       ("CustomSPMDPartitioning", "callback")) if marker in text]
    if explicit:
        # A shard_map; an undeclared op before JAX 0.9: a direct call on gathered inputs.
        want = []
    elif not kind.splits:
        want = ["callback"]  # an undeclared op: its vmapped rows per device, the rest once
    elif transform == "vmap" and type(kind.op).__jaxdecl_spec__.batch_mode == "loop":
        want = ["callback"]
    else:
        want = [kind.lowering]
    return [] if found == want else [f"lowering: {found or 'shard_map'}, expected "
                                     f"{want or 'shard_map'}"]


def _check_calls(mode: Mode, kind: Kind, built: Built, mesh, calls) -> list:
    """Each device's forward saw its own block (a declared op, or any op in a shard_map:
    blocks of the manual axes), or one call saw the whole input (an undeclared op)."""
    first = jax.tree.leaves(built.inputs[0])[0]
    spec = jax.tree.leaves(built.in_specs[0], is_leaf=_is_spec)[0]
    if kind.splits or mode.manual is not None:
        if not kind.splits:
            spec = _manual_only(spec, mode.manual)
        want = [_local_shape(np.shape(first), spec, mesh)] * jax.local_device_count()
    else:  # once, on the mesh's first device (the first process's)
        want = [np.shape(first)] if jax.process_index() == 0 else []
    seen = [shape for rule, shape in calls if rule == "forward"]
    if sorted(seen) != sorted(want):
        return [f"rule calls: saw blocks {seen}, expected {want}"]
    return []


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------

def _start(mode_name: str, argv) -> None:
    if mode_name == "processes-1d":
        port, process_id = argv
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                                   process_id=int(process_id))


def main(argv) -> None:
    jax.config.update("jax_enable_x64", True)
    mode_name, cells = argv[0], argv[1].split(",")
    mode = MODES[mode_name]
    _start(mode_name, argv[2:])
    mesh = _mesh(mode.mesh, getattr(AxisType, mode.axis_type))
    checks = {}
    for cell in cells:
        kind_name, transform = cell.split("/")
        try:
            problems = run_cell(mode, kind_name, transform, mesh)
        except Exception as error:  # noqa: BLE001 - reported to the test
            problems = [f"raised {type(error).__name__}: {str(error)[:600]}"]
        checks[cell] = True if not problems else "; ".join(problems)
    if mode_name == "processes-1d":
        jax.distributed.shutdown()
    print(json.dumps({"checks": checks}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

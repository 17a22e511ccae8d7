"""Real bindings: finufft's NUFFTs, a SciPy KD-tree query and DUCC transforms against their peers.

Usage::

    python benchmarks/bench_bindings.py              # full run, about 3 minutes on 2 cores
    python benchmarks/bench_bindings.py --quick      # small sizes, few rounds: about 30 s
    python benchmarks/bench_bindings.py --markdown   # also prints the tables for README.md
    python benchmarks/bench_bindings.py --profile    # adds empty-rule ops to the small forwards
    python benchmarks/bench_bindings.py --only nufft # the cases whose key contains "nufft"

Rules a user would bind, from PyPI packages, each declared with jaxdecl as the
documentation shows, and timed side by side with what else a user has: the same
routine called directly from NumPy (``direct``, the floor: no JAX at all) and the
peer a JAX user would pick instead.

- ``nufft*``: the type-1 NUFFT of ``finufft`` (complex128, tolerance 1e-9, one
  thread), a linear op whose ``@transpose`` is the type 2 with the same sign,
  ``points`` non-differentiable and a ``@jd.batch`` rule that folds ``vmap`` into
  finufft's ``n_trans``. Variants: ``jaxdecl`` (Python rules calling finufft's
  Python API), ``jaxdecl[pytree]`` (the same op taking ``points`` as one tuple of
  coordinate arrays), ``jaxdecl[C]`` (the C kernels of
  ``tutorials/12_finufft_c.py``, a plan per call), ``jaxdecl[C+plan]`` (its kernels
  that keep finufft's plan per thread and shape), the peer ``jax-finufft`` (a
  hand-written C++ XLA FFI binding, ``Opts(nthreads=1)``) and, for ``vmap``,
  ``jax-finufft[n_trans]`` (its native batch, called with the stacked strengths:
  jax-finufft 1.3.1's ``vmap`` fails on JAX >= 0.10, the case records why),
  ``direct`` (``finufft.nufft{d}d1``, a plan per call) and ``direct[plan]``
  (a ``finufft.Plan`` made once: ``setpts`` and ``execute`` per call).
  Cases: 1-D M = 10³ points / N = 64 modes, 1-D M = 10⁵ / N = 1024, 2-D M = 10⁵ /
  128 × 128; each as ``forward``, ``grad`` (of ``sum |f|²`` wrt the strengths) and
  ``vmap`` (8 strength vectors sharing the points).
- ``kdtree*``: the SciPy ``cKDTree`` query of ``tutorials/09_pytrees.py``
  (queries ``scale * x + shift`` with a dict of parameters; rules reading
  ``result=``) against ``jax.pure_callback`` (under ``jax.custom_vjp`` for the
  gradient, ``vmap_method="sequential"``): forward, grad (wrt the dict) and
  ``vmap`` (8 shifts), small and large.
- ``fft*`` and ``sht*``: ``jaxdecl.contrib.ducc``'s ``c2c`` against
  ``jnp.fft.fft``/``fftn``, and its ``healpix_synthesis`` against ``s2fft``'s
  ``inverse`` (pure JAX, ``method="jax"``, a_lm converted to its layout inside
  the jitted function): forward, grad (of ``sum |y|²``) and ``vmap`` (8 inputs),
  small and large. ``benchmarks/bench_ducc.py`` compares the same ops with JAXbind.

Every variant of a case computes the same thing: the harness builds (compiles)
and runs each once, and every leaf of its result (converted to the direct call's
layout where the peer's differs) is checked against ``direct`` before timing. Then
the variants are timed interleaved (:mod:`harness`), and each case reports the
median and min per-call time of every variant and the ratios of medians to
``direct`` and to the peer. Results go to ``benchmarks/results_bindings.json`` and
a chart to ``benchmarks/results_bindings.png`` (``--out`` changes the prefix).
Every library runs on one thread where it has the option (finufft, DUCC, SciPy,
OpenMP); XLA's own operations (``jnp.fft``, ``s2fft``) use XLA's threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
TUTORIALS = HERE.parent / "tutorials"
sys.path.insert(0, str(HERE))

import harness

import jaxdecl as jd

try:
    import finufft
except ImportError:  # the NUFFT cases are skipped
    finufft = None

try:
    import jax_finufft
    from jax_finufft.options import Opts as JaxFinufftOpts
except ImportError:  # the NUFFT cases run without their peer
    jax_finufft = None

try:
    from scipy.spatial import cKDTree
except ImportError:  # the KD-tree cases are skipped
    cKDTree = None

try:
    import ducc0

    from jaxdecl.contrib import ducc
except ImportError:  # the DUCC cases are skipped
    ducc0 = ducc = None

try:
    import s2fft
except ImportError:  # the spherical-harmonic cases run without their peer
    s2fft = None

EPS = 1e-9  # finufft's requested accuracy, every NUFFT variant
BATCH = 8  # elements of every vmap case
F64, C128 = np.float64, np.complex128

# (case, variant, reference, limit): variant / reference (medians) must be <= limit.
TARGETS = [("nufft1d_small_forward", "jaxdecl[C]", "jax-finufft", 1.05)] + [
    (f"{case}_{mode}", "contrib.finufft", "jax-finufft", 0.95 if case == "finufft_1d1_small"
     else 1.00)
    for case in ("finufft_1d1_small", "finufft_1d1_large", "finufft_2d2_large", "finufft_3d3")
    for mode in ("forward", "grad", "grad-points", "jvp")]
SHARDED_TARGET = 0.35  # the sharded type 2 on 4 host devices / on one


@dataclasses.dataclass(frozen=True)
class Options:
    """What the cases depend on."""

    quick: bool
    profile: bool


@dataclasses.dataclass
class Built:
    """One case, ready to build: its variants' makers and how to judge them.

    Attributes:
      title: the case's heading.
      candidates: variant name -> a maker of a zero-argument variant (None: library
        missing); ``direct`` first: the reference every other result is checked against.
      peers: names of the peer, in order of preference: the first one timed is the peer.
      convert: variant name -> a function turning its result into the direct call's
        layout (a peer whose inputs and outputs are laid out differently).
      rtol, atol: how close every leaf must be to ``direct``'s (atol relative to the
        leaf's largest magnitude).
      details: sizes and settings, copied into the report.
    """

    title: str
    candidates: dict
    peers: tuple
    convert: dict = dataclasses.field(default_factory=dict)
    rtol: float = 1e-9
    atol: float = 1e-12
    details: dict = dataclasses.field(default_factory=dict)


def _jitted(f, *args):
    g = jax.jit(f)
    return lambda: g(*args)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _squares(y):
    """Σ |y|², the loss of every grad case, as Σ (re² + im²).

    (``jnp.abs(y) ** 2`` computes the same, but its gradient on complex values
    divides by |y| in complex arithmetic: 29 µs for 256 values, more than the
    transforms it would be measured with.)
    """
    return jnp.sum(y.real**2 + y.imag**2)


# ---------------------------------------------------------------------------
# finufft's type-1 NUFFT, declared with jaxdecl as the documentation shows
# ---------------------------------------------------------------------------


def _type1_into(coordinates, c, out, n_modes, eps):
    """finufft's type 1 (sign +1) of strengths c (..., M) into out (..., *n_modes).

    Leading dims are a batch of transforms sharing the points: finufft's
    ``n_trans``. ``out`` is XLA's buffer (a writable view): finufft writes into it.
    """
    batched = c.ndim > 1
    transform = getattr(finufft, f"nufft{len(n_modes)}d1")
    transform(*coordinates, c.reshape(-1, c.shape[-1]) if batched else c,
              out=out.reshape((-1,) + n_modes) if batched else out, eps=eps, isign=1, nthreads=1)


def _type2_into(coordinates, f, out, n_modes, eps):
    """finufft's type 2 with sign +1: the transpose of :func:`_type1_into`."""
    batched = f.ndim > len(n_modes)
    transform = getattr(finufft, f"nufft{len(n_modes)}d2")
    transform(*coordinates, f.reshape((-1,) + n_modes) if batched else f,
              out=out.reshape(-1, out.shape[-1]) if batched else out, eps=eps, isign=1,
              nthreads=1)


def _fold_or_map(op, points, c, points_axes, c_axis):
    """A ``@jd.batch`` rule for the NUFFT ops: shared points fold the batch into n_trans.

    Points of their own per element (rare: a batch of geometries) take one call
    per element, through ``lax.map``.
    """
    if not jax.tree_util.tree_leaves(points_axes):  # every points axis is None: shared
        return op(points, jnp.moveaxis(c, c_axis, 0)), 0
    leaves, tree = jax.tree_util.tree_flatten(points)
    axes = tree.flatten_up_to(points_axes)
    size = next(x.shape[a] for x, a in zip(leaves, axes) if a is not None)

    def leading(x, axis):
        return jnp.broadcast_to(x, (size,) + x.shape) if axis is None else jnp.moveaxis(x, axis, 0)

    points = tree.unflatten([leading(x, a) for x, a in zip(leaves, axes)])
    return jax.lax.map(lambda pc: op(*pc), (points, leading(c, c_axis))), 0


class Nufft1(jd.Primitive, linear=True, nondiff=("points",)):
    """f = Σ_j c_j exp(+i k·x_j), k in [-N/2, N/2) per axis: finufft's type 1.

    Inputs: ``points`` (d, M) float64, one row per coordinate, never
    differentiated; strengths ``c`` (..., M) complex128. Output (..., *n_modes).
    """

    def __init__(self, n_modes, eps=EPS):
        self.n_modes = tuple(int(n) for n in n_modes)
        self.eps = float(eps)

    @jd.abstract
    def shapes(self, points, c):
        if points.shape[:1] != (len(self.n_modes),) or c.shape[-1:] != points.shape[1:]:
            raise ValueError(f"points (d, M) and c (..., M) expected, got {points.shape}, "
                             f"{c.shape}")
        return _sds(c.shape[:-1] + self.n_modes, c.dtype)

    @jd.forward
    def apply(self, points, c, *, out):
        _type1_into(points, c, out, self.n_modes, self.eps)  # the rows of points: x, y

    @jd.transpose
    def apply_t(self, points, ct, *, out):
        _type2_into(points, ct, out, self.n_modes, self.eps)

    @jd.batch
    def batched(self, args, axes):
        return _fold_or_map(self, *args, *axes)


class Nufft1Tree(Nufft1):
    """The same op with ``points`` one pytree: a tuple of d coordinate arrays (M,)."""

    @jd.abstract
    def shapes(self, points, c):
        if len(points) != len(self.n_modes) or any(x.shape != c.shape[-1:] for x in points):
            raise ValueError(f"{len(self.n_modes)} coordinate arrays (M,) and c (..., M) "
                             f"expected, got {[x.shape for x in points]}, {c.shape}")
        return _sds(c.shape[:-1] + self.n_modes, c.dtype)


class Empty(jd.Primitive, linear=True, nondiff=("points",)):
    """The NUFFT's signature with a rule that does nothing: the cost of reaching the rule."""

    def __init__(self, n_modes):
        self.n_modes = tuple(int(n) for n in n_modes)

    @jd.abstract
    def shapes(self, points, c):
        return _sds(c.shape[:-1] + self.n_modes, c.dtype)

    @jd.forward
    def apply(self, points, c, *, out):
        pass

    @jd.transpose
    def apply_t(self, points, ct, *, out):
        pass


@functools.cache
def _tutorial_ops():
    """(per-call class, plan-keeping class) of tutorials/12_finufft_c.py, or (None, why)."""
    sys.path.insert(0, str(TUTORIALS))  # the tutorial imports `requires` from its folder
    spec = importlib.util.spec_from_file_location("finufft_c_tutorial",
                                                  TUTORIALS / "12_finufft_c.py")
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    if tutorial.TOLERANCE != EPS:
        return None, f"the tutorial's kernels use tolerance {tutorial.TOLERANCE}, not {EPS}"
    directory = tempfile.mkdtemp(prefix="jaxdecl_bench_finufft_")
    lib, note = tutorial.build_library(pathlib.Path(directory))
    if lib is None:
        return None, note
    return tutorial.declare(lib), tutorial.declare(lib, keep_plan=True)


def _tutorial_op(kept: bool):
    """A maker of the tutorial's C-kernel op class (raises with the reason where none)."""
    ops = _tutorial_ops()
    if ops[0] is None:
        raise RuntimeError(ops[1])
    return ops[1] if kept else ops[0]


class _DirectPlans:
    """finufft.Plan objects made once, per (type, n_trans): the 'direct[plan]' variant."""

    def __init__(self, points, n_modes):
        self.points, self.n_modes, self.plans = points, n_modes, {}

    def __call__(self, kind, data):
        n_trans = data.shape[0] if data.ndim > (1 if kind == 1 else len(self.n_modes)) else 1
        key = (kind, n_trans)
        if key not in self.plans:
            self.plans[key] = finufft.Plan(kind, self.n_modes, n_trans=n_trans, eps=EPS,
                                           isign=1, nthreads=1)
        plan = self.plans[key]
        plan.setpts(*self.points)
        return plan.execute(data)


def nufft_case(opts, d, m, n_modes, mode):
    """One NUFFT case: `mode` is "forward", "grad" or "vmap"."""
    rng = np.random.default_rng(0)
    points = rng.uniform(-np.pi, np.pi, (d, m))
    c = rng.standard_normal(m) + 1j * rng.standard_normal(m)
    cs = rng.standard_normal((BATCH, m)) + 1j * rng.standard_normal((BATCH, m))
    jpoints, jc, jcs = jnp.asarray(points), jnp.asarray(c), jnp.asarray(cs)
    coordinates = tuple(jnp.asarray(row) for row in points)
    size = "×".join(map(str, n_modes))
    title = f"{d}-D NUFFT type 1, M = {m:,}, N = {size}: {mode}"
    details = {"dim": d, "points": m, "n_modes": list(n_modes), "eps": EPS, "mode": mode,
               "batch": BATCH if mode == "vmap" else None}
    if finufft is None:
        return None

    def direct1(data):
        return getattr(finufft, f"nufft{d}d1")(*points, data, n_modes, eps=EPS, isign=1,
                                               nthreads=1)

    def direct2(data):
        return getattr(finufft, f"nufft{d}d2")(*points, data, eps=EPS, isign=1, nthreads=1)

    def peer(cc, *xs):
        return jax_finufft.nufft1(n_modes, cc, *xs, iflag=1, eps=EPS,
                                  opts=JaxFinufftOpts(nthreads=1))

    def of(op, points_arg):
        """The jitted variant of `op` (op(points, c)) for this case's mode."""
        if mode == "forward":
            return _jitted(op, points_arg, jc)
        if mode == "grad":
            return _jitted(jax.grad(lambda v: _squares(op(points_arg, v))), jc)
        return _jitted(jax.vmap(op, in_axes=(None, 0)), points_arg, jcs)

    plans = _DirectPlans(points, n_modes)
    if mode == "forward":
        direct = lambda: lambda: direct1(c)  # noqa: E731
        direct_plan = lambda: lambda: plans(1, c)  # noqa: E731
    elif mode == "grad":
        # d/dc Σ |A c|² in JAX's convention: 2 Aᵀ conj(A c); Aᵀ is type 2 with the same sign.
        direct = lambda: lambda: 2 * direct2(np.conj(direct1(c)))  # noqa: E731
        direct_plan = lambda: lambda: 2 * plans(2, np.conj(plans(1, c)))  # noqa: E731
    else:
        direct = lambda: lambda: direct1(cs)  # noqa: E731
        direct_plan = lambda: lambda: plans(1, cs)  # noqa: E731

    candidates = {
        "direct": direct,
        "direct[plan]": direct_plan,
        "jaxdecl": lambda: of(Nufft1(n_modes), jpoints),
        "jaxdecl[pytree]": lambda: of(Nufft1Tree(n_modes), coordinates),
        "jaxdecl[C]": lambda: of(_tutorial_op(kept=False)(n_modes), jpoints),
        "jaxdecl[C+plan]": lambda: of(_tutorial_op(kept=True)(n_modes), jpoints),
    }
    if jax_finufft is None:
        candidates["jax-finufft"] = None
    else:
        candidates["jax-finufft"] = lambda: of(
            lambda p, v: peer(v, *[p[i] for i in range(d)]), jpoints)
        if mode == "vmap":
            # jax-finufft's own batch: the stacked strengths as one source array.
            candidates["jax-finufft[n_trans]"] = lambda: _jitted(peer, jcs, *coordinates)
    if opts.profile and mode == "forward" and m <= 10_000:
        candidates["jaxdecl[empty]"] = lambda: of(Empty(n_modes), jpoints)
    return Built(title, candidates, peers=("jax-finufft", "jax-finufft[n_trans]"),
                 rtol=1e-6, atol=1e-7, details=details)


# ---------------------------------------------------------------------------
# jaxdecl.contrib.finufft against jax-finufft: the same calls, one import apart
# ---------------------------------------------------------------------------

#: The contrib cases: (type, dim, points, modes or targets), full and quick sizes.
CONTRIB_SIZES = {
    "finufft_1d1_small": (dict(nufft_type=1, d=1, m=1_000, n=(64,)),) * 2,
    "finufft_1d1_large": (dict(nufft_type=1, d=1, m=100_000, n=(1024,)),
                          dict(nufft_type=1, d=1, m=10_000, n=(256,))),
    "finufft_2d2_large": (dict(nufft_type=2, d=2, m=100_000, n=(128, 128)),
                          dict(nufft_type=2, d=2, m=10_000, n=(32, 32))),
    "finufft_3d3": (dict(nufft_type=3, d=3, m=10_000, n=10_000),
                    dict(nufft_type=3, d=3, m=1_000, n=1_000)),
}
#: forward; grad of Σ|f|² wrt the strengths; wrt the strengths and every coordinate;
#: jvp wrt the strengths; the forward at two point sets per call (no plan reuse).
CONTRIB_MODES = ("forward", "grad", "grad-points", "jvp", "new-points")
CONTRIB_SIGN = {1: 1, 2: -1, 3: -1}  # jax-finufft's default signs


def _finufft_direct(nufft_type, d, n):
    """(A, Aᵀ) of one case as finufft's Python calls (a plan per call, as jax-finufft).

    Each maps (points, targets, values) to values; a leading batch is finufft's n_trans.
    """
    sign = CONTRIB_SIGN[nufft_type]
    if nufft_type == 3:
        def forward(points, targets, v):
            return getattr(finufft, f"nufft{d}d3")(*points, v, *targets, eps=EPS, isign=sign,
                                                   nthreads=1)

        def transpose(points, targets, v):
            return getattr(finufft, f"nufft{d}d3")(*targets, v, *points, eps=EPS, isign=sign,
                                                   nthreads=1)
        return forward, transpose
    one = lambda points, v: getattr(finufft, f"nufft{d}d1")(  # noqa: E731
        *points, v, n, eps=EPS, isign=sign, nthreads=1)
    two = lambda points, v: getattr(finufft, f"nufft{d}d2")(  # noqa: E731
        *points, v, eps=EPS, isign=sign, nthreads=1)
    first, second = (one, two) if nufft_type == 1 else (two, one)
    return (lambda points, targets, v: first(points, v)), \
        (lambda points, targets, v: second(points, v))


def _direct_grad_points(nufft_type, d, n, points, targets, c):
    """(grad c, grad of each coordinate) of Σ|f|², by finufft's calls (the derivatives'
    formulas of jaxdecl/contrib/finufft/_derivatives.py, in NumPy)."""
    forward, transpose = _finufft_direct(nufft_type, d, n)
    sign = CONTRIB_SIGN[nufft_type]
    ct = 2 * np.conj(forward(points, targets, c))
    if nufft_type == 3:
        back = transpose(points, targets, np.stack([ct] + [1j * sign * s * ct for s in targets]))
        along = forward(points, targets, np.stack([1j * sign * x * c for x in points]))
        return (back[0], *[np.real(c * b) for b in back[1:]],
                *[np.real(ct * a) for a in along])
    grids = np.meshgrid(*[np.arange(-(k // 2), (k + 1) // 2) for k in n], indexing="ij")
    if nufft_type == 1:
        back = transpose(points, targets, np.stack([ct] + [1j * sign * g * ct for g in grids]))
        return (back[0], *[np.real(c * b) for b in back[1:]])
    along = forward(points, targets, np.stack([1j * sign * g * c for g in grids]))
    return (transpose(points, targets, ct), *[np.real(ct * a) for a in along])


def contrib_case(opts, nufft_type, d, m, n, mode):
    """One case of jaxdecl.contrib.finufft against jax-finufft (and finufft's Python)."""
    if finufft is None:
        return None
    try:
        from jaxdecl.contrib import finufft as contrib
    except ImportError as error:  # the kernels are not built
        print(f"jaxdecl.contrib.finufft: {error}")
        contrib = None
    rng = np.random.default_rng(3)
    points = tuple(rng.uniform(-np.pi, np.pi, m) for _ in range(d))
    moved = tuple(rng.uniform(-np.pi, np.pi, m) for _ in range(d))
    scale = 0.5 * m ** (1 / d)  # type 3: the targets' extent, as many as the points
    targets = tuple(rng.uniform(-scale, scale, n) for _ in range(d)) if nufft_type == 3 else ()
    shape = n if nufft_type == 2 else (m,)
    c = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    dc = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    coords = points + targets
    what = f"K = {n:,} targets" if nufft_type == 3 else f"N = {'×'.join(map(str, n))}"
    title = f"{d}-D type {nufft_type}, M = {m:,}, {what}: {mode}"
    details = {"dim": d, "type": nufft_type, "points": m, "modes_or_targets": n, "eps": EPS,
               "mode": mode}
    forward, _ = _finufft_direct(nufft_type, d, n)

    def jitted(call):
        """The jitted variant of `call(c, *coords)` (one library) for this mode."""
        loss = lambda *a: _squares(call(*a))  # noqa: E731
        j = tuple(jnp.asarray(x) for x in coords)
        if mode == "forward":
            return _jitted(call, jnp.asarray(c), *j)
        if mode == "grad":
            return _jitted(jax.grad(loss), jnp.asarray(c), *j)
        if mode == "grad-points":
            return _jitted(jax.grad(loss, argnums=tuple(range(1 + len(coords)))),
                           jnp.asarray(c), *j)
        if mode == "jvp":
            return _jitted(lambda v, t, *p: jax.jvp(lambda u: call(u, *p), (v,), (t,)),
                           jnp.asarray(c), jnp.asarray(dc), *j)
        two = tuple(jnp.asarray(x) for x in moved + targets)
        return _jitted(lambda v, p, q: (call(v, *p), call(v, *q)), jnp.asarray(c), j, two)

    if mode == "forward":
        direct = lambda: lambda: forward(points, targets, c)  # noqa: E731
    elif mode == "grad":
        _, transpose = _finufft_direct(nufft_type, d, n)
        direct = lambda: lambda: transpose(points, targets,  # noqa: E731
                                           2 * np.conj(forward(points, targets, c)))
    elif mode == "grad-points":
        direct = lambda: lambda: _direct_grad_points(nufft_type, d, n, points, targets,  # noqa
                                                     c)
    elif mode == "jvp":
        direct = lambda: lambda: (forward(points, targets, c),  # noqa: E731
                                  forward(points, targets, dc))
    else:
        direct = lambda: lambda: (forward(points, targets, c),  # noqa: E731
                                  forward(moved, targets, c))

    def of(library, options):
        if nufft_type == 1:
            return lambda v, *p: library.nufft1(n, v, *p, iflag=1, eps=EPS, opts=options)
        call = library.nufft2 if nufft_type == 2 else library.nufft3
        return lambda v, *p: call(v, *p, eps=EPS, opts=options)

    candidates = {"direct": direct, "contrib.finufft": None, "jax-finufft": None}
    if contrib is not None:
        candidates["contrib.finufft"] = lambda: jitted(of(contrib, contrib.Opts(nthreads=1)))
    if jax_finufft is not None:
        candidates["jax-finufft"] = lambda: jitted(of(jax_finufft, JaxFinufftOpts(nthreads=1)))
    return Built(title, candidates, peers=("jax-finufft",), rtol=1e-6, atol=1e-7,
                 details=details)


def contrib_table(cases: dict) -> dict:
    """contrib.finufft / jax-finufft (medians, and mins) per case and mode."""
    table = {}
    for key in CONTRIB_SIZES:
        row = {}
        for mode in CONTRIB_MODES:
            found = cases.get(f"{key}_{mode}", {}).get("variants", {})
            if {"contrib.finufft", "jax-finufft"} <= set(found):
                ours, peer = found["contrib.finufft"], found["jax-finufft"]
                row[mode] = {"ratio": ours["median_s"] / peer["median_s"],
                             "ratio_of_mins": ours["min_s"] / peer["min_s"]}
        if any(k.startswith(key) for k in cases):  # without jax-finufft: a row of "-"
            table[key] = {"title": cases[next(k for k in cases if k.startswith(key))]["title"]
                          .rsplit(":", 1)[0], **row}
    return table


def contrib_markdown(table: dict, sharded: dict | None) -> str:
    head = ["fwd", "grad (strengths)", "grad (strengths + points)", "jvp (strengths)",
            "fwd, new points"]
    lines = ["| contrib.finufft / jax-finufft (nthreads=1) | " + " | ".join(head) + " |",
             "|---|" + "---:|" * len(head)]
    for row in table.values():
        cells = [f"{row[m]['ratio']:.2f}" if m in row else "-" for m in CONTRIB_MODES]
        lines.append(f"| {row['title']} | " + " | ".join(cells) + " |")
    if sharded and "ratio" in sharded:
        lines += ["", f"Sharded type 2 ({sharded['title']}): 4 devices / 1 device = "
                      f"{sharded['ratio']:.2f} (mins: {sharded['ratio_of_mins']:.2f}; "
                      f"{os.cpu_count()} CPUs); one device on a quarter of the points / the "
                      f"whole = {sharded['quarter_ratio']:.2f}; "
                      f"jax-finufft on the same sharded input / 1 device = "
                      + (f"{sharded['peer_ratio']:.2f}" if sharded.get("peer_ratio") else "-")]
    return "\n".join(lines)


def draw_contrib_chart(path, table: dict, sharded: dict | None, meta: dict | None = None) -> None:
    """Grouped bars: contrib.finufft / jax-finufft per case and mode; 1.0 marked.

    `meta` (the report's) names the JAX version and CPU count; by default this process's.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(table.values())
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(CONTRIB_MODES)
    for i, mode in enumerate(CONTRIB_MODES):
        xs = [r + (i - (len(CONTRIB_MODES) - 1) / 2) * width for r in range(len(rows))]
        values = [row[mode]["ratio"] if mode in row else 0.0 for row in rows]
        ax.bar(xs, values, width, label=mode)
    labels = [row["title"].replace(", ", ",\n") for row in rows]
    if sharded and "ratio" in sharded:
        ax.bar([len(rows) - 0.15], [sharded["ratio"]], 0.3, color="#444444",
               label="type 2, 4 devices / 1 device")
        ax.bar([len(rows) + 0.15], [sharded["quarter_ratio"]], 0.3, color="#999999",
               label="type 2, 1 device on M/4 points / on M (each device's share)")
        labels.append("sharded 2-D type 2")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("time / jax-finufft's (median)")
    meta = meta or {"jax": jax.__version__, "cpus": os.cpu_count()}
    ax.set_title(f"jaxdecl.contrib.finufft / jax-finufft, nthreads=1 (jax {meta['jax']}, "
                 f"{meta['cpus']} CPUs); below 1: faster", fontsize=10)
    ax.set_ylim(0, 1.6)
    ax.legend(fontsize=8, ncol=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sharded_type2(quick: bool) -> dict:
    """A 2-D type 2 on 4 host devices (points split) against one device; in this process.

    Run by ``--sharded-child``, in a process started with 4 forced host devices.
    """
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdecl.contrib import finufft as contrib

    m, n = (10_000, (32, 32)) if quick else (100_000, (128, 128))
    rng = np.random.default_rng(4)
    x, y = rng.uniform(-np.pi, np.pi, (2, m))
    f = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    xs, ys = (jax.device_put(v, NamedSharding(mesh, P("d"))) for v in (x, y))
    ours = jax.jit(lambda v, a, b: contrib.nufft2(v, a, b, eps=EPS, opts=contrib.Opts(nthreads=1)))
    quarter = m // 4  # what each device does: where 4 cores are free, the 4 devices' time
    variants = {"1 device": lambda: ours(f, x, y), "4 devices": lambda: ours(f, xs, ys),
                "1 device, M/4 points": lambda: ours(f, x[:quarter], y[:quarter])}
    text = ours.lower(f, xs, ys).compile().as_text()
    gathers = [w for w in ("all-gather", "all-to-all") if w in text]
    if jax_finufft is not None:
        peer = jax.jit(lambda v, a, b: jax_finufft.nufft2(v, a, b, eps=EPS,
                                                          opts=JaxFinufftOpts(nthreads=1)))
        variants["jax-finufft, 4 devices"] = lambda: peer(f, xs, ys)
    reference = np.asarray(variants["1 device"]())
    for name, run in variants.items():
        if name.endswith("M/4 points"):
            continue
        if not np.allclose(np.asarray(run()), reference, rtol=1e-9, atol=1e-9 * np.abs(
                reference).max()):
            raise RuntimeError(f"sharded type 2: {name} differs from one device")
    stats = harness.time_case(variants, rounds=3 if quick else 31, target_s=0.05,
                              max_seconds=1.0 if quick else 20.0, min_rounds=3)
    one = stats["1 device"]
    entry = {"title": f"2-D, M = {m:,}, N = {n[0]}×{n[1]}", "gathers_in_hlo": gathers,
             "variants": {k: s.as_dict() for k, s in stats.items()},
             "ratio": stats["4 devices"].median / one.median,
             "ratio_of_mins": stats["4 devices"].min / one.min,
             "quarter_ratio": stats["1 device, M/4 points"].median / one.median}
    if "jax-finufft, 4 devices" in stats:
        entry["peer_ratio"] = stats["jax-finufft, 4 devices"].median / one.median
    return entry


def run_sharded_child(quick: bool) -> dict:
    """:func:`sharded_type2` in a child process with 4 host devices; its entry or why not."""
    import json
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, __file__, "--sharded-child"] +
                          (["--quick"] if quick else []), capture_output=True, text=True,
                          env=env, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"skipped": f"the 4-device child failed: {done.stderr[-1500:]}"}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------
# The KD-tree query of tutorials/09_pytrees.py
# ---------------------------------------------------------------------------


class Nearest(jd.Primitive):
    """Distance to, and index of, the nearest fixed point of each query ``scale * x + shift``.

    Inputs: ``x`` (n, d) and the dict ``params = {"shift": (d,), "scale": ()}``;
    outputs ``(distance (n,), index (n,) int32)``. The tree is configuration.
    The derivative rules read the forward's result: no second query.
    """

    def __init__(self, tree):
        self.tree = tree

    @staticmethod
    def _queries(x, params):
        return params["scale"] * x + params["shift"]

    @jd.abstract
    def shapes(self, x, params):
        n = x.shape[0]
        return _sds((n,), x.dtype), _sds((n,), np.int32)

    @jd.forward
    def apply(self, x, params, *, out):
        distance, index = out
        distance[...], index[...] = self.tree.query(self._queries(x, params))

    def _unit(self, x, params, result):
        distance, index = result
        return (self._queries(x, params) - self.tree.data[index]) / distance[:, None]

    @jd.jvp
    def push(self, x, params, dx, dparams, *, out, result):
        dq = params["scale"] * dx + dparams["shift"] + dparams["scale"] * x
        np.sum(self._unit(x, params, result) * dq, axis=1, out=out)

    @jd.vjp
    def pull(self, x, params, ct, *, result):
        ct_q = ct[:, None] * self._unit(x, params, result)
        return params["scale"] * ct_q, {"shift": ct_q.sum(axis=0), "scale": np.sum(ct_q * x)}


def _pure_nearest(tree):
    """The same query through ``jax.pure_callback``, its gradient by ``jax.custom_vjp``."""
    data = jnp.asarray(tree.data)

    def host(x, shift, scale):
        distance, index = tree.query(scale * x + shift)
        return distance, index.astype(np.int32)

    def query(x, params):
        n = x.shape[0]
        return jax.pure_callback(host, (_sds((n,), x.dtype), _sds((n,), np.int32)), x,
                                 params["shift"], params["scale"], vmap_method="sequential")

    @jax.custom_vjp
    def nearest(x, params):
        return query(x, params)

    def fwd(x, params):
        distance, index = query(x, params)
        return (distance, index), (x, params, distance, index)

    def bwd(residuals, cts):
        x, params, distance, index = residuals
        q = params["scale"] * x + params["shift"]
        ct_q = cts[0][:, None] * (q - data[index]) / distance[:, None]
        return params["scale"] * ct_q, {"shift": ct_q.sum(axis=0), "scale": jnp.sum(ct_q * x)}

    nearest.defvjp(fwd, bwd)
    return nearest


def kdtree_case(opts, n_points, n_queries, mode):
    if cKDTree is None:
        return None
    rng = np.random.default_rng(9)
    tree = cKDTree(rng.uniform(-1.0, 1.0, (n_points, 3)))
    x = rng.uniform(-1.0, 1.0, (n_queries, 3))
    params = {"shift": np.array([0.1, -0.2, 0.05]), "scale": np.array(0.9)}
    shifts = rng.uniform(-0.2, 0.2, (BATCH, 3))
    jx = jnp.asarray(x)
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    batch = {"shift": jnp.asarray(shifts), "scale": jparams["scale"]}
    title = f"cKDTree query, {n_queries:,} queries in {n_points:,} points: {mode}"
    details = {"points": n_points, "queries": n_queries, "dim": 3, "mode": mode,
               "batch": BATCH if mode == "vmap" else None}

    def direct_grad():
        # d/dparams Σ distance²: 2 distance · unit = 2 (q - nearest), then the chain rule.
        q = params["scale"] * x + params["shift"]
        _, index = tree.query(q)
        ct_q = 2 * (q - tree.data[index])
        return {"scale": np.sum(ct_q * x), "shift": ct_q.sum(axis=0)}

    def of(nearest):
        if mode == "forward":
            return _jitted(nearest, jx, jparams)
        if mode == "grad":
            return _jitted(jax.grad(lambda p: jnp.sum(nearest(jx, p)[0] ** 2)), jparams)
        return _jitted(jax.vmap(nearest, in_axes=(None, {"shift": 0, "scale": None})), jx,
                       batch)

    if mode == "forward":
        direct = lambda: lambda: tree.query(params["scale"] * x + params["shift"])  # noqa: E731
    elif mode == "grad":
        direct = lambda: direct_grad  # noqa: E731
    else:  # cKDTree queries any leading dims at once
        direct = lambda: lambda: tree.query(  # noqa: E731
            params["scale"] * x[None] + shifts[:, None, :])
    candidates = {"direct": direct, "jaxdecl": lambda: of(Nearest(tree)),
                  "pure_callback": lambda: of(_pure_nearest(tree))}
    if opts.profile and mode == "forward" and n_queries <= 1_000:
        candidates["jaxdecl[empty]"] = lambda: of(NearestEmpty(tree))
    # Leaves compare in the direct call's order: a grad dict's leaves are sorted by key.
    return Built(title, candidates, peers=("pure_callback",), rtol=1e-10, atol=1e-12,
                 details=details)


class NearestEmpty(Nearest):
    """The query's signature (an array and a dict in, two results) with an empty forward."""

    @jd.forward
    def apply(self, x, params, *, out):
        pass


class SameShapeEmpty(jd.Primitive):
    """One array in, one of its shape and dtype out, and a forward that does nothing."""

    @jd.abstract
    def shapes(self, x):
        return _sds(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        pass


# ---------------------------------------------------------------------------
# DUCC: c2c against jnp.fft, HEALPix synthesis against s2fft
# ---------------------------------------------------------------------------


def fft_case(opts, shape, mode):
    if ducc is None:
        return None
    rng = np.random.default_rng(1)
    axes = tuple(range(len(shape)))
    x = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    xs = rng.standard_normal((BATCH, *shape)) + 1j * rng.standard_normal((BATCH, *shape))
    jx, jxs = jnp.asarray(x), jnp.asarray(xs)
    title = f"FFT c2c {'×'.join(map(str, shape))} complex128: {mode}"
    details = {"shape": list(shape), "mode": mode, "batch": BATCH if mode == "vmap" else None}
    fft = functools.partial(ducc0.fft.c2c, forward=True, nthreads=1)

    def of(transform):
        if mode == "forward":
            return _jitted(transform, jx)
        if mode == "grad":
            return _jitted(jax.grad(lambda v: _squares(transform(v))), jx)
        return _jitted(jax.vmap(transform), jxs)

    if mode == "forward":
        direct = lambda: lambda: fft(x, axes=axes)  # noqa: E731
    elif mode == "grad":  # the DFT matrix is symmetric: the gradient is 2 F conj(F x)
        direct = lambda: lambda: 2 * fft(np.conj(fft(x, axes=axes)), axes=axes)  # noqa: E731
    else:
        direct = lambda: lambda: fft(xs, axes=tuple(a + 1 for a in axes))  # noqa: E731
    jnp_fft = jnp.fft.fft if len(shape) == 1 else jnp.fft.fftn
    candidates = {"direct": direct,
                  "jaxdecl": lambda: of(ducc.c2c(axes=axes, forward=True, nthreads=1)),
                  "jnp.fft": lambda: of(jnp_fft)}
    if opts.profile and mode == "forward" and x.size <= 10_000:
        candidates["jaxdecl[empty]"] = lambda: of(SameShapeEmpty())
    return Built(title, candidates, peers=("jnp.fft",), rtol=1e-10, atol=1e-12, details=details)


def _alm_indices(lmax):
    """(l, m) of every a_lm in DUCC's (and healpy's) m-major layout."""
    ls = np.concatenate([np.arange(m, lmax + 1) for m in range(lmax + 1)])
    ms = np.concatenate([np.full(lmax + 1 - m, m) for m in range(lmax + 1)])
    return ls, ms


def _s2fft_synthesis(nside, lmax):
    """HEALPix synthesis by s2fft, taking a_lm (1, nalm) in DUCC's layout, as jaxdecl's op.

    s2fft wants f_lm (L, 2L - 1), m from -lmax to lmax; a real map has
    f_l,-m = (-1)^m conj(f_lm), and only the real part of m = 0 enters it.
    """
    big_l = lmax + 1
    ls, ms = _alm_indices(lmax)
    pos = ms > 0
    sign = (-1.0) ** ms[pos]

    def synthesis(alm):
        a = jnp.where(ms == 0, alm[0].real.astype(alm.dtype), alm[0])
        flm = jnp.zeros((big_l, 2 * big_l - 1), alm.dtype).at[ls, lmax + ms].set(a)
        flm = flm.at[ls[pos], lmax - ms[pos]].set(sign * jnp.conj(a[pos]))
        sky = s2fft.inverse(flm, big_l, nside=nside, sampling="healpix", method="jax",
                            reality=True)
        return jnp.real(sky)[None]

    return synthesis


def sht_case(opts, nside, lmax, mode):
    if ducc is None:
        return None
    rng = np.random.default_rng(2)
    nalm = ducc.nalm(lmax)
    ls, ms = _alm_indices(lmax)

    def random_alm(*lead):
        a = rng.standard_normal((*lead, 1, nalm)) + 1j * rng.standard_normal((*lead, 1, nalm))
        return np.where(ms == 0, a.real, a)  # m = 0 coefficients of a real map are real

    alm, alms = random_alm(), random_alm(BATCH)
    jalm, jalms = jnp.asarray(alm), jnp.asarray(alms)
    title = f"HEALPix synthesis nside {nside}, lmax {lmax}: {mode}"
    details = {"nside": nside, "lmax": lmax, "mode": mode,
               "batch": BATCH if mode == "vmap" else None}
    geometry = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    settings = dict(lmax=lmax, mmax=lmax, spin=0, nthreads=1, **geometry)
    weights = np.where(ms > 0, 2.0, 1.0)  # each m > 0 coefficient stands for ±m

    def of(synthesis):
        if mode == "forward":
            return _jitted(synthesis, jalm)
        if mode == "grad":
            return _jitted(jax.grad(lambda a: jnp.sum(synthesis(a) ** 2)), jalm)
        return _jitted(jax.vmap(synthesis), jalms)

    if mode == "forward":
        direct = lambda: lambda: ducc0.sht.synthesis(alm=alm, **settings)  # noqa: E731
    elif mode == "grad":
        def direct():
            def grad():
                sky = ducc0.sht.synthesis(alm=alm, **settings)
                return np.conj(weights * ducc0.sht.adjoint_synthesis(map=2 * sky, **settings))
            return grad
    else:  # DUCC takes a leading batch of transforms
        direct = lambda: lambda: ducc0.sht.synthesis(alm=alms, **settings)  # noqa: E731
    candidates = {
        "direct": direct,
        "jaxdecl": lambda: of(ducc.healpix_synthesis(nside, lmax, nthreads=1)),
        "s2fft": None if s2fft is None else lambda: of(_s2fft_synthesis(nside, lmax)),
    }
    return Built(title, candidates, peers=("s2fft",), rtol=1e-8, atol=1e-10, details=details)


# ---------------------------------------------------------------------------
# The cases, full and quick sizes
# ---------------------------------------------------------------------------

MODES = ("forward", "grad", "vmap")


def case_list(opts):
    """(key, group, maker) of every case; a maker returns a :class:`Built` or None."""
    q = opts.quick
    sizes = {  # key prefix -> (group, maker, sizes)
        "nufft1d_small": ("nufft", nufft_case, dict(d=1, m=1_000, n_modes=(64,))),
        "nufft1d_large": ("nufft", nufft_case, dict(d=1, m=10_000 if q else 100_000,
                                           n_modes=(256,) if q else (1024,))),
        "nufft2d_large": ("nufft", nufft_case, dict(d=2, m=10_000 if q else 100_000,
                                           n_modes=(32, 32) if q else (128, 128))),
        "kdtree_small": ("kdtree", kdtree_case, dict(n_points=1_000, n_queries=100)),
        "kdtree_large": ("kdtree", kdtree_case, dict(n_points=10_000 if q else 100_000,
                                           n_queries=1_000 if q else 10_000)),
        "fft_small": ("fft", fft_case, dict(shape=(256,))),
        "fft_large": ("fft", fft_case, dict(shape=(128, 128) if q else (512, 512))),
        "sht_small": ("sht", sht_case, dict(nside=4 if q else 8, lmax=8 if q else 16)),
        "sht_large": ("sht", sht_case, dict(nside=8 if q else 32, lmax=16 if q else 64)),
    }
    cases = []
    for prefix, (group, maker, kwargs) in sizes.items():
        for mode in MODES:
            cases.append((f"{prefix}_{mode}", group,
                          functools.partial(maker, opts, mode=mode, **kwargs)))
    for prefix, (full, quick) in CONTRIB_SIZES.items():
        for mode in CONTRIB_MODES:
            cases.append((f"{prefix}_{mode}", "contrib_finufft",
                          functools.partial(contrib_case, opts, mode=mode, **(quick if q else
                                                                            full))))
    return cases


GROUP_LIBRARY = {"nufft": "finufft", "kdtree": "scipy", "fft": "ducc0", "sht": "ducc0",
                 "contrib_finufft": "finufft"}


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def _leaves(value):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(value)]


def build_checked(built: Built):
    """name -> compiled, run and checked variant; plus name -> why it was left out."""
    variants, skipped = harness.build_variants(built.candidates,
                                               unchecked=tuple(built.candidates))
    if "direct" not in variants:
        raise RuntimeError(f"{built.title}: the direct call failed: {skipped.get('direct')}")
    reference = _leaves(variants["direct"]())
    for name in [n for n in variants if n != "direct" and not n.endswith("[empty]")]:
        got = variants[name]()
        leaves = _leaves(built.convert.get(name, lambda v: v)(got))
        close = len(leaves) == len(reference) and all(
            a.shape == b.shape and np.allclose(a, b, rtol=built.rtol,
                                               atol=built.atol * float(np.max(np.abs(b),
                                                                              initial=0.0)))
            for a, b in zip(leaves, reference))
        if not close:
            skipped[name] = "wrong result"
            del variants[name]
    return variants, skipped


def run_case(key, group, built: Built, *, rounds, target_s, max_seconds, min_rounds, warmup):
    """Builds, checks, times and prints one case; returns its report entry."""
    start = time.perf_counter()
    variants, skipped = build_checked(built)
    build_s = time.perf_counter() - start
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s, warmup=warmup,
                              max_seconds=max_seconds, min_rounds=min_rounds)
    peer = next((name for name in built.peers if name in stats), None)
    to_direct = harness.ratios(stats, "direct")
    to_direct_min = harness.ratios(stats, "direct", key="min")
    to_peer = harness.ratios(stats, peer) if peer else {}
    to_peer_min = harness.ratios(stats, peer, key="min") if peer else {}
    entry = {"title": built.title, "group": group, **built.details, "peer": peer,
             "skipped": skipped, "build_s": build_s, "variants": {}}
    for name, s in stats.items():
        entry["variants"][name] = {**s.as_dict(), "vs_direct": to_direct.get(name),
                                   "vs_direct_min": to_direct_min.get(name),
                                   "vs_peer": to_peer.get(name),
                                   "vs_peer_min": to_peer_min.get(name)}
    harness.print_case(built.title, stats,
                       {"/direct": to_direct, f"/{peer or 'peer'}": to_peer}, skipped)
    return entry


def judge_targets(cases):
    """Each target's verdict on the ratio of medians, printed and returned."""
    print("\nTargets (verdict on the ratio of medians):")
    verdicts = []
    for case, variant, reference, limit in TARGETS:
        found = cases.get(case, {}).get("variants", {})
        if variant in found and reference in found:
            value = found[variant]["median_s"] / found[reference]["median_s"]
            best = found[variant]["min_s"] / found[reference]["min_s"]
            verdict = "PASS" if value <= limit else "MISS"
        else:
            value, best, verdict = None, None, "SKIP"
        verdicts.append({"case": case, "variant": variant, "reference": reference,
                         "limit": limit, "ratio": value, "ratio_of_mins": best,
                         "verdict": verdict})
        shown = "   n/a" if value is None else f"{value:6.3f} (mins: {best:6.3f})"
        print(f"  {verdict}  {case:24s} {variant + '/' + reference:26s} = {shown}  <= {limit}")
    return verdicts


def _cell(value, digits=2):
    return "" if value is None else f"{value:,.{digits}f}"


def markdown(report) -> str:
    """Every variant of every case, then one summary line per case."""
    lines = ["| case | variant | median µs | min µs | / direct | / peer |",
             "|---|---|---:|---:|---:|---:|"]
    for case in report["cases"].values():
        for name, v in case["variants"].items():
            label = f"{name} (peer)" if name == case["peer"] else name
            lines.append(f"| {case['title']} | {label} | {_cell(v['median_s'] * 1e6, 1)} | "
                         f"{_cell(v['min_s'] * 1e6, 1)} | {_cell(v['vs_direct'])} | "
                         f"{_cell(v['vs_peer'])} |")
        for name, why in case["skipped"].items():
            lines.append(f"| {case['title']} | {name} | skipped: {why[:120]} | | | |")
    lines += ["", "| case | peer | jaxdecl / direct | jaxdecl / peer | jaxdecl[C] / peer | "
              "jaxdecl[C+plan] / peer | jaxdecl[pytree] / jaxdecl |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for case in report["cases"].values():
        if case["group"] == "contrib_finufft":  # their own table: contrib_markdown
            continue
        v = case["variants"]
        get = functools.partial(lambda found, name, column: found.get(name, {}).get(column), v)
        tree = (v["jaxdecl[pytree]"]["median_s"] / v["jaxdecl"]["median_s"]
                if "jaxdecl[pytree]" in v and "jaxdecl" in v else None)
        lines.append(f"| {case['title']} | {case['peer'] or ''} | "
                     f"{_cell(get('jaxdecl', 'vs_direct'))} | {_cell(get('jaxdecl', 'vs_peer'))} "
                     f"| {_cell(get('jaxdecl[C]', 'vs_peer'))} | "
                     f"{_cell(get('jaxdecl[C+plan]', 'vs_peer'))} | {_cell(tree)} |")
    overheads = [case for case in report["cases"].values()
                 if {"direct", "jaxdecl", "jaxdecl[empty]"} <= set(case["variants"])]
    if overheads:  # --profile: the goal, direct call + an empty op of the same signature
        lines += ["", "| case | direct µs | jaxdecl µs | empty op µs | jaxdecl − direct − empty "
                  "µs | jaxdecl / (direct + empty) |", "|---|---:|---:|---:|---:|---:|"]
        for case in overheads:
            direct, op, empty = (case["variants"][name]["median_s"] * 1e6
                                 for name in ("direct", "jaxdecl", "jaxdecl[empty]"))
            lines.append(f"| {case['title']} | {_cell(direct, 1)} | {_cell(op, 1)} | "
                         f"{_cell(empty, 1)} | {_cell(op - direct - empty, 1)} | "
                         f"{_cell(op / (direct + empty))} |")
    return "\n".join(lines)


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _versions():
    return {"python": platform.python_version(), "jax": jax.__version__,
            "numpy": np.__version__, "jaxdecl": jd.__version__,
            **{name: _version(name) for name in ("finufft", "jax-finufft", "scipy", "ducc0",
                                                 "s2fft")},
            "machine": platform.machine(), "cpu": _cpu_model(), "cpus": os.cpu_count()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--profile", action="store_true",
                        help="add an op of the same signature with an empty rule to the small "
                             "NUFFT, KD-tree and FFT forward cases")
    parser.add_argument("--only", default=None, help="run the cases whose key contains this")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--out", default=str(HERE / "results_bindings"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--finufft-out", default=str(HERE / "results_finufft"),
                        help="prefix of the .json and .png of jaxdecl.contrib.finufft's cases")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as Markdown tables")
    parser.add_argument("--no-sharded", action="store_true",
                        help="skip the sharded type 2 (a child process with 4 host devices)")
    parser.add_argument("--sharded-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sharded_child:  # the 4-device process of the sharded type 2: its entry, as JSON
        import json

        print(json.dumps(sharded_type2(args.quick)))
        return None

    opts = Options(quick=args.quick, profile=args.profile)
    rounds = args.rounds or (3 if args.quick else 101)
    target_s = 0.0005 if args.quick else 0.002
    max_seconds = 0.3 if args.quick else 5.0
    min_rounds = 3 if args.quick else 11
    warmup = 1 if args.quick else 2
    report = {"meta": {**_versions(), "quick": args.quick, "max_rounds": rounds,
                       "max_seconds_per_case": max_seconds, "batch_target_s": target_s,
                       "method": "every variant checked against the direct call, then "
                                 "interleaved rounds; per-call time = batch time / calls, "
                                 "block_until_ready after every call"},
              "cases": {}, "skipped_cases": {}, "targets": []}
    start = time.perf_counter()
    for key, group, make in case_list(opts):
        if args.only and args.only not in key:
            continue
        built = make()
        if built is None:
            why = f"{GROUP_LIBRARY[group]} is not installed"
            report["skipped_cases"][key] = why
            print(f"\n{key}: skipped, {why}")
            continue
        report["cases"][key] = run_case(key, group, built, rounds=rounds, target_s=target_s,
                                        max_seconds=max_seconds, min_rounds=min_rounds,
                                        warmup=warmup)
    ours = {k: v for k, v in report["cases"].items() if v["group"] == "contrib_finufft"}
    report["cases"] = {k: v for k, v in report["cases"].items() if k not in ours}
    table = contrib_table(ours)
    sharded = None
    if ours and not args.no_sharded and (args.only is None or args.only in "finufft_sharded"):
        sharded = run_sharded_child(args.quick)
        print("\nsharded 2-D type 2, 4 host devices / 1:",
              f"{sharded['ratio']:.3f}" if "ratio" in sharded else sharded["skipped"])
    report["targets"] = judge_targets({**report["cases"], **ours})
    if sharded and "ratio" in sharded:
        verdict = "PASS" if sharded["ratio"] <= SHARDED_TARGET else "MISS"
        report["targets"].append({"case": "finufft_sharded_type2", "variant": "4 devices",
                                  "reference": "1 device", "limit": SHARDED_TARGET,
                                  "ratio": sharded["ratio"],
                                  "ratio_of_mins": sharded["ratio_of_mins"], "verdict": verdict})
        print(f"  {verdict}  finufft_sharded_type2    4 devices/1 device         = "
              f"{sharded['ratio']:6.3f} (mins: {sharded['ratio_of_mins']:6.3f})  <= "
              f"{SHARDED_TARGET} ({os.cpu_count()} CPUs)")
    report["meta"]["wall_s"] = time.perf_counter() - start
    written = []
    if report["cases"]:  # the bindings' report and chart
        mine = {t["case"] for t in report["targets"] if t["variant"] in ("contrib.finufft",
                                                                           "4 devices")}
        harness.write_json(args.out + ".json",
                           {**report, "targets": [t for t in report["targets"]
                                                  if t["case"] not in mine]})
        written.append(args.out + ".json")
        if not args.no_chart:
            harness.draw_chart(args.out + ".png", {e["title"]: e for e in report["cases"].values()},
                               title=f"real bindings: jaxdecl, the direct call and the peers "
                                     f"(jax {jax.__version__}, {os.cpu_count()} CPUs; bars "
                                     f"median, ticks min)")
            written.append(args.out + ".png")
    if ours:  # jaxdecl.contrib.finufft against jax-finufft: its own report and chart
        harness.write_json(args.finufft_out + ".json", {
            "meta": report["meta"], "table": table, "sharded": sharded, "cases": ours,
            "targets": [t for t in report["targets"] if t["variant"] in ("contrib.finufft",
                                                                         "4 devices")]})
        written.append(args.finufft_out + ".json")
        if not args.no_chart:
            draw_contrib_chart(args.finufft_out + ".png", table, sharded, report["meta"])
            written.append(args.finufft_out + ".png")
    if args.markdown:
        if report["cases"]:
            print("\n" + markdown(report))
        if ours:
            print("\n" + contrib_markdown(table, sharded))
    print(f"\nwrote {', '.join(written)} ({report['meta']['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()

"""Sharding matrix: op kinds x transforms x ways of running on a mesh of 4 devices.

Each cell runs one transform of one op kind under one mode and checks its values
against a pure ``jax.numpy`` reference, its result's sharding, and (where the op
declares per-shard work and the inputs allow it) that the compiled program has no
``all-gather`` or ``all-to-all`` (``helpers_sharding_matrix.py`` says exactly how).

- modes: ``auto`` (Auto axes under ``jax.jit``), ``explicit`` (Explicit axes,
  ``jax.set_mesh``, jitted) and ``explicit_eager`` (the same, not jitted),
  ``shard_map`` (every axis manual), ``partial`` (``shard_map`` manual over "x"
  only, inputs split along "x"), ``partial_free`` (the same with inputs split along
  the Auto axis "y" too), ``processes`` (``jax.distributed``: 2 processes x 2
  devices); each on the mesh its name ends with: ``1d`` = (4,) "d", ``2d`` = (2, 2)
  "x", "y";
- op kinds (``KINDS`` in the helper): elementwise ``"b n -> b n"`` (the lowering
  that XLA's batch partitioner splits), with traceable rules (second order),
  undeclared, ``replicate=`` and ``reduce=`` (partitioning callback), a pytree, an
  integer (non-differentiable) input, 6 rows (uneven on 4 devices) and a size-1 dim;
- transforms: forward, jvp, vjp, grad, linearize, linear_transpose, vmap (the batch
  split over the devices), hessian, lax.scan, jax.checkpoint, lax.cond.

A subprocess with 4 host devices computes every cell of one mode and reports them
as one JSON line, so JAX starts once per mode. The default run checks the cells
``in_default`` picks, a subset that still has every mode, kind and transform; the
whole matrix runs with ``pytest -m sharding_matrix`` (as ``.ci/run`` does).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from conftest import HelperFailed, needs_split, run_helper, run_two_processes

HELPER = os.path.join(os.path.dirname(__file__), "helpers_sharding_matrix.py")

MODES = ("auto-1d", "auto-2d", "explicit-1d", "explicit-2d", "explicit_eager-1d",
         "explicit_eager-2d", "shard_map-1d", "shard_map-2d", "partial-2d", "partial_free-2d",
         "processes-1d")
KINDS = ("elementwise", "traceable", "undeclared", "replicate", "reduce", "pytree", "nondiff",
         "uneven", "size1")
TRANSFORMS = ("forward", "jvp", "vjp", "grad", "linearize", "linear_transpose", "vmap",
              "hessian", "scan", "checkpoint", "cond")
LINEAR = ("replicate", "reduce")  # declared linear (RowFFT) or multilinear (MatVec)

#: Modes that run only some cells, to keep the matrix within its time budget (each
#: mode still covers both lowerings, a reduction and an undeclared op).
SUBSETS = {
    "processes-1d": [(kind, transform) for kind in ("elementwise", "undeclared", "replicate",
                                                    "reduce", "pytree")
                     for transform in ("forward", "grad", "jvp", "vmap")],
    "partial_free-2d": [(kind, "forward") for kind in KINDS if kind != "undeclared"] +
                       [("elementwise", "grad"), ("reduce", "grad")],
}


def skip_reason(mode: str, kind: str, transform: str) -> str | None:
    """Why a cell makes no sense, or None."""
    if transform == "linear_transpose" and kind not in LINEAR:
        return f"linear_transpose needs an op declared linear or multilinear; {kind} is not"
    return None


# ---------------------------------------------------------------------------------------
# Known failures, of the library or of a JAX release: the cells stay in the matrix as
# strict xfails, so that a fix makes them fail until the mark is removed.
# ---------------------------------------------------------------------------------------

ONCE_PER_DEVICE = (
    "before JAX 0.9, over Explicit axes under jit, an undeclared op runs its rule on every "
    "device on gathered inputs (correct values; XLA cannot partition the run-once program)")
PARTIAL_AUTO_AXES = (
    "inside a shard_map manual over some mesh axes, a declared op is lowered as on one "
    "device: inputs split along the remaining Auto axes are all-gathered and its results "
    "lose that split")


JAX_08_PSUM_BATCHING = (
    "JAX 0.8 cannot batch a psum inside shard_map whose operand the batch does not reach "
    "(vmap, hessian): its batching rule hands psum an axis_index_groups it does not take "
    "(TypeError: _psum_invariant_abstract_eval() got an unexpected keyword argument "
    "'axis_index_groups'). The cell's own psum adds up the op's partial results; the same "
    "program in jax.numpy alone fails alike. JAX 0.7 and 0.9 run it")
#: The cells that meet it: (mode, kind, transform).
JAX_08_PSUM_CELLS = {("shard_map-1d", "reduce", "hessian"), ("shard_map-2d", "reduce", "vmap"),
                     ("shard_map-2d", "reduce", "hessian")}


def _explicit_reductions() -> bool:
    from jaxdecl import _compat

    return _compat.EXPLICIT_REDUCTIONS


def _jax_version() -> tuple:
    from jaxdecl import _compat

    return _compat.JAX_VERSION


def known_failure(mode: str, kind: str, transform: str) -> str | None:
    if mode.startswith("explicit-") and kind == "undeclared" and transform == "forward" \
            and not _explicit_reductions():
        return ONCE_PER_DEVICE
    if mode == "partial_free-2d":
        return PARTIAL_AUTO_AXES
    if (mode, kind, transform) in JAX_08_PSUM_CELLS and _jax_version()[:2] == (0, 8):
        return JAX_08_PSUM_BATCHING
    return None


def cells(mode: str) -> list:
    """Every (kind, transform) of `mode`, skipped ones included."""
    if mode in SUBSETS:
        return list(SUBSETS[mode])
    return [(kind, transform) for kind in KINDS for transform in TRANSFORMS]


def in_default(mode: str, kind: str, transform: str) -> bool:
    """The default run's cells: diagonals of the matrix, about one cell in six, so that
    each mode has most kinds and transforms (test_default_run_covers_...)."""
    if mode == "processes-1d":  # test_sharding.py's two-process test runs by default
        return False
    index = MODES.index(mode) + KINDS.index(kind) + TRANSFORMS.index(transform)
    if mode == "partial_free-2d":
        return (kind, transform) == ("elementwise", "forward")
    return index % 6 == 0


def _param(mode, kind, transform):
    marks = [needs_split]
    reason = skip_reason(mode, kind, transform)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    failure = known_failure(mode, kind, transform)
    if failure and not reason:
        marks.append(pytest.mark.xfail(strict=True, reason=failure))
    return pytest.param(mode, f"{kind}/{transform}", id=f"{mode}-{kind}-{transform}",
                        marks=marks)


def _params(default: bool) -> list:
    return [_param(mode, kind, transform) for mode in MODES for kind, transform in cells(mode)
            if not default or in_default(mode, kind, transform)]


# ---------------------------------------------------------------------------------------
# Running a group: the cells of one mode, in one subprocess (two for processes-1d)
# ---------------------------------------------------------------------------------------

def _runnable(mode: str, default: bool) -> list:
    return [f"{kind}/{transform}" for kind, transform in cells(mode)
            if not skip_reason(mode, kind, transform)
            and (not default or in_default(mode, kind, transform))]


def _run_group(mode: str, cells: list) -> dict:
    command = [sys.executable, HELPER, mode, ",".join(cells)]
    if mode != "processes-1d":
        return run_helper(command)
    results = run_two_processes(command, JAXDECL_TEST_DEVICES="2")
    # A cell passes when it passes in both processes (each checks its own shards).
    return {cell: True if all(r[cell] is True for r in results) else
            "; ".join(f"process {i}: {r[cell]}" for i, r in enumerate(results)
                      if r[cell] is not True) for cell in results[0]}


@functools.cache
def _group(mode: str, default: bool):
    """``{cell: True | what was seen}`` for the cells of `mode` in this run, or why the
    helper gave none (kept too: the group's other cells do not run it again)."""
    try:
        return _run_group(mode, _runnable(mode, default))
    except subprocess.TimeoutExpired:
        return f"the helper for {mode} timed out"
    except HelperFailed as error:
        return str(error)


def _check(mode: str, cell: str, default: bool) -> None:
    group = _group(mode, default)
    assert not isinstance(group, str), group
    assert group[cell] is True, f"{mode} {cell}: {group[cell]}"


@pytest.mark.parametrize("mode, cell", _params(default=True))
def test_sharding_cell(mode, cell):
    _check(mode, cell, default=True)


@pytest.mark.sharding_matrix
@pytest.mark.parametrize("mode, cell", _params(default=False))
def test_sharding_matrix(mode, cell):
    _check(mode, cell, default=False)


def test_default_run_covers_every_mode_kind_and_transform():
    """The default subset still has every mode (but processes, which test_sharding.py's
    two-process test covers by default), every kind and every transform, and under Auto
    axes both lowerings of a declared op."""
    chosen = [(m, k, t) for m in MODES for k, t in cells(m) if in_default(m, k, t)
              and not skip_reason(m, k, t)]
    assert {m for m, _, _ in chosen} == set(MODES) - {"processes-1d"}
    assert {k for _, k, _ in chosen} == set(KINDS)
    assert {t for _, _, t in chosen} == set(TRANSFORMS)
    for mode in MODES:
        if mode in SUBSETS:
            continue
        kinds = {k for m, k, _ in chosen if m == mode}
        transforms = {t for m, _, t in chosen if m == mode}
        assert len(kinds) >= 6 and len(transforms) >= 8, (mode, kinds, transforms)
    auto = {k for m, k, _ in chosen if m.startswith("auto-")}
    assert auto & {"elementwise", "traceable", "pytree"}, auto  # split by XLA itself
    assert auto & {"replicate", "reduce", "nondiff", "uneven", "size1"}, auto  # callback

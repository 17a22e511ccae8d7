"""What every check of one ``jd.check`` call reads: the op, its example inputs as flat
leaves, its interface there, the tolerances, and what the first checks found."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .._call import flatten_inputs
from .tolerances import Tolerances


@dataclasses.dataclass
class Case:
    """One op at one set of example inputs, as the checks see it."""

    spec: object  # the class's OpSpec
    op: object  # the instance
    leaves: list  # the example inputs' flat leaves, as NumPy arrays
    tree: object  # how the leaves make up the op's arguments
    signature: tuple  # per argument, its (shape, dtype) or TreeAval
    interface: object  # the op at this signature (_spec.interface.Interface)
    tolerances: Tolerances
    rng: np.random.Generator  # draws every random direction and cotangent
    eager: tuple = ()  # the op's outputs, run eagerly at `leaves`
    noise: tuple = ()  # per output leaf: max |eager - jit|, what two runs of it differ by

    def call(self, flat, wrapper=lambda f: f) -> tuple:
        """The op (through `wrapper`: ``jax.jit``, ``jax.vmap``) on flat input leaves;
        its flat output leaves."""
        args = self.tree.unflatten(list(flat))
        return tuple(jax.tree_util.tree_leaves(wrapper(self.op)(*args)))

    def flatten(self, flat) -> tuple:
        """``(operands, signature)`` of the op at other flat input leaves."""
        return flatten_inputs(self.spec, self.tree.unflatten(list(flat)))

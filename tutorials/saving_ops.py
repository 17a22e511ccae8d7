"""The ops of tutorial 11 (``11_saving.py``), in a module of their own.

A saved program names each op's class by module and name, and carries the
op's configuration by value. The process that loads the program imports this
module (and jaxdecl), and nothing else: jaxdecl rebuilds every op from what
the program carries. Not a tutorial itself: ``11_saving.py`` imports it.
"""

import dataclasses

import jax
import numpy as np

import jaxdecl as jd


@dataclasses.dataclass(frozen=True)
class Options:
    """Settings of `Weighted`: a dataclass of numbers saves by value."""

    power: int = 2
    scale: float = 1.0


class Weighted(jd.Primitive):
    """y = scale * w * x**power: configuration a NumPy array and a dataclass, saved as they are."""

    def __init__(self, weights, options=Options()):
        self.weights = np.asarray(weights, np.float32)
        self.options = options

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        p, s = self.options.power, self.options.scale
        np.multiply(s * self.weights, x**p, out=out, casting="unsafe")

    @jd.vjp
    def pull(self, x, ct):
        p, s = self.options.power, self.options.scale
        return (s * p * self.weights * x ** (p - 1) * ct).astype(x.dtype)


class Poly(jd.Primitive):
    """y = p(x) for a NumPy polynomial: an object with no saved form of its own.

    ``__getstate__`` says what to save (the coefficients) and ``__setstate__``
    rebuilds the op from it in the loading process, as ``pickle`` would. The
    derivative polynomial is derived state: rebuilt, never saved.
    """

    rebuilt = 0  # how many times __setstate__ ran in this process

    def __init__(self, coef):
        self.p = np.polynomial.Polynomial(coef)
        self.dp = self.p.deriv()

    def __getstate__(self):
        return {"coef": self.p.coef}  # a NumPy array: saved by value

    def __setstate__(self, state):
        type(self).rebuilt += 1
        self.__init__(state["coef"])

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        out[...] = self.p(x)

    @jd.vjp
    def pull(self, x, ct):
        return (self.dp(x) * ct).astype(x.dtype)

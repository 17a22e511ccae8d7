"""Callbacks that saved programs call (tests/test_callback_export.py): a user's module.

A process that loads a saved program imports this module: ``jd.pure_callback``
names its callback by module and name.
"""

import numpy as np


def damped_sin(x, *, rate):
    """sin(x) * exp(-rate * x): NumPy, with a keyword argument."""
    return np.sin(x) * np.exp(-rate * x)


def moments(x):
    """Two results: the sum and the sum of squares."""
    return np.sum(x), np.sum(x * x)


def damped_sin_derivative(x, *, rate):
    """The derivative of damped_sin in x."""
    return (np.cos(x) - rate * np.sin(x)) * np.exp(-rate * x)

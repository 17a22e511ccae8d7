"""Saved configurations (jaxdecl/_recipes.py): values round-trip by value, nothing else does."""

import dataclasses
import enum
import sys
import typing

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdecl import _recipes


class Color(enum.Enum):
    RED = 1


class Pair(typing.NamedTuple):
    a: int
    b: float


@dataclasses.dataclass(frozen=True)
class Frozen:
    n: int
    w: tuple


VALUES = [
    None, True, 3, -2**70, 0.1, float("inf"), 1 + 2j, "text", b"\x00\xff",
    np.float32(1.5), np.int8(-3), np.dtype("complex64"), np.dtype(ml_dtypes.bfloat16),
    np.arange(6.0).reshape(2, 3), np.array([1 + 1j], np.complex64), np.zeros((0, 2), np.int32),
    np.arange(3).astype(ml_dtypes.bfloat16),
    (1, (2.0, "x")), [1, [2]], {"k": 1, 2: "v"}, {1, 2}, frozenset({"a"}),
    Color.RED, Pair(1, 2.0), Frozen(3, (1.0,)), np.sin, Frozen,
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_round_trip_exactly(value):
    back = _recipes.decode(_recipes.encode(value, "Op", "Op.x"))
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and back.shape == value.shape
        np.testing.assert_array_equal(back, value)
    else:
        assert back == value or (back is value)


def test_jax_arrays_come_back_as_numpy():
    back = _recipes.decode(_recipes.encode(jnp.arange(3.0), "Op", "Op.x"))
    assert isinstance(back, np.ndarray) and back.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("value", [object(), lambda x: x, np.array([object()]), {1: object()}])
def test_what_has_no_saved_form_is_named(value):
    with pytest.raises(_recipes.Unsaveable) as caught:
        _recipes.encode({"inner": value}, "Op", "Op.config")
    assert caught.value.where.startswith("Op.config[")


def test_restoring_never_imports():
    data = _recipes.encode(Frozen(1, ()), "Op", "Op.x")
    data[1] = "a_module_nobody_imported:Frozen"
    with pytest.raises(_recipes.ExportError, match="import a_module_nobody_imported"):
        _recipes.decode(data)
    assert "a_module_nobody_imported" not in sys.modules

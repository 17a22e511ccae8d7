"""Declaring a primitive: ``jd.Primitive``, its metaclass and ``@jd.primitive``.

A class becomes a jaxdecl primitive by marking methods with the decorators of
:mod:`jaxdecl._spec.rules`. The marks are collected into an
:class:`~jaxdecl._spec.declaration.OpSpec` when the class is created
(:func:`~jaxdecl._spec.declaration.build_spec`), and a misdeclared class is
rejected there, naming the class and the method, long before anything is
traced. Calling an instance is :func:`jaxdecl._call.apply_op`.
"""

from __future__ import annotations

from typing import Any

from ._call import apply_op
from ._errors import DeclarationError
from ._spec.declaration import SHARDING_OPTIONS, build_spec
from ._spec.rules import rule_of

#: ``op(*args, **kwargs)``: the primitive applied to JAX arrays, NumPy arrays or Python
#: scalars (no wrapper frame: this is on the path of every eager call).
_op_call = apply_op


def _install(cls, options: dict[str, Any]):
    spec = build_spec(cls, options)
    cls.__jaxdecl_spec__ = spec
    return cls


_RULES_AND_OPTIONS = """
    A class declares one op: mark its methods with the rule decorators below;
    the op's inputs are the parameters of ``@abstract`` after ``self``
    (``x1, x2`` here). Instances are the ops, ``Mul()(x1, x2)``; static
    configuration (axes, flags, thread counts) is set in ``__init__``, and
    instances with equal configuration share compiled code. The class is
    checked when it is created: a misdeclared one raises
    :class:`~jaxdecl.DeclarationError` naming the method and the fix.

    Decorators:
        ``@jd.abstract`` ``(self, x1, x2)``
            Required. The outputs' shapes and dtypes from the inputs': each
            input arrives as a ``jax.ShapeDtypeStruct``; return one, a tuple
            of them, or a pytree of them.
        ``@jd.forward`` ``(self, x1, x2)`` or ``(self, x1, x2, *, out)``
            Required. The result(s), computed on read-only NumPy views of XLA's
            buffers; the zero-copy form fills ``out`` and returns None. With
            ``@jd.residuals`` it also takes ``*, saved=None``.
        ``@jd.jvp`` ``(self, x1, x2, dx1, dx2)``
            Forward mode: the output tangent(s), from one tangent per
            differentiable input. ``@jd.jvp(traceable=True)``: a rule written
            with ``jax.numpy`` that JAX differentiates again;
            ``@jd.jvp(zeros=True)``: a zero tangent arrives as None. It may
            add the keyword-only ``result`` (the forward's output) and
            ``saved`` (the residuals).
        ``@jd.vjp`` ``(self, x1, x2, ct)``
            Reverse mode: the input cotangent(s), from one cotangent per
            floating output. ``traceable=True``, ``result`` and ``saved`` as
            for ``@jvp``; the keyword-only ``wanted`` (a bool per
            differentiable input) says which cotangents are asked for.
        ``@jd.transpose`` ``(self, <inputs it is not linear in>, ct)``
            A linear op's transpose: the cotangent(s) of its linear inputs
            (``wanted`` as for ``@vjp``). A multilinear op has one
            ``@jd.transpose(wrt="x1")`` taking ``(self, <inputs but x1>, ct)``
            per differentiable input.
        ``@jd.adjoint`` ``(self, <inputs it is not linear in>, y)``
            A linear op's conjugate transpose A^H y, instead of ``@transpose``.
        ``@jd.batch`` ``(self, args, axes)``
            ``vmap`` at trace time, on JAX values: returns
            ``(outputs, out_axes)``. Without it, ``batch=`` decides.
        ``@jd.sharding`` ``(self, x1, x2)``
            The sharding declaration as a method, from the inputs' shapes:
            returns a :class:`~jaxdecl.ShardingRule`.
        ``@jd.residuals`` ``(self, x1, x2)``
            What the forward keeps for the derivative rules, from the inputs'
            shapes: a pytree of ``jax.ShapeDtypeStruct``. The ``@forward``
            then takes ``*, saved=None`` and fills it when a derivative
            follows, so that the forward runs once per derivative.

    Class options:
        ``linear=True``
            Linear in its differentiable inputs jointly: needs ``@transpose``
            (or ``@adjoint``) and no ``@jvp``/``@vjp``; every derivative order
            follows.
        ``linear=("c",)``
            Linear in the named inputs jointly, differentiable in the others
            through ``@jvp``/``@vjp``: derivatives in the linear inputs run
            ``@forward`` and ``@transpose``.
        ``multilinear=True``
            Linear in each differentiable input separately (``x1 * x2``): one
            ``@transpose(wrt=...)`` per differentiable input.
        ``nondiff=("theta", ...)``
            Inputs never differentiated (coordinates, geometry); integer and
            bool inputs never are anyway.
        ``batch="loop"`` (default) or ``batch="vectorized"``
            How ``vmap`` reaches the NumPy rules when there is no ``@batch``:
            once per batch element inside one XLA call, or once with leading
            batch dims on every input and output.
        ``sharding="b n, n -> b n"``
            How the forward's dims relate, one factor name per dim: the rules
            may run per device on slices along each named factor. Verify every
            declaration with :func:`~jaxdecl.check`.
        ``replicate=("n",)``
            Factors the rules need whole (gathered first when split).
        ``reduce=("k",)``
            Factors the rules sum over (partial results are added up).
        ``residuals={"lu": "b n m"}``
            The residuals' factors, a pytree of factor strings shaped like
            ``@jd.residuals``' result, so that each device keeps those of its
            own block.
"""


class PrimitiveMeta(type):
    """Metaclass of :class:`Primitive`: collects and validates the rules at class creation.

    Options arrive as class keywords, ``class Op(jd.Primitive, linear=True)``,
    and a subclass inherits its parent's rules and options (a new
    ``sharding=`` replaces the parent's ``replicate=``/``reduce=`` too).
    Classes that have a metaclass of their own use :func:`primitive` instead.

    Example:
        >>> import jax, jaxdecl as jd
        >>> class Double(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return 2 * x
        >>> type(Double) is jd.PrimitiveMeta
        True
        >>> class Quadruple(Double):  # rules are inherited; a method override keeps its role
        ...     def apply(self, x):
        ...         return 4 * x
        >>> float(Quadruple()(1.0))
        4.0
    """

    def __new__(mcls, name, bases, namespace, **options):
        cls = super().__new__(mcls, name, bases, namespace)
        if namespace.get("__jaxdecl_base__", False):
            return cls
        # A subclass inherits its parent's options unless it gives its own. A new
        # sharding declaration (sharding= or a @jd.sharding method) replaces the
        # whole declaration: the parent's replicate=/reduce= describe its factors.
        inherited = dict(getattr(cls, "__jaxdecl_options__", {}))
        if "sharding" in options or any(
                getattr(rule_of(value), "kind", None) == "sharding"
                for value in namespace.values()):
            for key in SHARDING_OPTIONS:
                inherited.pop(key, None)
        inherited.update(options)
        cls.__jaxdecl_options__ = inherited
        return _install(cls, inherited)

    def __init__(cls, name, bases, namespace, **options):
        super().__init__(name, bases, namespace)


class Primitive(metaclass=PrimitiveMeta):
    __jaxdecl_base__ = True
    __call__ = _op_call


Primitive.__doc__ = """Base class of jaxdecl primitives: subclass it and decorate methods.

    Options are class keywords: ``class Scale(jd.Primitive, linear=True)``.
""" + _RULES_AND_OPTIONS + """
    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
        >>> class Mul(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x1, x2):
        ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
        ...     @jd.forward
        ...     def apply(self, x1, x2, *, out):
        ...         np.multiply(x1, x2**2, out=out)
        ...     @jd.vjp
        ...     def pull(self, x1, x2, ct):
        ...         return x2**2 * ct, 2 * x1 * x2 * ct
        >>> mul = Mul()
        >>> mul(jnp.ones(2), jnp.full(2, 3.0)).tolist()
        [9.0, 9.0]
        >>> jax.grad(lambda a: mul(a, jnp.full(2, 3.0)).sum())(jnp.ones(2)).tolist()
        [9.0, 9.0]
    """


def primitive(cls=None, **options):
    def decorate(klass):
        if not isinstance(klass, type):
            raise TypeError(f"@jd.primitive decorates a class, got {klass!r}")
        if "__call__" in vars(klass):
            raise DeclarationError(
                f"{klass.__name__} defines __call__; @jd.primitive makes instances callable "
                f"as the op, so remove it (or call the op from another method)"
            )
        klass.__call__ = _op_call
        klass.__jaxdecl_options__ = dict(options)
        return _install(klass, options)

    return decorate if cls is None else decorate(cls)


primitive.__doc__ = """The class decorator form of :class:`Primitive`: for any class, any metaclass.

    Adds ``__call__`` and leaves the class's metaclass alone, so it works on
    plain classes, ``equinox.Module`` and ``nifty.re.Model`` subclasses (which
    cannot also take :class:`Primitive`'s metaclass). Options are the
    decorator's arguments: ``@jd.primitive(linear=True)``; without options,
    ``@jd.primitive`` alone.
""" + _RULES_AND_OPTIONS + """
    Example:
        >>> import equinox as eqx, jax, numpy as np, jaxdecl as jd
        >>> @jd.primitive(nondiff=("coords",))
        ... class Sample(eqx.Module):
        ...     order: int = 1  # a field of the module: the op's configuration
        ...     @jd.abstract
        ...     def shapes(self, values, coords):
        ...         return jax.ShapeDtypeStruct(coords.shape, values.dtype)
        ...     @jd.forward
        ...     def apply(self, values, coords):
        ...         return values[coords.astype(int)]
        ...     @jd.vjp
        ...     def pull(self, values, coords, ct):
        ...         grad = np.zeros_like(values)
        ...         np.add.at(grad, coords.astype(int), ct)
        ...         return grad
        >>> op = Sample()
        >>> op(jax.numpy.arange(4.0), jax.numpy.array([3.0, 1.0])).tolist()
        [3.0, 1.0]
        >>> jax.grad(lambda v: op(v, jax.numpy.array([3.0, 3.0])).sum())(
        ...     jax.numpy.zeros(4)).tolist()
        [0.0, 0.0, 0.0, 2.0]
    """

"""The rule decorators users write: ``@jd.abstract``, ``@jd.forward``, ``@jd.jvp`` and the rest.

Each marks a method with the role it plays in an op (a :class:`~jaxdecl._spec.rules.Rule`)
and returns it unchanged; :mod:`jaxdecl._spec.rules` makes them and collects the marks.
Here are their public faces: what each decorator's ``help()`` and the API reference show.

Example:
    >>> import jaxdecl as jd
    >>> from jaxdecl._spec.rules import rule_of
    >>> class Copy:
    ...     @jd.forward(platform="gpu")
    ...     def apply_gpu(self, x, *, out, stream):
    ...         pass
    >>> rule = rule_of(Copy.apply_gpu)
    >>> rule.kind, rule.platform, rule.zero_copy
    ('forward', 'gpu', True)
"""

from __future__ import annotations

from .rules import make_decorator

abstract = make_decorator("abstract", """Marks the shape rule: input structs -> output struct(s).

Inputs arrive as ``jax.ShapeDtypeStruct``; return one, or a tuple of them.

Example:
    >>> import jax, jaxdecl as jd
    >>> class Double(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return 2 * x
    >>> float(Double()(1.5))
    3.0
""")

forward = make_decorator("forward", """Marks the evaluation rule, run on views of XLA's buffers.

Either return the result array(s), or take a keyword-only ``out`` (an array,
or a tuple of them) and fill it in place (zero-copy form).

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Square(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x, *, out):
    ...         np.multiply(x, x, out=out)
    >>> float(Square()(3.0))
    9.0

With ``platform="gpu"`` it marks a device rule: on a GPU, the rule receives
device arrays (``__cuda_array_interface__``, ``__dlpack__``) and XLA's stream
as the keyword ``stream``, instead of host copies; the rule without
``platform=`` serves the CPU. The same keyword marks the device form of every
rule below that runs on buffers.
""", platform_ok=True)

jvp = make_decorator("jvp", """Marks the forward-mode rule ``(self, *inputs, *tangents)``.

Returns the output tangent(s).

One tangent arrives per differentiable input (floating or complex, not in
``nondiff=``), in input order; one is returned per floating/complex output, bare
when there is exactly one (an op with outputs ``(distance, index)`` returns just
the distance's tangent). Pytree inputs and outputs get pytree tangents, with
``None`` at integer leaves. With ``traceable=True`` the rule receives and
returns JAX values and is differentiated again by JAX (higher order).

With ``zeros=True`` a tangent that is symbolically zero (an input not
differentiated: ``jax.grad(f, argnums=0)``, ``jax.jvp`` with a zero tangent
of a constant) arrives as ``None``, never as an array of zeros, and the rule
may return ``None`` for an output tangent that is zero. Each set of present
tangents is an equation of its own, so XLA never computes the tangent of an
input nobody differentiates.

Example:
    >>> import jax, jaxdecl as jd
    >>> class Sin(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         import numpy as np; return np.sin(x)
    ...     @jd.jvp(traceable=True)
    ...     def push(self, x, dx):
    ...         return jax.numpy.cos(x) * dx
    >>> round(float(jax.grad(Sin())(0.0)), 6)
    1.0
    >>> class Mul(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x1, x2):
    ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
    ...     @jd.forward
    ...     def apply(self, x1, x2):
    ...         return x1 * x2
    ...     @jd.jvp(zeros=True)
    ...     def push(self, x1, x2, dx1, dx2):  # None: a symbolically zero tangent
    ...         return (0 if dx1 is None else x2 * dx1) + (0 if dx2 is None else x1 * dx2)
    >>> float(jax.jvp(lambda a: Mul()(a, 3.0), (2.0,), (1.0,))[1])
    3.0
""", traceable_ok=True, zeros_ok=True, platform_ok=True)

vjp = make_decorator("vjp", """Marks the reverse-mode rule ``(self, *inputs, *cotangents)``.

Returns the input cotangent(s).

One cotangent arrives per floating/complex output; one is returned per
differentiable input (a tuple if several), where ``None`` stands for zero (a
whole cotangent or a subtree of a pytree one). Returns Jᵀ·ct, not conjugated.

A rule that takes the keyword-only ``wanted`` receives one bool per
differentiable input, True where that input's cotangent is asked for
(``jax.grad(f, argnums=0)`` asks for the first alone), and may return
``None`` where it is False: XLA then neither computes nor stores it.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Cube(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return x**3
    ...     @jd.vjp
    ...     def pull(self, x, ct):
    ...         return 3 * x**2 * ct
    >>> float(jax.grad(Cube())(2.0))
    12.0
    >>> class Mul(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x1, x2):
    ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
    ...     @jd.forward
    ...     def apply(self, x1, x2):
    ...         return x1 * x2
    ...     @jd.vjp
    ...     def pull(self, x1, x2, ct, *, wanted):  # wanted: (True, False) under argnums=0
    ...         return (x2 * ct if wanted[0] else None), (x1 * ct if wanted[1] else None)
    >>> float(jax.grad(Mul(), argnums=0)(2.0, 3.0))
    3.0
""", traceable_ok=True, platform_ok=True)

transpose = make_decorator("transpose", """Marks the transpose of a linear or multilinear op.

Linear op: ``(self, *other_inputs, *cotangents) -> cotangent(s) of the linear inputs``,
where the other inputs are every input the op is not linear in, in input order:
the ``nondiff=`` and integer ones, and for a partly linear op
(``linear=("strengths",)``) also the differentiable ones it is not linear in.
Multilinear op: ``@jd.transpose(wrt="x")`` with ``(self, *inputs_but_x, ct) -> ct_x``.

A linear op's transpose that takes the keyword-only ``wanted`` receives one
bool per linear input, True where its cotangent is asked for, and may return
``None`` where it is False.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Scale(jd.Primitive, linear=True):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return 3 * x
    ...     @jd.transpose
    ...     def apply_t(self, ct):
    ...         return 3 * ct
    >>> float(jax.grad(Scale())(1.0))
    3.0
""", wrt_ok=True, platform_ok=True)

adjoint = make_decorator("adjoint", """Marks the conjugate transpose Aᴴy of a linear op.

An alternative to ``@transpose``.

jaxdecl derives the transpose as ``conj(adjoint(conj(ct)))``; handy for
libraries (FFTs, DUCC) that provide adjoints.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Rotate(jd.Primitive, linear=True):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return 1j * x
    ...     @jd.adjoint
    ...     def apply_h(self, y):
    ...         return -1j * y
    >>> complex(jax.linear_transpose(Rotate(), 1j)(1.0 + 0j)[0]) == 1j
    True
""", platform_ok=True)

batch = make_decorator("batch", """Marks a trace-time batching rule ``(self, args, axes)``.

Returns ``(outputs, out_axes)``.

`args` are JAX values, `axes` their batch axis (an int, or None when not
batched). The rule may call any op, typically a reconfigured instance of the
same class that folds the batch into a native axis.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Neg(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return -x
    ...     @jd.batch
    ...     def batched(self, args, axes):
    ...         return self(*args), axes[0]
    >>> jax.vmap(Neg())(jnp.ones(2)).tolist()
    [-1.0, -1.0]
""")

sharding = make_decorator("sharding", """Marks the method that says how the op splits on devices.

It sees the inputs as ``jax.ShapeDtypeStruct`` (as ``@abstract`` does) and
returns a :class:`~jaxdecl.ShardingRule`; use it when the rule depends on the
configuration or the shapes, instead of the class options ``sharding=``,
``replicate=`` and ``reduce=``.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Cumsum(jd.Primitive):
    ...     def __init__(self, axis):
    ...         self.axis = axis
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return np.cumsum(x, axis=self.axis)
    ...     @jd.sharding
    ...     def split(self, x):
    ...         dims = [f"d{i}" for i in range(x.ndim)]
    ...         rule = " ".join(dims) + " -> " + " ".join(dims)
    ...         return jd.ShardingRule(rule, replicate=(dims[self.axis],))
    >>> Cumsum(1)(np.ones((2, 3))).tolist()
    [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
""")


residuals = make_decorator("residuals", """Marks the method that declares what the forward keeps.

It sees the inputs as ``jax.ShapeDtypeStruct`` (as ``@abstract`` does) and
returns a pytree of them, any dtype. The ``@forward`` then takes a
keyword-only ``saved``: writable views of those arrays to fill when a
derivative follows, ``None`` on a plain call (nothing is allocated then). A
``@jvp`` or ``@vjp`` that adds the keyword-only ``saved`` receives them, read
only; one that adds ``result`` receives the forward's output. Under ``grad``,
``vjp``, ``jvp`` and ``linearize`` the forward then runs once per evaluation.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> class Normalize(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.residuals
    ...     def keeps(self, x):
    ...         return {"norm": jax.ShapeDtypeStruct((), x.dtype)}
    ...     @jd.forward
    ...     def apply(self, x, *, saved=None):
    ...         norm = np.linalg.norm(x)
    ...         if saved is not None:
    ...             saved["norm"][...] = norm
    ...         return x / norm
    ...     @jd.vjp
    ...     def pull(self, x, ct, *, saved, result):
    ...         return (ct - result * np.dot(result, ct)) / saved["norm"]
    >>> [round(float(g), 3) for g in jax.grad(lambda x: Normalize()(x)[0])(jnp.array([3.0, 4.0]))]
    [0.128, -0.096]
""")

# Made in jaxdecl._spec.rules; named this module's, where doctest and help() look for them.
for _decorator in (abstract, forward, jvp, vjp, transpose, adjoint, batch, sharding, residuals):
    _decorator.__module__ = __name__
del _decorator

"""Derivatives.

``@jvp``/``@vjp`` rules for a nonlinear op (traceable, for Hessians),
``@transpose`` for a linear FFT op, whose derivatives of every order then come
for free, and both for a partly linear op (a sum of sines, linear in its
amplitudes, smooth in its frequencies), whose rules see which tangents are
zero and which cotangents are wanted. Each result is printed next to the same
computation written in pure ``jax.numpy``.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

jax.config.update("jax_enable_x64", True)


def show(label, ours, reference):
    """Prints a result next to its jax.numpy reference and checks they agree."""
    ours, reference = np.asarray(ours), np.asarray(reference)
    print(
        f"{label}:\n  jaxdecl   {np.round(ours, 6).tolist()}\n"
        f"  jax.numpy {np.round(reference, 6).tolist()}"
    )
    np.testing.assert_allclose(ours, reference, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# 1. A nonlinear op: y = sin(x) * x
# ---------------------------------------------------------------------------
# The forward is NumPy. @jvp maps input tangents to output tangents (forward mode:
# jax.jvp, jacfwd); @vjp maps output cotangents to input cotangents (reverse mode:
# grad, jacrev). With traceable=True a rule is written in jax.numpy, so JAX can
# differentiate it once more: that is what hessian needs.


class SinTimes(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return np.sin(x) * x

    @jd.jvp(traceable=True)
    def push(self, x, dx):
        return (jnp.cos(x) * x + jnp.sin(x)) * dx

    @jd.vjp(traceable=True)
    def pull(self, x, ct):
        return (jnp.cos(x) * x + jnp.sin(x)) * ct


sin_times = SinTimes()
x = np.array([0.3, 1.0, 2.5])
loss = lambda x: jnp.sum(sin_times(x) ** 2)
loss_ref = lambda x: jnp.sum((jnp.sin(x) * x) ** 2)

show("grad", jax.grad(loss)(x), jax.grad(loss_ref)(x))
t = np.array([1.0, 0.0, -1.0])
show(
    "jvp tangent",
    jax.jvp(sin_times, (x,), (t,))[1],
    jax.jvp(lambda x: jnp.sin(x) * x, (x,), (t,))[1],
)
show("hessian (under jit)", jax.jit(jax.hessian(loss))(x), jax.hessian(loss_ref)(x))

# ---------------------------------------------------------------------------
# 2. A linear op: the FFT through numpy.fft
# ---------------------------------------------------------------------------
# linear=True says the op is linear in its inputs. Then one more rule, @transpose
# (Aᵀ ct, non-conjugated, as jax.vjp), gives every derivative of every order.
# The DFT matrix is symmetric, so the transpose of the FFT is the FFT itself.
# (@jd.adjoint instead takes Aᴴ y, here n * ifft(y), if that is what you have.)


class FFT(jd.Primitive, linear=True):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, np.result_type(x.dtype, np.complex64))

    @jd.forward
    def apply(self, x):
        return np.fft.fft(x).astype(np.result_type(x.dtype, np.complex64))

    @jd.transpose
    def transposed(self, ct):
        return np.fft.fft(ct)


fft = FFT()
x = np.array([1.0, 2.0, 0.5, -1.0])
power = lambda x: jnp.sum(jnp.abs(fft(x)) ** 2 * x)
power_ref = lambda x: jnp.sum(jnp.abs(jnp.fft.fft(x)) ** 2 * x)

show("grad of sum(|fft x|^2 x)", jax.grad(power)(x), jax.grad(power_ref)(x))
ct = np.array([1.0, 1j, -1.0, 0.5 - 0.5j])
xc = x.astype(np.complex128)
show(
    "linear_transpose of fft",
    jax.linear_transpose(fft, xc)(ct)[0],
    jax.linear_transpose(jnp.fft.fft, xc)(ct)[0],
)
show("hessian (under jit)", jax.jit(jax.hessian(power))(x), jax.hessian(power_ref)(x))

# ---------------------------------------------------------------------------
# 3. A partly linear op: y(t) = sum_j a_j sin(w_j t), linear in a, smooth in w
# ---------------------------------------------------------------------------
# linear=("a",) names the inputs the op is linear in; the others stay
# differentiable. @transpose takes the other inputs (w), then the cotangent, and
# returns the cotangent of a: derivatives in a alone run the forward and the
# transpose, never @jvp/@vjp. @jvp covers w; with zeros=True a tangent that is
# zero arrives as None (jvp in w alone: da is None), and @vjp's `wanted` says
# which cotangents grad asks for.

T = np.linspace(0.0, 1.0, 5)  # the sample times: configuration, fixed
calls = []


class Sines(jd.Primitive, linear=("a",)):
    @jd.abstract
    def shapes(self, w, a):
        return jax.ShapeDtypeStruct(T.shape, a.dtype)

    @jd.forward
    def apply(self, w, a):
        return np.sin(np.outer(T, w)) @ a

    @jd.transpose
    def apply_t(self, w, ct):
        calls.append("transpose")
        return np.sin(np.outer(T, w)).T @ ct

    @jd.jvp(traceable=True, zeros=True)
    def push(self, w, a, dw, da):
        out = 0.0
        if dw is not None:  # d/dw_j of a_j sin(w_j t) is a_j t cos(w_j t)
            out = out + T * (jnp.cos(jnp.outer(T, w)) @ (a * dw))
        if da is not None:  # linear in a: the op itself
            out = out + self(w, da)
        return out

    @jd.vjp
    def pull(self, w, a, ct, *, wanted):
        calls.append(f"vjp {wanted}")
        dw = a * (np.cos(np.outer(T, w)).T @ (T * ct)) if wanted[0] else None
        return dw, (np.sin(np.outer(T, w)).T @ ct if wanted[1] else None)


sines = Sines()
w, a = np.array([1.0, 3.0, 7.0]), np.array([0.5, -1.0, 2.0])
fit = lambda w, a: jnp.sum((sines(w, a) - 1.0) ** 2)
fit_ref = lambda w, a: jnp.sum((jnp.sin(jnp.outer(T, w)) @ a - 1.0) ** 2)

show("grad in a (forward and transpose)", jax.grad(fit, 1)(w, a), jax.grad(fit_ref, 1)(w, a))
show("grad in w (vjp asked for w)", jax.grad(fit, 0)(w, a), jax.grad(fit_ref, 0)(w, a))
print("rules run:", calls)
show("hessian in (w, a) (under jit)", jax.jit(jax.hessian(fit, (0, 1)))(w, a)[0][1],
     jax.hessian(fit_ref, (0, 1))(w, a)[0][1])

# Before trusting a new op, let jd.check test every rule (finite differences,
# dot-product tests, jit, vmap): it raises an AssertionError naming the wrong rule.
jd.check(sin_times, x)
jd.check(fft, xc)
jd.check(sines, w, a)
print("jd.check passed for the three ops")

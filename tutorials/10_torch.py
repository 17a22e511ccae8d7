# requires: torch (pip install ".[torch]")
"""PyTorch.

``torch.nn.functional.cross_entropy`` as a jaxdecl op whose derivative rules
are written with ``torch.func``: first rerunning PyTorch's forward in every
derivative, then keeping what the forward computed (``@jd.residuals``), so
that ``jax.grad`` runs PyTorch's forward once per gradient step. A PyTorch user
computes a loss and calls ``loss.backward()``: one forward, one backward.
Declared naively, a JAX primitive's ``@vjp`` only sees the inputs, so it must
run PyTorch's forward again (``torch.func.vjp``). Every value is compared with
the same loss written in ``jax.numpy``. Needs ``pip install ".[torch]"``; the
CPU build of PyTorch is enough, and much smaller than PyPI's default CUDA build:
``pip install torch --index-url https://download.pytorch.org/whl/cpu`` first.
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import jaxdecl as jd

torch.set_num_threads(1)
CALLS = {"torch forward": 0}


def tensor(x):
    """A torch tensor on the same memory as the NumPy view of XLA's buffer (no copy).

    The rules' inputs are read-only views; PyTorch warns that it cannot mark a
    tensor read-only. Nothing here writes to them.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


class CrossEntropyRerun(jd.Primitive):
    """F.cross_entropy(logits, labels), with rules that run PyTorch's forward again.

    Inputs: ``logits`` (N, C) float and ``labels`` (N,) int (an integer input:
    never differentiated). Configuration: ``reduction`` ("mean", "sum" or
    "none") and ``label_smoothing``, as PyTorch's own arguments.
    """

    def __init__(self, reduction="mean", label_smoothing=0.0):
        self.reduction = reduction
        self.label_smoothing = float(label_smoothing)

    def loss(self, logits, labels):
        """The PyTorch computation, on tensors (labels as int64, as PyTorch wants)."""
        CALLS["torch forward"] += 1
        return F.cross_entropy(logits, labels.long(), reduction=self.reduction,
                               label_smoothing=self.label_smoothing)

    @jd.abstract
    def shapes(self, logits, labels):
        shape = logits.shape[:1] if self.reduction == "none" else ()
        return jax.ShapeDtypeStruct(shape, logits.dtype)

    @jd.forward
    def apply(self, logits, labels):
        return self.loss(tensor(logits), tensor(labels)).numpy()

    @jd.jvp
    def push(self, logits, labels, dlogits):
        _, tangent = torch.func.jvp(lambda z: self.loss(z, tensor(labels)),
                                    (tensor(logits),), (tensor(dlogits),))
        return tangent.numpy()

    @jd.vjp
    def pull(self, logits, labels, ct):
        _, pullback = torch.func.vjp(lambda z: self.loss(z, tensor(labels)), tensor(logits))
        return pullback(tensor(ct))[0].numpy()


class CrossEntropy(CrossEntropyRerun):
    """The same op, its forward keeping d loss / d logits for the derivative rules.

    When a derivative follows, the forward runs PyTorch once through
    ``torch.func.vjp`` and pulls back ones: that is what ``loss.backward()``
    computes, the gradient of the loss with respect to the logits. Each
    sample's loss depends only on its own row of logits, so for
    ``reduction="none"`` the same array holds every sample's gradient row.
    The derivative rules then need no PyTorch at all.
    """

    @jd.residuals
    def keeps(self, logits, labels):
        return {"grad": jax.ShapeDtypeStruct(logits.shape, logits.dtype)}

    @jd.forward
    def apply(self, logits, labels, *, saved=None):
        logits, labels = tensor(logits), tensor(labels)
        if saved is None:  # a plain call: the loss alone, nothing kept
            return self.loss(logits, labels).numpy()
        loss, pullback = torch.func.vjp(lambda z: self.loss(z, labels), logits)
        saved["grad"][...] = pullback(torch.ones_like(loss))[0].numpy()
        return loss.numpy()

    @jd.jvp
    def push(self, logits, labels, dlogits, *, saved):
        per_row = np.sum(saved["grad"] * dlogits, axis=-1)
        return per_row if self.reduction == "none" else np.sum(per_row)

    @jd.vjp
    def pull(self, logits, labels, ct, *, saved):
        return (ct[:, None] if self.reduction == "none" else ct) * saved["grad"]


def cross_entropy_reference(logits, labels, reduction="mean", label_smoothing=0.0):
    """The same loss in jax.numpy (PyTorch's definition, label smoothing included)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]
    losses = (1 - label_smoothing) * nll - label_smoothing * jnp.mean(logp, axis=-1)
    return {"none": losses, "sum": jnp.sum(losses), "mean": jnp.mean(losses)}[reduction]


rng = np.random.default_rng(10)
n_samples, n_features, n_classes = 64, 5, 4
features = jnp.asarray(rng.standard_normal((n_samples, n_features)), jnp.float32)
true_weights = rng.standard_normal((n_features, n_classes))
labels = jnp.asarray(np.argmax(features @ true_weights, axis=1), jnp.int32)
logits = jnp.asarray(rng.standard_normal((n_samples, n_classes)), jnp.float32)

print("== 1. The op against the jax.numpy reference, eager and jitted, every reduction")
for reduction, smoothing in [("mean", 0.0), ("sum", 0.1), ("none", 0.0)]:
    op = CrossEntropy(reduction, smoothing)
    ours = op(logits, labels)
    ref = cross_entropy_reference(logits, labels, reduction, smoothing)
    print(f"{reduction:4s} (label_smoothing={smoothing}): torch {np.asarray(ours).ravel()[:3]}, "
          f"jnp {np.asarray(ref).ravel()[:3]}")
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(op)(logits, labels), ref, rtol=1e-5, atol=1e-6)

print("\n== 2. grad: PyTorch's forward runs twice without residuals, once with them")
for op_class in (CrossEntropyRerun, CrossEntropy):
    op = op_class(label_smoothing=0.05)
    CALLS["torch forward"] = 0
    value, grad = jax.block_until_ready(jax.jit(jax.value_and_grad(op))(logits, labels))
    ref_value, ref_grad = jax.value_and_grad(cross_entropy_reference)(logits, labels, "mean",
                                                                      0.05)
    print(f"{op_class.__name__:17s}: {CALLS['torch forward']} PyTorch forward(s) for one "
          f"value_and_grad, loss {float(value):.6f} (jnp {float(ref_value):.6f})")
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert CALLS["torch forward"] == (2 if op_class is CrossEntropyRerun else 1)

print("\n== 3. Forward mode and per-sample losses: jvp and vjp reuse the kept gradient")
op = CrossEntropy("none")
direction = jnp.asarray(rng.standard_normal(logits.shape), jnp.float32)
CALLS["torch forward"] = 0
_, tangent = jax.jvp(lambda z: op(z, labels), (logits,), (direction,))
_, ref_tangent = jax.jvp(lambda z: cross_entropy_reference(z, labels, "none"), (logits,),
                         (direction,))
np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-4, atol=1e-5)
weights = jnp.linspace(0.0, 1.0, n_samples, dtype=jnp.float32)
_, pullback = jax.vjp(lambda z: op(z, labels), logits)
_, ref_pullback = jax.vjp(lambda z: cross_entropy_reference(z, labels, "none"), logits)
np.testing.assert_allclose(pullback(weights)[0], ref_pullback(weights)[0], rtol=1e-4,
                           atol=1e-6)
print(f"jvp and vjp agree with jax.numpy; PyTorch forwards: {CALLS['torch forward']} "
      f"(one each)")
assert CALLS["torch forward"] == 2

print("\n== 4. Training a linear classifier in JAX on PyTorch's loss")
loss_op = CrossEntropy()


@jax.jit
def step(params, learning_rate=0.5):
    def loss(params):
        return loss_op(features @ params["w"] + params["b"], labels)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), value


params = {"w": jnp.zeros((n_features, n_classes), jnp.float32),
          "b": jnp.zeros(n_classes, jnp.float32)}
CALLS["torch forward"] = 0
history = []
for _ in range(50):
    params, value = step(params)
    history.append(float(value))
accuracy = float(jnp.mean(jnp.argmax(features @ params["w"] + params["b"], 1) == labels))
print(f"loss {history[0]:.4f} -> {history[-1]:.4f}, training accuracy {accuracy:.2f}, "
      f"{CALLS['torch forward']} PyTorch forwards for {len(history)} steps")
assert history[-1] < 0.5 * history[0] and accuracy > 0.8
assert CALLS["torch forward"] == len(history)

print("\n== 5. jd.check reviews the rules that read what the forward kept")
jd.check(CrossEntropy("none", 0.1), np.asarray(logits[:6]), np.asarray(labels[:6]))
print("jd.check passed for CrossEntropy")

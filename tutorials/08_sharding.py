"""Sharding.

Declare once how an op splits (``sharding=``, ``replicate=``, ``reduce=``) and
it runs per shard under ``jit``, with gradients, inside ``shard_map``, with
explicit mesh axes and across processes; XLA gathers nothing. Runs on 4 host CPU
devices, which it asks XLA for below (before JAX is imported); its last part
starts the script again as two processes of 2 devices each (``jax.distributed``).
"""

import os
import socket
import subprocess
import sys

#: Set when this script runs as one of the two processes of part 5: "PORT,INDEX".
JOB = os.environ.get("TUTORIAL_JOB")

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdecl as jd  # noqa: E402

jax.config.update("jax_enable_x64", True)
SEEN = []  # the shape of the first input of every rule call: full arrays or per-device blocks


# The factor syntax names each dim of each input and result: "b n -> b n". A named factor is
# independent (the rule may run on any slice along it) unless listed in replicate= (the rule
# needs it whole: the FFT's own axis) or reduce= (the rule sums over it).
class RowFFT(jd.Primitive, linear=True, sharding="b n -> b n", replicate=("n",)):
    """The DFT of each row: rows are independent, each row is needed whole."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        SEEN.append(x.shape)
        return np.fft.fft(x, axis=-1)

    @jd.transpose
    def apply_t(self, ct):  # the DFT matrix is symmetric: its transpose is itself
        SEEN.append(ct.shape)
        return np.fft.fft(ct, axis=-1)


class Softplus(jd.Primitive, sharding="... -> ..."):
    """Elementwise: every dim independent, whatever the rank ('...' names leading dims)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        SEEN.append(x.shape)
        return np.logaddexp(0.0, x)

    @jd.jvp
    def push(self, x, dx):
        return dx / (1 + np.exp(-x))

    @jd.vjp
    def pull(self, x, ct):
        SEEN.append(x.shape)
        return ct / (1 + np.exp(-x))


class MatVec(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    """A @ x: rows independent; k is summed over, so k-slices give partial sums."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        SEEN.append(a.shape)
        return a @ x


def seen(function, *args):
    """Runs `function` and returns the distinct shapes its rules saw."""
    SEEN.clear()
    jax.block_until_ready(function(*args))
    return sorted(set(SEEN))


def job_process(port: int, index: int) -> None:
    """Part 5, in each of the two processes: global arrays over the 4 devices of both, each
    process giving its own rows, and the same ops, each process running its own shards."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
    me = f"process {index}"
    print(f"{me}: devices {[d.id for d in jax.local_devices()]} of {jax.device_count()}")
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)  # the same x in both; each process hands over its rows
    x = rng.standard_normal((8, 16)) + 1j * rng.standard_normal((8, 16))
    mine = slice(4 * index, 4 * index + 4)
    xs = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), x[mine], x.shape)
    fft = jax.jit(RowFFT())
    print(f"{me}: jit rule saw {seen(fft, xs)}, of rows {mine.start}-{mine.stop - 1}")
    whole = multihost_utils.process_allgather(fft(xs), tiled=True)  # (for the check only)
    np.testing.assert_allclose(whole, np.fft.fft(x), rtol=1e-12, atol=1e-12)
    energy = jax.jit(jax.grad(lambda u: jnp.sum(jnp.abs(RowFFT()(u)) ** 2)))
    print(f"{me}: grad rule saw {seen(energy, xs)}")
    np.testing.assert_allclose(multihost_utils.process_allgather(energy(xs), tiled=True),
                               2 * 16 * np.conj(x), rtol=1e-12)
    print(f"{me}: eager rule saw {seen(RowFFT(), xs)}")  # eager calls on global arrays too
    # A contraction split across the processes: each multiplies its columns, jaxdecl sums.
    a, v = rng.standard_normal((8, 12)), rng.standard_normal(12)
    cols = slice(6 * index, 6 * index + 6)
    A = jax.make_array_from_process_local_data(NamedSharding(mesh, P(None, "d")), a[:, cols],
                                               a.shape)
    V = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), v[cols], v.shape)
    mv = jax.jit(MatVec())
    print(f"{me}: matvec rule saw {seen(mv, A, V)}")
    np.testing.assert_allclose(multihost_utils.process_allgather(mv(A, V), tiled=True), a @ v,
                               rtol=1e-12)
    jax.distributed.shutdown()


if JOB is not None:  # one of part 5's two processes: only that part
    job_process(*(int(v) for v in JOB.split(",")))
    sys.exit()

n = jax.device_count()
print("devices        :", n)
rng = np.random.default_rng(0)
x = rng.standard_normal((8, 16)) + 1j * rng.standard_normal((8, 16))
fft = RowFFT()

# 1. jax.jit over a mesh of Auto axes: shard the rows, each device transforms its own block.
mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,))
xs = jax.device_put(x, NamedSharding(mesh, P("d")))
f = jax.jit(fft)
hlo = f.lower(xs).compile().as_text()
y = f(xs)
print("rule saw       :", seen(f, xs), "(the whole array is (8, 16))")
print("all-gather     :", "all-gather" in hlo)
print("result sharding:", y.sharding.spec)
np.testing.assert_allclose(y, jnp.fft.fft(x), rtol=1e-12, atol=1e-12)
assert "all-gather" not in hlo
# jaxdecl.contrib.ducc's FFTs declare the same (axes they do not transform are independent).
# They need ducc0 (pip install ".[ducc]"); this tutorial runs without it.
try:
    from jaxdecl.contrib import ducc
except ImportError:
    print('ducc.c2c       : skipped (needs ducc0: pip install ".[ducc]")')
else:
    yd = jax.jit(ducc.c2c(axes=(1,)))(xs)
    print("ducc.c2c       : result sharding", yd.sharding.spec)
    np.testing.assert_allclose(yd, jnp.fft.fft(x), rtol=1e-12, atol=1e-12)

r = rng.standard_normal((8, 16))
sp = jax.jit(Softplus())(jax.device_put(r, NamedSharding(mesh, P(None, "d"))))
print("softplus       : split along columns, result", sp.sharding.spec)
np.testing.assert_allclose(sp, jax.nn.softplus(r), rtol=1e-12)

# A reduce factor: split k, each device multiplies its slices, jaxdecl sums (an all-reduce).
a, v = rng.standard_normal((8, 12)), rng.standard_normal(12)
mv = jax.jit(MatVec())
A = jax.device_put(a, NamedSharding(mesh, P(None, "d")))
V = jax.device_put(v, NamedSharding(mesh, P("d")))
print("matvec         : rule saw", seen(mv, A, V), "all-reduce:",
      "all-reduce" in mv.lower(A, V).compile().as_text())
np.testing.assert_allclose(mv(A, V), a @ v, rtol=1e-12)

# 2. Derivatives: tangents and cotangents take their primal's factors, so grad stays per shard.
energy = jax.jit(jax.grad(lambda u: jnp.sum(jnp.abs(fft(u)) ** 2)))
g = energy(xs)
print("grad           : rule saw", seen(energy, xs), "sharding", g.sharding.spec)
np.testing.assert_allclose(g, jax.grad(lambda u: jnp.sum(jnp.abs(jnp.fft.fft(u)) ** 2))(x),
                           rtol=1e-12)
loss = jax.jit(jax.grad(lambda u: jnp.sum(Softplus()(u))))
np.testing.assert_allclose(loss(jax.device_put(r, NamedSharding(mesh, P("d")))),
                           jax.nn.sigmoid(r), rtol=1e-12)

# 3. shard_map: the rules see each device's block, and every transformation works inside.
mapped = jax.shard_map(fft, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
print("shard_map      : rule saw", seen(jax.jit(mapped), xs))
np.testing.assert_allclose(jax.jit(mapped)(xs), jnp.fft.fft(x), rtol=1e-12, atol=1e-12)
gm = jax.jit(jax.grad(lambda u: jnp.sum(jnp.abs(mapped(u)) ** 2)))(xs)
np.testing.assert_allclose(gm, g, rtol=1e-12)

# 4. Explicit axes: types carry shardings. The result type says how it is split; an input
# split along a factor the op needs whole is a type error, as for JAX's own ops.
explicit = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Explicit,))
with jax.set_mesh(explicit):
    xe = jax.device_put(x, P("d"))
    ye = fft(xe)
    print("explicit type  :", jax.typeof(ye))
    np.testing.assert_allclose(ye, jnp.fft.fft(x), rtol=1e-12, atol=1e-12)
    refused = None
    try:
        fft(jax.device_put(x, P(None, "d")))
    except Exception as error:  # noqa: BLE001 - JAX's ShardingTypeError, as for its own ops
        refused = error
    assert type(refused).__name__ == "ShardingTypeError", refused
    print("type error     :", type(refused).__name__, "-", str(refused)[:150], "...")

# 5. Many processes (jax.distributed): one process per host, each holding its devices' blocks
# of global arrays and running the rules on them. Here two processes of 2 CPU devices each
# play two hosts: this script starts itself twice (job_process above is what each runs),
# meeting at a free port on 127.0.0.1. On a cluster, SLURM or mpirun start the processes
# (docs: "Running on a cluster").
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
children = [subprocess.Popen(
    [sys.executable, os.path.abspath(__file__)], stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT, text=True,
    env=dict(os.environ, TUTORIAL_JOB=f"{port},{i}",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")) for i in range(2)]
try:
    outputs = [child.communicate(timeout=300)[0] for child in children]
finally:
    for child in children:
        if child.poll() is None:
            child.kill()
for child, output in zip(children, outputs):
    print("".join(line + "\n" for line in output.splitlines() if line.startswith("process")),
          end="")
    assert child.returncode == 0, output[-3000:]
print("all results match jax.numpy")

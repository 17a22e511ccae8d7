"""The source of a generated program: ``run(ops)``, and a standalone script around it.

``render`` writes a draft of ``helpers_programs_draw.py`` as the function ``run(ops)``
(inputs, ops, the program, its transforms, the call); ``script`` wraps a draw into a
file a developer can run. Pure Python, as the draw is:

    >>> render_spec(["x", None, ("x", "y")])
    "P('x', None, ('x', 'y'))"
"""

from __future__ import annotations

PROCESS_PORT = 12355  # where the processes of a standalone "processes" script meet


def script(drawn, tests_dir: str) -> str:
    """A standalone script of a ``Draw``: it runs the program, then its twin, and prints
    how they differ; a "processes" draw runs as its processes (``python FILE 0 & python
    FILE 1``)."""
    count = drawn.processes
    start = "" if count == 1 else _PROCESSES.format(port=PROCESS_PORT, count=count)
    return _SCRIPT.format(
        seed=drawn.seed, summary=drawn.summary, tests_dir=tests_dir, source=drawn.source,
        specs=drawn.specs, rtol=drawn.rtol, untyped=drawn.untyped,
        devices=drawn.geometry.local, start=start,
        how="" if count == 1 else
        f"\n\nRun it as {count} processes: "
        + " & ".join(f"`python FILE {i}`" for i in range(count)) + ".")


_PROCESSES = '''jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes={count}, process_id=int(sys.argv[1]))
'''

_SCRIPT = '''"""Generated program {seed}: {summary}{how}"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
import jax

jax.config.update("jax_enable_x64", True)
{start}sys.path.insert(0, {tests_dir!r})
from helpers_programs_ops import *  # noqa: E402,F403  the ops, their twins, helpers


def call(function, *args):
    return function(*args)


{source}

out = run(OPS)  # the program with jaxdecl ops
expected = run(TWINS)  # the same program with the ops' jax.numpy twins
print(compare(out, expected, specs={specs}, rtol={rtol}, untyped={untyped}) or "same")
'''


def axes_of(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


def render_spec(entries) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


def render(d) -> tuple:
    """The source lines of ``run(ops)`` of a draft (``helpers_programs_draw._Draft``),
    and its transforms as one expression."""
    program = d.program
    used = sorted(set(program.used))
    lines = ["def run(ops):", f'    """{d.group}, seed {d.seed}."""',
             f"    {', '.join(used)} = {', '.join(f'ops.{op}' for op in used)}",
             f"    mesh = {_mesh(d)}",
             f"    rng = np.random.default_rng({d.seed})"]
    for i, value in enumerate(d.inputs):
        spec = d.spec_text(i).replace("unsharded", "None")
        lines.append(f"    {value.name} = place(values(rng, {d.full_shape(i)}, "
                     f'"{value.dtype}"), mesh, {spec})')
    lines += [f"    {name} = {expr}" for name, expr in program.reused.items()]
    args = ", ".join(v.name for v in d.inputs)
    lines += ["", f"    def program({args}):"]
    lines += [f"        {line}" for line in program.lines]
    lines += [f"        return {program.result}", ""]

    inner, chain = "program", "program"
    for depth, index in enumerate(reversed(range(len(d.layers)))):
        name, layer = f"f{depth + 1}", d.layers[index]
        if layer == "shard_map":
            lines.append(_shard_map(d, index, name, inner))
        else:
            lines += _layer(layer, name, inner, d.inputs, d.in_axes.get(index), d.steps)
        chain = f"{_LABELS[layer]}({chain})"
        inner = name
    call = f"call({inner}, {args})"  # (call: the harness may export it first)
    if d.set_mesh:
        lines += ["    with set_mesh(mesh):", f"        return {call}"]
    else:
        lines.append(f"    return {call}")
    return lines, chain


def _mesh(d) -> str:
    """The mesh of a draft: ``make_mesh`` of its name on 4 devices, spelled out on others."""
    if d.geometry.default:
        return f'make_mesh("{d.mesh_name}", "{d.axis_type.title()}")'
    kind = f"AxisType.{d.axis_type.title()}"
    return (f"jax.make_mesh({tuple(d.axes.values())}, {tuple(d.axes)}, "
            f"axis_types=({', '.join([kind] * len(d.axes))},))")


def _shard_map(d, index: int, name: str, inner: str) -> str:
    """``jax.shard_map`` of `inner` over the draft's manual axes, its ``in_specs`` the
    inputs' specs there, each result's blocks joined along dim 0."""
    specs = []
    for i in range(len(d.inputs)):
        entries = [e for _, e, at in d.lead[i] if at > index] + d.base[i]
        kept = [tuple(a for a in axes_of(e) if a in d.manual) for e in entries]
        specs.append(render_spec([None if not k else k[0] if len(k) == 1 else k for k in kept]))
    out = d.manual[0] if len(d.manual) == 1 else tuple(d.manual)
    names = f", axis_names={set(d.manual)!r}" if len(d.manual) < len(d.axes) else ""
    return (f"    {name} = jax.shard_map({inner}, mesh=mesh, in_specs=({', '.join(specs)},), "
            f"out_specs=P({out!r}){names})")


_LABELS = {"jit": "jax.jit", "grad": "jax.grad", "jvp": "jax.jvp", "vjp": "jax.vjp",
           "linearize": "jax.linearize", "vmap": "jax.vmap", "scan": "lax.scan",
           "checkpoint": "jax.checkpoint", "shard_map": "jax.shard_map"}


def _layer(layer: str, name: str, inner: str, inputs: list, batched, steps: int) -> list:
    """Source lines defining `name`, the transform `layer` of the function `inner`."""
    args = ", ".join(v.name for v in inputs)
    tup = f"({args},)" if len(inputs) == 1 else f"({args})"
    tangents = ", ".join(f"tangent({v.name})" for v in inputs)
    tangents = f"({tangents},)" if len(inputs) == 1 else f"({tangents})"
    if layer in ("jit", "checkpoint"):
        return [f"    {name} = jax.{layer}({inner})"]
    if layer == "grad":
        argnums = "" if len(inputs) == 1 else f", argnums={tuple(range(len(inputs)))}"
        return [f"    {name} = jax.grad(lambda {args}: total({inner}({args})){argnums})"]
    if layer == "jvp":
        return [f"    {name} = lambda {args}: jax.jvp({inner}, {tup}, {tangents})"]
    if layer == "vjp":
        return ["", f"    def {name}({args}):",
                f"        out, pull = jax.vjp({inner}, {args})",
                "        return out, pull(cotangent(out))", ""]
    if layer == "linearize":
        return ["", f"    def {name}({args}):",
                f"        out, push = jax.linearize({inner}, {args})",
                f"        return out, push{tangents}", ""]
    if layer == "vmap":
        if all(batched):
            return [f"    {name} = jax.vmap({inner})"]
        axes = ", ".join("0" if b else "None" for b in batched)
        return [f"    {name} = jax.vmap({inner}, in_axes=({axes}))"]
    if layer == "scan":
        first, rest = inputs[0].name, ", ".join(v.name for v in inputs[1:])
        if len(inputs) == 1:
            return ["", f"    def {name}({args}):",
                    "        def step(carry, _):",
                    f"            out = {inner}(carry)",
                    "            return blend(carry, out), out",
                    "",
                    f"        return jax.lax.scan(step, {first}, length={steps})", ""]
        xs = f"({rest},)" if len(inputs) == 2 else f"({rest})"
        return ["", f"    def {name}({args}):",
                "        def step(carry, xs):",
                f"            out = {inner}(carry, *xs)",
                "            return blend(carry, out), out",
                "",
                f"        return jax.lax.scan(step, {first}, {xs})", ""]
    raise ValueError(f"unknown transform {layer!r}")

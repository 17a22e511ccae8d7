"""Random sharded programs over jaxdecl ops, each a script reproducible from its seed.

``draw(seed)`` picks, from ``random.Random(seed)`` alone:

- a group (``GROUPS``, by ``seed % 5``): the (4,) mesh "d" or the (2, 2) mesh "x", "y",
  its axes all Auto or all Explicit, in one process; or ("processes") either mesh and
  axis type over two processes of 2 devices each (``jax.distributed``); and whether the
  call runs inside ``jax.set_mesh(mesh)`` (mostly under Explicit axes, sometimes under
  Auto ones);
- 1-3 inputs of one base shape (``SHAPES``) or its last or first dim, float32, float64
  or complex128, each laid out over the mesh by a random ``PartitionSpec`` (mostly one
  shared "aligned" spec, so that the inputs combine under Explicit axes and in
  ``shard_map``), replicated, or left on the default device;
- a program: 1-3 applications of the ops of ``helpers_programs_ops.py``, created inside
  the traced function or once outside it, mixed with ``+``, ``*``, ``jnp.sin`` and
  sums so that each op's result combines with other arrays;
- 0-3 nested transforms (``TRANSFORMS``): ``jit``, ``grad``, ``jvp``, ``vjp``,
  ``linearize``, ``vmap`` (the inputs get a batch dim, itself maybe sharded),
  ``lax.scan`` (the first input is the carry, the others are stacked), ``checkpoint``
  and ``shard_map`` (``in_specs`` the inputs' specs). Second derivatives only of
  programs whose ops are linear: a NumPy rule has none (a documented refusal).

The draw is Python source defining ``run(ops)``; run with ``helpers_programs_ops.OPS``
it is the jaxdecl program, with ``TWINS`` its ``jax.numpy`` twin. This module imports
no JAX, so that a test can group seeds and check the generator without starting it:

    >>> first = draw(7)
    >>> first.group, first.source == draw(7).source
    ('explicit-1d', True)
"""

from __future__ import annotations

import dataclasses
import random
import re

GROUPS = ("auto-1d", "auto-2d", "explicit-1d", "explicit-2d", "processes")
PROCESS_PORT = 12355  # where the processes of a standalone "processes" script meet
AXES = {"1d": {"d": 4}, "2d": {"x": 2, "y": 2}}
SHAPES = ((8,), (8, 4), (4, 8), (8, 6))
BATCH, STEPS = 4, 3  # the size of a vmap batch, the length of a scan
TRANSFORMS = {"jit": 20, "grad": 14, "vmap": 14, "shard_map": 10, "jvp": 8, "vjp": 8,
              "scan": 8, "linearize": 7, "checkpoint": 6}
DERIVATIVES = ("grad", "jvp", "vjp", "linearize")
ONCE = ("jit", "shard_map", "scan", "checkpoint")  # at most once per draw
OPS = ("Quad", "Mul", "Tanh", "SinRes", "Scale", "MatVec", "CumSum")
LINEAR = ("Scale", "MatVec", "CumSum")  # every order of derivative works
UNDECLARED = ("Tanh",)  # results typed whole: no sharding-type check
CONFIGS = {"Quad": ("0.1", "0.2", "0.3"), "Scale": ("2.0", "-0.5", "3.0")}
ARGS = "abc"
PLACEMENTS = ("aligned", "random", "replicated", "unsharded")


def group_of(seed: int) -> str:
    """The group (mesh and axis types) of draw `seed`: draws of a group share a process."""
    return GROUPS[seed % len(GROUPS)]


@dataclasses.dataclass(frozen=True)
class Draw:
    """One generated program: the source of ``run(ops)``, a one-line summary, whether
    to compare sharding types, the tolerance of its values, and the features it
    exercises (for coverage checks)."""

    seed: int
    group: str
    source: str
    summary: str
    specs: bool
    rtol: float
    processes: int  # 2: run by two processes with jax.distributed (2 devices each)
    features: frozenset

    def script(self, tests_dir: str) -> str:
        """A standalone script: runs the program, then its twin, and prints how they differ."""
        start = "" if self.processes == 1 else _PROCESSES.format(port=PROCESS_PORT)
        return _SCRIPT.format(
            seed=self.seed, summary=self.summary, tests_dir=tests_dir, source=self.source,
            specs=self.specs, rtol=self.rtol, devices=4 // self.processes, start=start,
            how="" if self.processes == 1 else
            "\n\nRun it as two processes: `python FILE 0 & python FILE 1`.")


_PROCESSES = '''jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id=int(sys.argv[1]))
'''

_SCRIPT = '''"""Generated program {seed}: {summary}{how}"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
import jax

jax.config.update("jax_enable_x64", True)
{start}sys.path.insert(0, {tests_dir!r})
from helpers_programs_ops import *  # noqa: E402,F403  the ops, their twins, helpers


{source}

out = run(OPS)  # the program with jaxdecl ops
expected = run(TWINS)  # the same program with the ops' jax.numpy twins
print(compare(out, expected, specs={specs}, rtol={rtol}) or "same")
'''


@dataclasses.dataclass(frozen=True)
class _Value:
    name: str
    kind: str  # "full" (the base shape), "last" (its last dim) or "first" (its first dim)
    dtype: str


def _promote(*dtypes) -> str:
    order = ("float32", "float64", "complex128")
    return max(dtypes, key=order.index)


# ---------------------------------------------------------------------------------------
# The program
# ---------------------------------------------------------------------------------------

class _Program:
    """Lines of ``program(...)``, the ops created once outside it, and the features."""

    def __init__(self, rnd: random.Random, inputs: list, rank: int, scans: tuple):
        # scans: the kinds of values whose last dim CumSum may need whole (under
        # Explicit axes JAX's cumsum, the twin, refuses a split one)
        self.rnd, self.rank, self.scans = rnd, rank, scans
        self.values = list(inputs)
        self.lines, self.reused, self.used, self.features = [], {}, [], set()
        last = None
        for _ in range(rnd.randint(1, 3)):
            x = last if last is not None and rnd.random() < 0.6 else rnd.choice(self.values)
            previous, last = last, self._assign(*self._apply(x))
            others = [v for v in self.values if v is not last]
            if previous is not None and x is not previous:  # one chain: the result uses all
                last = self._assign(*self._combine(last, previous))
            elif rnd.random() < 0.7:
                last = self._assign(*self._combine(last, rnd.choice(others)))
            elif rnd.random() < 0.4:
                w = rnd.choice(others)
                last = self._assign(f"jnp.sin({last.name}) + jnp.sin({w.name}.sum())",
                                    last.kind, _promote(last.dtype, w.dtype))
        for value in inputs:  # every input takes part
            if not any(re.search(rf"\b{value.name}\b", line) for line in self.lines):
                last = self._assign(*self._combine(last, value))
        temps = [v for v in self.values if v.name.startswith("t") and v is not last]
        if temps and rnd.random() < 0.15:
            self.result = f"{last.name}, {rnd.choice(temps).name}"
            self.features.add("two_results")
        else:
            self.result = last.name

    def _assign(self, expr: str, kind: str, dtype: str) -> _Value:
        value = _Value(f"t{len(self.lines) + 1}", kind, dtype)
        self.lines.append(f"{value.name} = {expr}")
        self.values.append(value)
        return value

    def _make(self, op: str, config: str = "") -> str:
        """The op: created here (temporary) or once before the program (reused)."""
        self.used.append(op)
        if self.rnd.random() < 0.5:
            self.features.add("temporary")
            return f"{op}({config})"
        name = op.lower() + (str(CONFIGS[op].index(config)) if config else "")
        self.reused[name] = f"{op}({config})"
        self.features.add("reused")
        return name

    def _apply(self, x: _Value) -> tuple:
        rnd = self.rnd
        real = x.dtype != "complex128"
        vectors = [v for v in self.values if v.kind == "last" and v.dtype == x.dtype]
        choices = ["Quad", "Mul", "Tanh", "SinRes", "Scale"]
        if real:
            choices += ["CumSum"] if x.kind in self.scans else []
            if x.kind == "full" and self.rank == 2 and vectors:
                choices += ["MatVec"] * 4
        op = rnd.choice(choices)
        if op in CONFIGS and rnd.random() < 0.15:
            # two configurations of one op in one expression, both temporary
            first, second = rnd.sample(CONFIGS[op], 2)
            self.used += [op, op]
            self.features.add("pair")
            return f"{op}({first})({x.name}) + {op}({second})({x.name})", x.kind, x.dtype
        config = rnd.choice(CONFIGS[op]) if op in CONFIGS else ""
        if op == "Mul":
            y = rnd.choice([v for v in self.values if v.kind == x.kind and v.dtype == x.dtype])
            return f"{self._make(op)}({x.name}, {y.name})", x.kind, x.dtype
        if op == "MatVec":
            return f"{self._make(op)}({x.name}, {rnd.choice(vectors).name})", "first", x.dtype
        return f"{self._make(op, config)}({x.name})", x.kind, x.dtype

    def _combine(self, x: _Value, y: _Value) -> tuple:
        """x (op) y with NumPy broadcasting: a first-dim vector gets a trailing axis."""
        op = self.rnd.choice(("+", "*", "-"))
        dtype = _promote(x.dtype, y.dtype)
        if x.kind == y.kind:
            return f"{x.name} {op} {y.name}", x.kind, dtype
        left = f"{x.name}[:, None]" if x.kind == "first" else x.name
        right = f"{y.name}[:, None]" if y.kind == "first" else y.name
        return f"{left} {op} {right}", "full", dtype


# ---------------------------------------------------------------------------------------
# Transforms and placements
# ---------------------------------------------------------------------------------------

def _layers(rnd: random.Random, linear_only: bool) -> list:
    """Transforms, outermost first."""
    depth = rnd.choices((0, 1, 2, 3), (8, 47, 38, 7))[0]
    layers, names = [], list(TRANSFORMS)
    weights = [TRANSFORMS[t] for t in names]
    for _ in range(50):
        if len(layers) == depth:
            break
        t = rnd.choices(names, weights)[0]
        if (t in ONCE and t in layers) or (t == "vmap" and layers.count("vmap") == 2):
            continue
        if t in DERIVATIVES and not linear_only and set(layers) & set(DERIVATIVES):
            continue
        layers.append(t)
    return layers


def _spec(rnd: random.Random, shape: tuple, axes: dict, taken=()) -> list:
    """One entry per dim: None or mesh axes whose sizes divide it, no axis twice."""
    entries = [None] * len(shape)
    free = [a for a in axes if a not in taken]
    for dim in rnd.sample(range(len(shape)), len(shape)):
        if rnd.random() < 0.4:
            continue
        fits = [a for a in free if shape[dim] % axes[a] == 0]
        if len(free) == 2 and shape[dim] % 4 == 0 and rnd.random() < 0.15:
            entries[dim] = tuple(rnd.sample(free, 2))
        elif fits:
            entries[dim] = rnd.choice(fits)
        else:
            continue
        free = [a for a in free if a not in _axes_of(entries[dim])]
    return entries


def _axes_of(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


def _render_spec(entries) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


def _base_shape(kind: str, shape: tuple) -> tuple:
    return {"full": shape, "last": shape[-1:], "first": shape[:1]}[kind]


# ---------------------------------------------------------------------------------------
# The draw
# ---------------------------------------------------------------------------------------

def draw(seed: int) -> Draw:
    """Draw number `seed` (the same program for the same seed, in any process)."""
    rnd = random.Random(seed)
    group = group_of(seed)
    processes = 2 if group == "processes" else 1
    if processes > 1:  # 2 processes x 2 devices (jax.distributed), either mesh and axis type
        axis_type, mesh_name = rnd.choice(("auto", "explicit")), rnd.choice(("1d", "2d"))
    else:
        axis_type, mesh_name = group.split("-")
    explicit, axes = axis_type == "explicit", AXES[mesh_name]
    features = {f"group:{group}", f"mesh:{axis_type}-{mesh_name}"}
    set_mesh = rnd.random() < (0.9 if explicit else 0.3)
    features.add("set_mesh" if set_mesh else "no_set_mesh")

    shape = rnd.choice(SHAPES)
    aligned = _spec(rnd, shape, axes)  # the spec most inputs share
    last_dims = {"full": aligned[-1], "last": aligned[-1], "first": aligned[0]}
    scans = tuple(k for k, e in last_dims.items() if e is None or not explicit)
    dtype = "complex128" if rnd.random() < 0.15 else rnd.choice(("float32", "float64"))
    inputs = []
    for i in range(rnd.choice((1, 2, 2, 3, 3))):
        kind = "full" if i == 0 or len(shape) == 1 else rnd.choices(
            ("full", "last", "first"), (4, 4, 2))[0]
        own = dtype
        if i and dtype != "complex128" and rnd.random() < 0.15:
            own = "float64" if dtype == "float32" else "float32"
        inputs.append(_Value(ARGS[i], kind, own))
    n = len(inputs)
    features |= {f"dtype:{v.dtype}" for v in inputs} | {f"kind:{v.kind}" for v in inputs}

    program = _Program(rnd, inputs, len(shape), scans)
    features |= program.features | {f"op:{op}" for op in program.used}
    layers = _layers(rnd, linear_only=set(program.used) <= set(LINEAR))
    features |= {f"transform:{t}" for t in layers} | {f"depth:{len(layers)}"}
    if not layers:
        features.add("transform:eager")

    if "shard_map" in layers and "jit" not in layers[:layers.index("shard_map")] \
            and rnd.random() < 0.7:
        # mostly jitted: an eager shard_map compiles every primitive (seconds per draw)
        layers.insert(layers.index("shard_map"), "jit")

    # Placements: a base spec per input, then the leading dims vmap and scan add.
    inside = "shard_map" in layers
    modes, base = [], []
    for i, value in enumerate(inputs):
        if inside:
            mode = "aligned"
        else:
            # Explicit axes: JAX refuses to combine differently split arrays (the twin too)
            mode = rnd.choices(PLACEMENTS, (74, 4, 15, 7) if explicit else (55, 20, 15, 10))[0]
        if mode == "unsharded" and (i == 0 or processes > 1):
            mode = "aligned"  # (an array on one process's device cannot meet global ones)
        own = _base_shape(value.kind, shape)
        if mode == "aligned":
            entries = {"full": aligned, "last": aligned[-1:], "first": aligned[:1]}[value.kind]
        elif mode == "random":
            entries = _spec(rnd, own, axes)
            if explicit and "CumSum" in program.used:
                entries[-1] = None
        else:
            entries = [None] * len(own)
        modes.append(mode)
        base.append(list(entries))
        features.add(f"placement:{mode}")
    taken = {a for e in aligned for a in _axes_of(e)}
    lead = [[] for _ in inputs]  # per input, outermost first: (size, entry, layer index)
    in_axes = {}
    for index in reversed(range(len(layers))):
        if layers[index] == "vmap":
            free = [a for a in axes if a not in taken]
            axis = rnd.choice(free) if free and rnd.random() < 0.6 else None
            if "shard_map" in layers[index:]:
                axis = None  # a vmap of a shard_map cannot split its batch over a mesh axis
            taken |= {axis} if axis else set()
            batched = [True] + [rnd.random() < 0.8 for _ in inputs[1:]]
            in_axes[index] = batched
            features |= {"in_axes_none"} if not all(batched) else set()
            entries = []
            for i in range(n):
                own = {a for e in base[i] + [e for _, e, _ in lead[i]] for a in _axes_of(e)}
                entries.append(axis if modes[i] in ("aligned", "random") and axis not in own
                               else None)
            if explicit and len({e for e, b in zip(entries, batched) if b}) > 1:
                entries = [None] * n  # JAX: vmapped inputs' batch dims split the same way
            for i in range(n):
                if batched[i]:
                    lead[i].insert(0, (BATCH, entries[i], index))
        elif layers[index] == "scan":
            for i in range(1, n):
                lead[i].insert(0, (STEPS, None, index))

    lines = ["def run(ops):", f'    """{group}, seed {seed}."""']
    used = sorted(set(program.used))
    lines.append(f"    {', '.join(used)} = {', '.join(f'ops.{op}' for op in used)}")
    lines.append(f'    mesh = make_mesh("{mesh_name}", "{axis_type.title()}")')
    lines.append(f"    rng = np.random.default_rng({seed})")
    shown = []
    for i, value in enumerate(inputs):
        full_shape = tuple(s for s, _, _ in lead[i]) + _base_shape(value.kind, shape)
        if modes[i] == "unsharded":
            spec = "None"
        elif modes[i] == "replicated":
            spec = "P()"
        else:
            spec = _render_spec([e for _, e, _ in lead[i]] + base[i])
        lines.append(f'    {value.name} = place(values(rng, {full_shape}, "{value.dtype}"), '
                     f"mesh, {spec})")
        shown.append(f"{value.name}: {value.dtype}{list(full_shape)} "
                     f"{'unsharded' if spec == 'None' else spec}")
    for name, expr in program.reused.items():
        lines.append(f"    {name} = {expr}")
    args = ", ".join(v.name for v in inputs)
    lines += ["", f"    def program({args}):"]
    lines += [f"        {line}" for line in program.lines]
    lines += [f"        return {program.result}", ""]

    inner, chain = "program", "program"
    for depth, index in enumerate(reversed(range(len(layers)))):
        name, layer = f"f{depth + 1}", layers[index]
        if layer == "shard_map":
            manual = list(axes)
            if len(manual) == 2 and rnd.random() < 0.2:
                manual = [rnd.choice(manual)]
                features.add("partial_shard_map")
            specs = []
            for i in range(n):
                entries = [e for _, e, at in lead[i] if at > index] + base[i]
                kept = [tuple(a for a in _axes_of(e) if a in manual) for e in entries]
                specs.append(_render_spec(
                    [None if not k else k[0] if len(k) == 1 else k for k in kept]))
            out = manual[0] if len(manual) == 1 else tuple(manual)
            names = f", axis_names={set(manual)!r}" if len(manual) < len(axes) else ""
            lines.append(f"    {name} = jax.shard_map({inner}, mesh=mesh, in_specs=("
                         f"{', '.join(specs)},), out_specs=P({out!r}){names})")
        else:
            lines += _layer(layer, name, inner, inputs, in_axes.get(index))
        chain = f"{_LABELS[layer]}({chain})"
        inner = name
    call = f"{inner}({args})"
    if set_mesh:
        lines += ["    with jax.set_mesh(mesh):", f"        return {call}"]
    else:
        lines.append(f"    return {call}")

    reused = "; ".join(f"{k} = {v}" for k, v in program.reused.items())
    where = group if processes == 1 else f"{group} ({axis_type}-{mesh_name})"
    summary = (f"{where}{', set_mesh' if set_mesh else ''}: {chain}; {'; '.join(shown)}; "
               f"program({args}): {'; '.join(program.lines)}; return {program.result}"
               + (f" [{reused}]" if reused else ""))
    specs = explicit and not set(program.used) & set(UNDECLARED)
    rtol = 1e-4 if "dtype:float32" in features else 1e-10
    return Draw(seed, group, "\n".join(lines), summary, specs, rtol, processes,
                frozenset(features))


_LABELS = {"jit": "jax.jit", "grad": "jax.grad", "jvp": "jax.jvp", "vjp": "jax.vjp",
           "linearize": "jax.linearize", "vmap": "jax.vmap", "scan": "lax.scan",
           "checkpoint": "jax.checkpoint", "shard_map": "jax.shard_map"}


def _layer(layer: str, name: str, inner: str, inputs: list, batched) -> list:
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
                    f"        return jax.lax.scan(step, {first}, length={STEPS})", ""]
        xs = f"({rest},)" if len(inputs) == 2 else f"({rest})"
        return ["", f"    def {name}({args}):",
                "        def step(carry, xs):",
                f"            out = {inner}(carry, *xs)",
                "            return blend(carry, out), out",
                "",
                f"        return jax.lax.scan(step, {first}, {xs})", ""]
    raise ValueError(f"unknown transform {layer!r}")

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
  ``lax.scan`` (the first input is the carry, which the program's first op takes, each
  op kind alike; the others are stacked), ``checkpoint`` and ``shard_map``
  (``in_specs`` the inputs' specs). Second derivatives only of programs whose ops are
  linear or partly linear with a traceable jvp: a NumPy rule has none (a documented
  refusal).

The draw is Python source defining ``run(ops)`` (``helpers_programs_source.py`` writes
it); run with ``helpers_programs_ops.OPS`` it is the jaxdecl program, with ``TWINS`` its
``jax.numpy`` twin. Where JAX itself refuses a combination (a vmap of a shard_map with a
split batch, arrays split differently under Explicit axes, a cumsum along a split dim
there), the draw mostly avoids it, so that few draws are invalid JAX. This module
imports no JAX, so that a test can group seeds and check the generator without starting
it:

    >>> first = draw(7)
    >>> first.group, first.source == draw(7).source
    ('explicit-1d', True)
"""

from __future__ import annotations

import dataclasses
import random
import re

from helpers_programs_source import axes_of, render, render_spec, script

GROUPS = ("auto-1d", "auto-2d", "explicit-1d", "explicit-2d", "processes")
AXES = {"1d": {"d": 4}, "2d": {"x": 2, "y": 2}}
SHAPES = ((8,), (8, 4), (4, 8), (8, 6))
BATCH, STEPS = 4, 3  # the size of a vmap batch, the length of a scan


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The devices a draw's mesh spans: `processes` x `local` devices (4 by default).

    On more devices every size grows with them: the meshes (``AXES``: "d" over every
    device; "x" over half of them, "y" over 2), the inputs' dims (``SHAPES``) and a vmap
    batch (as large as the largest mesh axis), so that the same draws split as they do
    on 4.

        >>> Geometry(4, 2).axes["2d"], Geometry(4, 2).shapes[1], Geometry(4, 2).batch
        ({'x': 4, 'y': 2}, (16, 8), 8)
    """

    processes: int = 1
    local: int = 4

    @property
    def devices(self) -> int:
        return self.processes * self.local

    @property
    def default(self) -> bool:
        return self.devices == 4

    @property
    def axes(self) -> dict:
        if self.default:
            return AXES
        return {"1d": {"d": self.devices}, "2d": {"x": self.devices // 2, "y": 2}}

    @property
    def shapes(self) -> tuple:
        scale = max(self.devices // 4, 1)
        return tuple(tuple(n * scale for n in shape) for shape in SHAPES)

    @property
    def batch(self) -> int:
        return max(BATCH, *(max(axes.values()) for axes in self.axes.values()))


#: The geometry of the "processes" group: 2 processes of 2 devices each.
TWO_BY_TWO = Geometry(2, 2)
CARRY_TRIES = 100  # draws of the inputs until the op a scan's carry takes fits them
TRANSFORMS = {"jit": 20, "grad": 14, "vmap": 14, "shard_map": 10, "jvp": 8, "vjp": 8,
              "scan": 8, "linearize": 7, "checkpoint": 6}
DERIVATIVES = ("grad", "jvp", "vjp", "linearize")
ONCE = ("jit", "shard_map", "scan", "checkpoint")  # at most once per draw
OPS = ("Quad", "Mul", "Tanh", "SinRes", "Scale", "MatVec", "CumSum", "Wave", "MulZ", "Expm1")
LINEAR = ("Scale", "MatVec", "CumSum", "Wave")  # every order of derivative works
PAIRED = ("Mul", "Wave", "MulZ")  # two inputs of one kind and dtype
CONFIGS = {"Quad": ("0.1", "0.2", "0.3"), "Scale": ("2.0", "-0.5", "3.0"),
           "Tanh": ("1.0", "0.5", "2.0"), "Expm1": ("0.5", "-0.25", "1.0")}
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
    #: Shapes of the inputs placed on no mesh: a cotangent of one has no primal type to
    #: follow, and JAX's own ops disagree on its type (``mul`` leaves it split like the
    #: other operand, ``broadcast_in_dim``'s transpose makes it whole).
    untyped: tuple = ()
    geometry: Geometry = Geometry()  # the devices its mesh spans

    def script(self, tests_dir: str) -> str:
        """A standalone script: runs the program, then its twin, and prints how they differ."""
        return script(self, tests_dir)


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

def _choices(x: _Value, values: list, rank: int, scans: tuple, linear: bool) -> list:
    """The op kinds that may take `x` beside `values` (MatVec, which needs a matrix and a
    vector of its dtype, weighted up); `linear`: linear ones only. `scans`: the kinds of
    values whose last dim CumSum may need whole (under Explicit axes JAX's cumsum, the
    twin, refuses a split one)."""
    vectors = [v for v in values if v.kind == "last" and v.dtype == x.dtype]
    choices = ["Quad", "Mul", "Tanh", "SinRes", "Scale", "Wave", "MulZ", "Expm1"]
    if x.dtype != "complex128":
        choices += ["CumSum"] if x.kind in scans else []
        if x.kind == "full" and rank == 2 and vectors:
            choices += ["MatVec"] * 4
    return [op for op in choices if op in LINEAR] if linear else choices


class _Program:
    """Lines of ``program(...)``, the ops created once outside it, and the features."""

    def __init__(self, rnd: random.Random, inputs: list, rank: int, scans: tuple,
                 carry: str = "", linear: bool = False):
        # carry: the op kind the first input takes first (a scan's carry); linear:
        # linear ops only (the program is differentiated twice)
        self.rnd = rnd
        self.values = list(inputs)
        self.lines, self.reused, self.used, self.features = [], {}, [], set()
        last = None
        for k in range(rnd.randint(1, 3)):
            if carry and k == 0:
                x = inputs[0]
                self.features.add(f"scan_carry:{carry}")
            else:
                x = last if last is not None and rnd.random() < 0.6 else rnd.choice(self.values)
            op = carry if carry and k == 0 else rnd.choice(
                _choices(x, self.values, rank, scans, linear))
            previous, last = last, self._assign(*self._apply(op, x))
            others = [v for v in self.values if v is not last]
            if previous is not None and x is not previous:  # one chain: the result uses all
                last = self._assign(*self._combine(last, previous))
            elif rnd.random() < 0.7:
                last = self._assign(*self._combine(last, rnd.choice(others)))
            elif rnd.random() < 0.4:
                w = rnd.choice(others)
                dtype = _promote(last.dtype, w.dtype)
                # a reduction mixed in; complex sines grow exponentially: scale instead
                mixed = (f"jnp.sin({last.name}) + jnp.sin({w.name}.sum())" if dtype != "complex128"
                         else f"0.5 * {last.name} + {w.name}.mean()")
                last = self._assign(mixed, last.kind, dtype)
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

    def _apply(self, op: str, x: _Value) -> tuple:
        """Op kind `op` applied to `x`: the expression, its kind and dtype."""
        rnd = self.rnd
        vectors = [v for v in self.values if v.kind == "last" and v.dtype == x.dtype]
        if op in CONFIGS and rnd.random() < 0.15:
            # two configurations of one op in one expression, both temporary
            first, second = rnd.sample(CONFIGS[op], 2)
            self.used += [op, op]
            self.features.add("pair")
            return f"{op}({first})({x.name}) + {op}({second})({x.name})", x.kind, x.dtype
        config = rnd.choice(CONFIGS[op]) if op in CONFIGS else ""
        if op in PAIRED:
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
        free = [a for a in free if a not in axes_of(entries[dim])]
    return entries


def _base_shape(kind: str, shape: tuple) -> tuple:
    return {"full": shape, "last": shape[-1:], "first": shape[:1]}[kind]


# ---------------------------------------------------------------------------------------
# The draw
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Draft:
    """What a draw has decided so far (the steps of ``draw`` fill it in, in order)."""

    seed: int
    rnd: random.Random
    group: str
    processes: int
    axis_type: str  # "auto" or "explicit"
    mesh_name: str  # "1d" or "2d"
    features: set
    set_mesh: bool = False
    shape: tuple = ()
    aligned: list = dataclasses.field(default_factory=list)  # the spec most inputs share
    scans: tuple = ()  # the kinds of values CumSum may take (see _draw_inputs)
    inputs: list = dataclasses.field(default_factory=list)
    program: _Program | None = None
    layers: list = dataclasses.field(default_factory=list)  # transforms, outermost first
    modes: list = dataclasses.field(default_factory=list)  # per input, its placement
    base: list = dataclasses.field(default_factory=list)  # per input, its base dims' spec
    # per input, the dims vmap and scan add, outermost first: (size, entry, layer index)
    lead: list = dataclasses.field(default_factory=list)
    in_axes: dict = dataclasses.field(default_factory=dict)  # vmap layer -> batched inputs
    manual: tuple = ()  # the manual axes of a shard_map
    steps: int = STEPS
    geometry: Geometry = Geometry()

    @property
    def explicit(self) -> bool:
        return self.axis_type == "explicit"

    @property
    def axes(self) -> dict:
        return self.geometry.axes[self.mesh_name]

    def full_shape(self, i: int) -> tuple:
        return tuple(s for s, _, _ in self.lead[i]) + _base_shape(self.inputs[i].kind,
                                                                   self.shape)

    def spec_text(self, i: int) -> str:
        if self.modes[i] == "unsharded":
            return "unsharded"
        if self.modes[i] == "replicated":
            return "P()"
        return render_spec([e for _, e, _ in self.lead[i]] + self.base[i])


def draw(seed: int, geometry: Geometry = TWO_BY_TWO) -> Draw:
    """Draw number `seed` (the same program for the same seed, in any process); a draw of
    the "processes" group over `geometry`'s processes and devices."""
    rnd = random.Random(seed)
    group = group_of(seed)
    geometry = geometry if group == "processes" else Geometry()
    processes = geometry.processes
    if processes > 1:  # 2 processes x 2 devices (jax.distributed), either mesh and axis type
        axis_type, mesh_name = rnd.choice(("auto", "explicit")), rnd.choice(("1d", "2d"))
    else:
        axis_type, mesh_name = group.split("-")
    d = _Draft(seed, rnd, group, processes, axis_type, mesh_name,
               {f"group:{group}", f"mesh:{axis_type}-{mesh_name}"}, geometry=geometry)
    d.set_mesh = rnd.random() < (0.9 if d.explicit else 0.3)
    d.features.add("set_mesh" if d.set_mesh else "no_set_mesh")
    _draw_program(d)
    _draw_placements(d)
    _draw_leading_dims(d)
    if "transform:scan" in d.features and (any(d.base[0]) or any(e for _, e, _ in d.lead[0])):
        d.features.add("split_carry")
    if "shard_map" in d.layers:
        d.manual = tuple(d.axes)
        if len(d.manual) == 2 and rnd.random() < 0.2:
            d.manual = (rnd.choice(d.manual),)
            d.features.add("partial_shard_map")
    lines, chain = render(d)
    program = d.program
    args = ", ".join(v.name for v in d.inputs)
    shown = [f"{v.name}: {v.dtype}{list(d.full_shape(i))} {d.spec_text(i)}"
             for i, v in enumerate(d.inputs)]
    reused = "; ".join(f"{k} = {v}" for k, v in program.reused.items())
    where = group if processes == 1 else f"{group} ({axis_type}-{mesh_name})"
    summary = (f"{where}{', set_mesh' if d.set_mesh else ''}: {chain}; {'; '.join(shown)}; "
               f"program({args}): {'; '.join(program.lines)}; return {program.result}"
               + (f" [{reused}]" if reused else ""))
    specs = d.explicit
    rtol = 1e-4 if "dtype:float32" in d.features else 1e-10
    untyped = tuple(d.full_shape(i) for i in range(len(d.inputs))
                    if d.modes[i] == "unsharded")
    return Draw(seed, group, "\n".join(lines), summary, specs, rtol, processes,
                frozenset(d.features), untyped, geometry)


def _draw_program(d: _Draft) -> None:
    """The inputs, the program and the transforms."""
    rnd = d.rnd
    _draw_inputs(d)
    d.program = _Program(rnd, d.inputs, len(d.shape), d.scans)
    d.layers = layers = _layers(rnd, linear_only=set(d.program.used) <= set(LINEAR))
    if "scan" in layers:
        # The program again, its first op on the carry, every op kind alike (inputs it
        # may take drawn anew where needed): each kind meets a carry whose type the
        # step must keep. Differentiated twice, the program keeps to linear ops.
        twice = sum(t in DERIVATIVES for t in layers) > 1
        carry = rnd.choice(LINEAR if twice else OPS)
        for _ in range(CARRY_TRIES):
            if carry in _choices(d.inputs[0], d.inputs, len(d.shape), d.scans, twice):
                break
            _draw_inputs(d)
        else:
            carry = rnd.choice(_choices(d.inputs[0], d.inputs, len(d.shape), d.scans, twice))
        d.program = _Program(rnd, d.inputs, len(d.shape), d.scans, carry=carry, linear=twice)
    d.features |= {f"dtype:{v.dtype}" for v in d.inputs} | {f"kind:{v.kind}" for v in d.inputs}
    d.features |= d.program.features | {f"op:{op}" for op in d.program.used}
    d.features |= {f"transform:{t}" for t in layers} | {f"depth:{len(layers)}"}
    if not layers:
        d.features.add("transform:eager")
    if "shard_map" in layers and "jit" not in layers[:layers.index("shard_map")] \
            and rnd.random() < 0.7:
        # mostly jitted: an eager shard_map compiles every primitive (seconds per draw)
        layers.insert(layers.index("shard_map"), "jit")


def _draw_inputs(d: _Draft) -> None:
    """The base shape, the spec most inputs share, and the inputs."""
    rnd = d.rnd
    d.shape = rnd.choice(d.geometry.shapes)
    d.aligned = _spec(rnd, d.shape, d.axes)
    last_dims = {"full": d.aligned[-1], "last": d.aligned[-1], "first": d.aligned[0]}
    # the kinds of values whose last dim CumSum may need whole (under Explicit axes
    # JAX's cumsum, the twin, refuses a split one)
    d.scans = tuple(k for k, e in last_dims.items() if e is None or not d.explicit)
    dtype = "complex128" if rnd.random() < 0.15 else rnd.choice(("float32", "float64"))
    d.inputs = []
    for i in range(rnd.choice((1, 2, 2, 3, 3))):
        kind = "full" if i == 0 or len(d.shape) == 1 else rnd.choices(
            ("full", "last", "first"), (4, 4, 2))[0]
        own = dtype
        if i and dtype != "complex128" and rnd.random() < 0.15:
            own = "float64" if dtype == "float32" else "float32"
        d.inputs.append(_Value(ARGS[i], kind, own))


def _draw_placements(d: _Draft) -> None:
    """Each input's placement and the spec of its base dims."""
    for i, value in enumerate(d.inputs):
        if "shard_map" in d.layers:
            mode = "aligned"
        else:
            # Explicit axes: JAX refuses to combine differently split arrays (the twin too)
            weights = (74, 4, 15, 7) if d.explicit else (55, 20, 15, 10)
            mode = d.rnd.choices(PLACEMENTS, weights)[0]
        if mode == "unsharded" and (i == 0 or d.processes > 1):
            mode = "aligned"  # (an array on one process's device cannot meet global ones)
        own = _base_shape(value.kind, d.shape)
        if mode == "aligned":
            aligned = d.aligned
            entries = {"full": aligned, "last": aligned[-1:], "first": aligned[:1]}[value.kind]
        elif mode == "random":
            entries = _spec(d.rnd, own, d.axes)
            if d.explicit and "CumSum" in d.program.used:
                entries[-1] = None
        else:
            entries = [None] * len(own)
        d.modes.append(mode)
        d.base.append(list(entries))
        d.features.add(f"placement:{mode}")


def _draw_leading_dims(d: _Draft) -> None:
    """The dims vmap (a batch, maybe split over a mesh axis) and scan (the steps of
    every input but the carry) add, from the innermost transform out."""
    n = len(d.inputs)
    taken = {a for e in d.aligned for a in axes_of(e)}
    d.lead = [[] for _ in d.inputs]
    for index in reversed(range(len(d.layers))):
        if d.layers[index] == "vmap":
            free = [a for a in d.axes if a not in taken]
            axis = d.rnd.choice(free) if free and d.rnd.random() < 0.75 else None
            if "shard_map" in d.layers[index:]:
                axis = None  # a vmap of a shard_map cannot split its batch over a mesh axis
            taken |= {axis} if axis else set()
            batched = [True] + [d.rnd.random() < 0.8 for _ in d.inputs[1:]]
            d.in_axes[index] = batched
            d.features |= {"in_axes_none"} if not all(batched) else set()
            entries = []
            for i in range(n):
                own = {a for e in d.base[i] + [e for _, e, _ in d.lead[i]] for a in axes_of(e)}
                entries.append(axis if d.modes[i] in ("aligned", "random") and axis not in own
                               else None)
            if d.explicit and len({e for e, b in zip(entries, batched) if b}) > 1:
                entries = [None] * n  # JAX: vmapped inputs' batch dims split the same way
            for i in range(n):
                if batched[i]:
                    d.lead[i].insert(0, (d.geometry.batch, entries[i], index))
        elif d.layers[index] == "scan":
            for i in range(1, n):
                d.lead[i].insert(0, (STEPS, None, index))

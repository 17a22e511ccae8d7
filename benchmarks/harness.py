"""Interleaved timing of competing variants, plus the JSON report, the table and the chart.

A *case* is a set of variants (zero-argument callables returning JAX values)
that compute the same thing. :func:`build_variants` compiles, runs and checks
each variant once (one that fails or disagrees is skipped, not fatal); then
:func:`time_case` alternates them in rounds (A B C, B C A, C A B, ...), so
slow drifts of the machine (frequency scaling, other processes) hit every
variant alike. Each round times one batch of calls per variant with
:func:`time.perf_counter`; every call is followed by ``jax.block_until_ready``,
so the numbers are per-call latencies, not throughput of an asynchronous queue.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class Stats:
    """Per-call seconds of one variant: one sample per round."""

    samples: list[float]
    number: int  # calls per timed batch

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    def as_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.min, "number": self.number,
                "rounds": len(self.samples), "samples_s": self.samples}


def build_variants(candidates: Mapping[str, Callable[[], Callable[[], Any]] | None], *,
                   unchecked: Collection[str] = (), rtol: float = 1e-12,
                   atol: float = 0.0) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """Builds every candidate variant, runs it once and checks its result.

    Args:
      candidates: name -> a maker (a zero-argument callable returning the variant), or None
        where the variant's library is not installed. Making and the first call compile.
      unchecked: names whose result is not compared (rules that write nothing, say).
      rtol, atol: how close each variant's first output must be to the first checked
        variant's; `atol` is relative to that reference's largest magnitude.

    Returns:
      (variants, skipped): name -> variant, ready for :func:`time_case`, and name -> why
      it was left out ("not installed", the error it raised, or "wrong result").
    """
    variants, skipped, reference = {}, {}, None
    for name, make in candidates.items():
        if make is None:
            skipped[name] = "not installed"
            continue
        try:
            fn = make()
            result = jax.block_until_ready(fn())
        except Exception as error:  # noqa: BLE001 - report and carry on
            skipped[name] = f"{type(error).__name__}: {error}"[:300]
            continue
        if name not in unchecked:
            value = np.asarray(jax.tree_util.tree_leaves(result)[0])
            if reference is None:
                reference = value
            elif not np.allclose(value, reference, rtol=rtol,
                                 atol=atol * float(np.max(np.abs(reference), initial=0.0))):
                skipped[name] = "wrong result"
                continue
        variants[name] = fn
    return variants, skipped


def _batch(fn: Callable[[], Any], number: int) -> float:
    block = jax.block_until_ready
    start = time.perf_counter()
    for _ in range(number):
        block(fn())
    return time.perf_counter() - start


def calibrate(fn: Callable[[], Any], target_s: float, max_number: int = 100_000) -> int:
    """Calls per batch so that one batch of `fn` takes about `target_s`."""
    number = 1
    while True:
        elapsed = _batch(fn, number)
        if elapsed >= target_s / 4 or number >= max_number:
            break
        number *= 4
    per_call = elapsed / number
    return max(1, min(max_number, round(target_s / per_call)))


def time_case(variants: Mapping[str, Callable[[], Any]], *, rounds: int,
              target_s: float, warmup: int = 3, max_seconds: float | None = None,
              min_rounds: int = 5, number: int | None = None,
              settle: int = 0) -> dict[str, Stats]:
    """Times already-compiled variants in interleaved rounds.

    Args:
      variants: name -> zero-argument callable; every variant computes the same thing.
      rounds: timed batches per variant; the statistics are over these.
      target_s: about how long one batch of one variant takes (sets its call count).
      warmup: untimed calls of each variant before calibration.
      max_seconds: if given, fewer rounds (not fewer than `min_rounds`) when all
        of them would take longer than this (slow cases: large arrays).
      number: if given, calls per batch for every variant, without calibrating (one
        call per round for variants that must not repeat, e.g. a fresh compilation).
      settle: untimed calls of a variant right before each of its timed batches. The
        first call after another variant has run for a while can be slower (the worker
        threads went idle, caches were refilled): where a batch is one or a few calls,
        that cost would land on whichever variant follows a long one.

    Returns:
      name -> :class:`Stats` of the per-call time.
    """
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            jax.block_until_ready(variants[name]())
    numbers = {name: number if number is not None else calibrate(variants[name], target_s)
               for name in names}
    if max_seconds is not None:
        round_s = sum(_batch(variants[name], numbers[name] + settle) for name in names)
        rounds = max(min_rounds, min(rounds, int(max_seconds / max(round_s, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        # Rotating the order keeps any variant from always following the same one.
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(settle):
                jax.block_until_ready(variants[name]())
            samples[name].append(_batch(variants[name], numbers[name]) / numbers[name])
    return {name: Stats(samples[name], numbers[name]) for name in names}


def ratios(stats: Mapping[str, Stats], reference: str, *, key: str = "median") -> dict[str, float]:
    """Each variant's time divided by `reference`'s (empty if the reference is absent)."""
    if reference not in stats:
        return {}
    base = getattr(stats[reference], key)
    return {name: getattr(s, key) / base for name, s in stats.items()}


def write_json(path, report: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")


def format_time(seconds: float) -> str:
    if seconds >= 1e-1:
        return f"{seconds:8.3f} s "
    if seconds >= 1e-4:
        return f"{seconds * 1e3:8.3f} ms"
    return f"{seconds * 1e6:8.2f} µs"


def _ratio_cell(value: float | None, width: int) -> str:
    return " " * width if value is None else f"{value:{width}.2f}"


def print_case(title: str, stats: Mapping[str, Stats],
               ratio_columns: Mapping[str, Mapping[str, float]],
               skipped: Mapping[str, str] | None = None) -> None:
    """Prints one case: per variant the median and min per-call time and its ratios.

    Args:
      title: the case's heading.
      stats: name -> :class:`Stats`, as :func:`time_case` returns them.
      ratio_columns: column heading -> (name -> ratio), as :func:`ratios` returns them;
        a variant without a ratio gets a blank cell.
      skipped: name -> why the variant was not timed.
    """
    headings = list(ratio_columns)
    print(f"\n{title}")
    print(f"  {'variant':28s} {'median':>11s} {'min':>11s}"
          + "".join(f" {heading:>{len(heading) + 1}s}" for heading in headings))
    for name, s in stats.items():
        cells = "".join(f" {_ratio_cell(ratio_columns[h].get(name), len(h) + 1)}"
                        for h in headings)
        print(f"  {name:28s} {format_time(s.median)} {format_time(s.min)}{cells}")
    for name, why in (skipped or {}).items():
        print(f"  {name:28s} skipped: {why}")


def draw_chart(path, cases: Mapping[str, Mapping[str, Any]], *, title: str = "",
               ylabel: str = "µs per call (median)") -> None:
    """One panel per case: median per-call time of each variant (bars), min (ticks).

    Args:
      path: PNG file to write.
      cases: case name -> the case's report entry (``variants`` -> ``median_s``/``min_s``).
      title: figure title.
      ylabel: the panels' y-axis label (what one timed call is, e.g. a whole loop).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = {"jaxdecl": "#1f77b4", "jaxbind": "#ff7f0e", "pure_callback": "#2ca02c",
               "buffer_callback": "#9467bd", "native": "#7f7f7f"}
    names = list(cases)
    ncols = min(4, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        variants = cases[name]["variants"]
        labels = list(variants)
        medians = [variants[v]["median_s"] * 1e6 for v in labels]
        mins = [variants[v]["min_s"] * 1e6 for v in labels]
        colors = [palette.get(v.split("[")[0], "#17becf") for v in labels]
        xs = range(len(labels))
        ax.bar(xs, medians, color=colors)
        ax.scatter(xs, mins, marker="_", color="black", s=200, zorder=3, label="min")
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(cases: Mapping[str, Mapping[str, Any]]) -> str:
    """The report's cases as one Markdown table (times in µs, ratios of medians)."""
    lines = ["| case | variant | median µs | min µs | / native | / JAXbind |",
             "|---|---|---:|---:|---:|---:|"]
    for entry in cases.values():
        for name, v in entry["variants"].items():
            rn = "" if v.get("vs_native") is None else f"{v['vs_native']:.2f}"
            rb = "" if v.get("vs_jaxbind") is None else f"{v['vs_jaxbind']:.2f}"
            lines.append(f"| {entry['title']} | {name} | {v['median_s'] * 1e6:,.1f} | "
                         f"{v['min_s'] * 1e6:,.1f} | {rn} | {rb} |")
    return "\n".join(lines)

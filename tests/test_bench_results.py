"""The committed benchmark figures: the results file and the pages that quote it show one run.

A re-run of ``benchmarks/bench_bindings.py --only finufft_`` rewrites
``benchmarks/results_finufft.json``; its ``--markdown`` table goes into the pages
below. A re-run without the pages, or a page edited by hand, fails here, naming the page.
"""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results_finufft.json"
#: Where the contrib.finufft / jax-finufft ratios are quoted: page -> the first header cell
#: of its table (whose columns are MODES, in this order).
QUOTED = {
    ROOT / "docs" / "contrib-finufft.md": "contrib.finufft / jax-finufft",
    ROOT / "benchmarks" / "README.md": "case",
}
MODES = ("forward", "grad", "grad-points", "jvp", "new-points")


def quoted_table(page: pathlib.Path, first: str) -> dict:
    """The page's ratio table: row title -> the ratios as printed, one per mode."""
    text = page.read_text()
    head = next((line for line in text.splitlines() if line.startswith(f"| {first} | forward |")),
                None)
    assert head is not None, f"{page.name} has no table headed '| {first} | forward | ...'"
    rows = text.split(head, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def committed_table() -> dict:
    """The results file's ratios of medians, formatted as the pages print them."""
    table = json.loads(RESULTS.read_text())["table"]
    return {case["title"]: [f"{case[m]['ratio']:.2f}" if m in case else "missing"
                            for m in MODES] for case in table.values()}


def test_the_results_file_has_every_mode_of_every_case():
    """One run made every column: none is missing from the file (a column measured in a
    separate run is not in it)."""
    missing = {title: [m for m, r in zip(MODES, ratios) if r == "missing"]
               for title, ratios in committed_table().items()}
    assert not any(missing.values()), f"{RESULTS.name} lacks {missing}"


@pytest.mark.parametrize("page", list(QUOTED), ids=lambda p: p.name)
def test_the_pages_quote_the_committed_run(page):
    """Every ratio the page's table prints is the committed file's, to two decimals, and
    the table has every case of the file and no other."""
    assert quoted_table(page, QUOTED[page]) == committed_table(), (
        f"{page.relative_to(ROOT)}'s table is not {RESULTS.relative_to(ROOT)}'s run: re-run "
        f"`python benchmarks/bench_bindings.py --only finufft_ --markdown` and paste its table")


def test_a_page_edited_by_hand_is_caught(tmp_path):
    """The check itself can fail: one changed ratio is a difference."""
    page = tmp_path / "page.md"
    original = (ROOT / "docs" / "contrib-finufft.md").read_text()
    first_row = next(line for line in original.splitlines() if line.startswith("| 1-D type 1,"))
    cells = first_row.split("|")
    cells[2] = " 9.99 "
    page.write_text(original.replace(first_row, "|".join(cells), 1))
    assert quoted_table(page, QUOTED[ROOT / "docs" / "contrib-finufft.md"]) != committed_table()

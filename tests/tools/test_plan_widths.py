"""`fivefold plan`'s tables fit a terminal of 80-120 columns: no line is wider than the terminal,
and at 100 columns and more every layout item (key=value) stays whole on one line, so a layout
can be read (and copied back into --layout) from the table."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from fivefold.planner.hardware import get_hardware
from fivefold.planner.models import load_model
from fivefold.planner.search import search
from fivefold.planner.spec import parse_layout
from fivefold.tools.plan_compare import axes_rows, axes_table, hsdp_rows, hsdp_table, zero3_pp_rows, zero3_pp_table
from fivefold.tools.plan_render import format_table, wrappable


def _render(renderable, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


@pytest.fixture(scope="module")
def tables_and_layouts() -> list:
    return list(_tables_and_layouts())


def _tables_and_layouts():
    model, hw = load_model("llama3-70b"), get_hardware("H100-80GB")
    ranked = search(model, gpus=64, hardware=hw, global_batch=512, top=5)
    yield "ranking", format_table(ranked, top=5), [lay.short() for lay, _ in ranked]
    yield "axes", axes_table(model, 64, hw, "bf16", 512), [r["layout"] for r in axes_rows(model, 64, hw, "bf16", 512)
                                                           if "layout" in r]
    yield "hsdp", hsdp_table(model, 64, hw, "bf16", 512), [r["layout"] for r in hsdp_rows(model, 64, hw, "bf16", 512)]
    yield "zero3-pp", zero3_pp_table(model, 64, hw, "bf16", 512), [
        r["layout"] for r in zero3_pp_rows(model, 64, hw, "bf16", 512)]


@pytest.mark.parametrize("width", [80, 100, 120])
def test_plan_tables_fit_the_terminal_and_keep_layout_items_whole(width, tables_and_layouts):
    for name, table, layouts in tables_and_layouts:
        lines = _render(table, width)
        assert max(map(len, lines)) <= width, (name, width, max(lines, key=len))
        if width < 100:
            continue
        text = "\n".join(lines)
        for layout in layouts:
            for item in layout.split(","):
                assert item in text, (name, width, item)  # never cut inside an item


def test_a_wrapped_layout_parses_as_the_original():
    text = "dp=8,tp=1,pp=8,zero=3,schedule=1f1b,recompute=full,mb=1"
    assert parse_layout(wrappable(text)) == parse_layout(text)

"""Headless Chromium for the HTML report tests, and the check that a rendered report's DOM
says what its plan JSON says.

Chromium and its driver come from Debian (`apt-get install -y chromium chromium-driver`; .ci/run
installs them); selenium from the `test` extra. A missing browser fails the test with that
instruction rather than skipping it: a skipped browser test would pass CI while proving nothing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("AUTOPAR_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("AUTOPAR_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = "install them with `apt-get install -y chromium chromium-driver` (.ci/run does)"


def start_chromium(width: int = 1280, height: int = 900):
    """A headless Chromium driven by selenium, logging the browser console at every level."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.exists(p) or shutil.which(p))]
    if missing:
        pytest.fail(
            f"the HTML report tests need Chromium: {', '.join(missing)} not found; {INSTALL}"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the HTML report tests need selenium: pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={width},{height}", "--no-first-run", "--disable-background-networking"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def open_report(driver, path: Path) -> list[dict[str, Any]]:
    """Load a report file; return the browser console entries logged at level SEVERE."""
    driver.get(path.resolve().as_uri())
    driver.execute_script("return document.readyState")
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver, path: Path, width: int = 1280) -> Path:
    """The whole page (window grown to the document's height) as a PNG."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(int(height) + 120, 16000))
    driver.save_screenshot(str(path))
    return path


# One script reads every figure the tests compare, as the browser parsed it.
_READ_DOM = """
const q = (sel) => Array.from(document.querySelectorAll(sel));
const bars = (id, total, part) => {
  const out = {};
  q('#' + id + ' g.bar').forEach((g) => {
    const parts = {}; const widths = {};
    g.querySelectorAll('rect[data-key]').forEach((r) => {
      parts[r.dataset.key] = Number(r.getAttribute('data-' + part));
      widths[r.dataset.key] = r.getBBox().width;
    });
    out[g.dataset.plan] = {total: Number(g.getAttribute('data-' + total)), parts: parts, widths: widths};
  });
  return out;
};
const h = document.getElementById('headline');
const z = document.getElementById('zero');
const limit = document.querySelector('#memory [data-budget-bytes]');
return {
  headline: {recipe: h.dataset.recipe, step_s: Number(h.dataset.stepS),
             peak: Number(h.dataset.peakBytes), budget: Number(h.dataset.budgetBytes)},
  step: bars('step-time', 'step-s', 'seconds'),
  memory: bars('memory', 'peak-bytes', 'bytes'),
  budget_line: limit ? Number(limit.dataset.budgetBytes) : null,
  recipes: q('#recipes tr[data-plan]').map((tr) => ({plan: tr.dataset.plan, step_s: Number(tr.dataset.stepS),
             peak: Number(tr.dataset.peakBytes), fits: tr.dataset.fits === 'true'})),
  cells: q('#layouts td.cell').map((td) => [td.dataset.fqn, td.dataset.placement,
             td.querySelectorAll('span.ax').length]),
  zero: {stage: Number(z.dataset.stage), axes: z.dataset.axes},
  segments: q('#checkpoint tr[data-module-path]').map((tr) => tr.dataset.modulePath),
  warnings: q('#warnings li').map((li) => li.textContent),
  warning_count: Number(document.getElementById('warnings').dataset.count),
};
"""


def read_dom(driver) -> dict[str, Any]:
    return driver.execute_script(_READ_DOM)


def _bar_mismatches(
    figure: str, dom: Mapping[str, Any], want: Mapping[str, tuple[float, Mapping[str, float]]]
) -> list[str]:
    out = []
    if set(dom) != set(want):
        out.append(f"{figure}: plans {sorted(dom)} in the DOM, {sorted(want)} in the plan")
    for name in set(dom) & set(want):
        total, parts = want[name]
        bar = dom[name]
        if bar["total"] != total:
            out.append(f"{figure}/{name}: total {bar['total']!r} in the DOM, {total!r} in the plan")
        nonzero = {k: float(v) for k, v in parts.items() if v > 0}
        if bar["parts"] != nonzero:
            out.append(f"{figure}/{name}: parts {bar['parts']} in the DOM, {nonzero} in the plan")
        # The drawn widths must follow the figures (one scale per figure; tiny parts get 0.5 px).
        scales = [
            bar["widths"][k] / v for k, v in bar["parts"].items() if v > 0 and bar["widths"][k] > 2
        ]
        if scales and max(scales) > 1.01 * min(scales):
            out.append(f"{figure}/{name}: bar widths are not proportional to the figures")
    return out


def report_mismatches(dom: Mapping[str, Any], data: Mapping[str, Any]) -> list[str]:
    """Every way the report's DOM (``read_dom``) differs from the plan JSON ``data``; [] when
    the headline, both figures, the recipes, every layout, ZeRO, checkpoint and warnings agree."""
    out = []
    pred = data["predicted"]
    head = dom["headline"]
    for key, want in (("recipe", data["recipe"]), ("step_s", pred["step_s"]),
                      ("peak", pred["peak_memory_bytes"]), ("budget", data["memory_budget_bytes"])):  # fmt: skip
        if head[key] != want:
            out.append(f"headline {key}: {head[key]!r} in the DOM, {want!r} in the plan")
    figures = {
        data["recipe"]: pred,
        **{n: b for n, b in data["baselines"].items() if n != data["recipe"]},
    }
    out += _bar_mismatches(
        "step-time", dom["step"], {n: (f["step_s"], f["breakdown"]) for n, f in figures.items()}
    )
    out += _bar_mismatches(
        "memory",
        dom["memory"],
        {n: (f["peak_memory_bytes"], f["memory"]) for n, f in figures.items()},
    )
    if dom["budget_line"] != data["memory_budget_bytes"]:
        out.append(
            f"memory budget line at {dom['budget_line']!r}, budget {data['memory_budget_bytes']!r}"
        )
    fits = {data["recipe"]: pred["peak_memory_bytes"] <= data["memory_budget_bytes"],
            **{n: bool(b["fits"]) for n, b in data["baselines"].items() if n != data["recipe"]}}  # fmt: skip
    rows = {r["plan"]: r for r in dom["recipes"]}
    if set(rows) != set(figures):
        out.append(f"recipes table lists {sorted(rows)}, the plan {sorted(figures)}")
    for name in set(rows) & set(figures):
        got = (rows[name]["step_s"], rows[name]["peak"], rows[name]["fits"])
        want = (figures[name]["step_s"], figures[name]["peak_memory_bytes"], fits[name])
        if got != want:
            out.append(f"recipes table {name}: {got} in the DOM, {want} in the plan")
    cells = {fqn: placement for fqn, placement, _ in dom["cells"]}
    want_cells = {fqn: p["placement"] for fqn, p in data["params"].items()}
    if len(dom["cells"]) != len(cells):
        out.append("a parameter appears twice in the layout grids")
    for fqn in sorted(set(cells) | set(want_cells)):
        if cells.get(fqn) != want_cells.get(fqn):
            out.append(
                f"layout of {fqn}: {cells.get(fqn)} in the DOM, {want_cells.get(fqn)} in the plan"
            )
    stripes = {n for _, _, n in dom["cells"]}
    if stripes and stripes != {len(data["mesh"]["shape"])}:
        out.append(
            f"layout cells have {sorted(stripes)} stripes for a {len(data['mesh']['shape'])}-axis mesh"
        )
    zero = data["zero"]
    if (dom["zero"]["stage"], dom["zero"]["axes"]) != (zero["stage"], ",".join(zero["axes"])):
        out.append(
            f"ZeRO {dom['zero']} in the DOM, stage {zero['stage']} on {zero['axes']} in the plan"
        )
    want_segments = [s["module_path"] for s in data["checkpoint"]["segments"]]
    if dom["segments"] != want_segments:
        out.append(f"recomputed segments {dom['segments']} in the DOM, {want_segments} in the plan")
    if dom["warning_count"] != len(data["warnings"]) or (
        data["warnings"] and dom["warnings"] != data["warnings"]
    ):
        out.append(f"warnings {dom['warnings']} in the DOM, {data['warnings']} in the plan")
    return out

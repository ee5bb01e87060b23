"""The HTML plan report in a real browser (headless Chromium): it renders without console
errors, loads nothing from outside the file, and its DOM says what the plan JSON says; a
report whose figures differ from the plan is caught. Screenshots land in each test's tmp dir."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from autopar.plan.document import PLAN_VERSION, Plan
from autopar.plan.report_html import render_plan_html, write_plan_html
from autopar.tools.cli import main
from tests.browser.report_dom import (
    open_report,
    read_dom,
    report_mismatches,
    screenshot,
    start_chromium,
)

STORED = Path(__file__).resolve().parents[1] / "planner" / "stored_plans"
# 2x2 auto plan of GPT-2 (2 layers); a budget-bound plan that recomputes 2 segments; a 2x2
# megatron recipe of a tiny LLaMA; a 1-D mesh of an MLP; a ZeRO-2 plan.
PLANS = [
    "gpt2-small-2l-2x2",
    "tiny-gpt-2-tight",
    "tiny-llama-2x2-megatron",
    "mlp-4",
    "tiny-gpt-2-zero",
]


@pytest.fixture(scope="module")
def browser():
    driver = start_chromium()
    yield driver
    driver.quit()


def _data(name: str) -> dict:
    return json.loads((STORED / f"{name}.json").read_text())


@pytest.mark.parametrize("name", PLANS)
def test_report_renders_cleanly_and_its_dom_equals_the_plan(browser, tmp_path, name) -> None:
    data = _data(name)
    path = tmp_path / "report.html"
    write_plan_html(data, str(path))
    severe = open_report(browser, path)
    assert severe == [], severe
    assert report_mismatches(read_dom(browser), data) == []
    shot = screenshot(browser, tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_check_fails_when_the_report_differs_from_the_plan(browser, tmp_path) -> None:
    data = _data("tiny-gpt-2-tight")
    path = tmp_path / "report.html"
    write_plan_html(data, str(path))
    open_report(browser, path)
    dom = read_dom(browser)
    assert report_mismatches(dom, data) == []

    # The plan changed after rendering: one placement, one step-time part, one recipe's fit.
    fqn = next(iter(data["params"]))
    changed = copy.deepcopy(data)
    changed["params"][fqn]["placement"] = "S0" if data["params"][fqn]["placement"] != "S0" else "R"
    changed["predicted"]["breakdown"]["compute_s"] *= 1.001
    changed["baselines"]["ddp"]["fits"] = not data["baselines"]["ddp"]["fits"]
    found = "\n".join(report_mismatches(dom, changed))
    assert f"layout of {fqn}" in found
    assert "step-time/auto: parts" in found
    assert "recipes table ddp" in found

    # A report rendered from a modified plan, checked against the real one.
    other = copy.deepcopy(data)
    other["predicted"]["peak_memory_bytes"] += 1.0
    other["checkpoint"]["segments"] = other["checkpoint"]["segments"][:1]
    write_plan_html(other, str(path))
    open_report(browser, path)
    found = "\n".join(report_mismatches(read_dom(browser), data))
    assert (
        "headline peak" in found
        and "memory/auto: total" in found
        and "recomputed segments" in found
    )


def test_hover_shows_the_tensor_its_bytes_and_layout(browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    data = _data("gpt2-small-2l-2x2")
    path = tmp_path / "report.html"
    write_plan_html(data, str(path))
    open_report(browser, path)
    cell = browser.find_element(By.CSS_SELECTOR, 'td.cell[data-fqn="blocks.0.mlp.fc.weight"]')
    ActionChains(browser).move_to_element(cell).perform()
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed()
    text = tip.text
    placement = data["params"]["blocks.0.mlp.fc.weight"]["placement"]
    # 3072 x 768 fp32 = 9 MiB in all; split 2 ways on dp (S0) -> 4.5 MiB per device.
    assert "blocks.0.mlp.fc.weight" in text and "9.00 MiB in all" in text, text
    assert f"layout {placement}" in text and "4.50 MiB per device" in text, text
    bar = browser.find_element(
        By.CSS_SELECTOR, '#memory g.bar[data-plan="ddp"] rect[data-key="optimizer"]'
    )
    ActionChains(browser).move_to_element(bar).perform()
    assert tip.text.startswith("ddp: optimizer state"), tip.text
    screenshot(browser, tmp_path / "hover.png")


def test_report_loads_nothing_from_outside_the_file(browser, tmp_path) -> None:
    path = tmp_path / "report.html"
    path.write_text(render_plan_html(_data("tiny-gpt-2-tight")))
    open_report(browser, path)
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert resources == []
    external = browser.execute_script(
        "return Array.from(document.querySelectorAll('[src],[href]')).map(e => e.src || e.href)"
    )
    assert external == []


def test_cli_show_writes_the_report_of_the_saved_plan(browser, tmp_path, capsys) -> None:
    report = tmp_path / "show.html"
    plan_file = tmp_path / "plan.json"  # the stored plans leave out the volatile version fields
    data = _data("tiny-gpt-2-tight")
    data.update(
        version=PLAN_VERSION,
        autopar_version="0.1.0",
        timings={"capture_s": 1.0, "strategies_s": 1.0, "solve_s": 1.0},
    )
    data["solver"].update(build_s=0.1, solve_s=0.2)
    plan_file.write_text(json.dumps(data))
    assert main(["show", str(plan_file), "--html", str(report)]) == 0
    assert f"report written to {report}" in capsys.readouterr().out
    assert open_report(browser, report) == []
    assert report_mismatches(read_dom(browser), Plan.load(plan_file).data) == []


@pytest.mark.parametrize("where", ["missing-dir/r.html", "."])
def test_html_path_that_cannot_be_written_is_one_line_before_planning(
    tmp_path, capsys, where
) -> None:
    target = str(tmp_path / where)
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "mlp", "--mesh", "2", "--html", target])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--html" in err and ("does not exist" in err or "is a directory" in err), err


_READ_COMPARISON = """
const rows = (sel, keys) => Array.from(document.querySelectorAll(sel)).map(
  (tr) => Object.fromEntries(keys.map((k) => [k, tr.getAttribute('data-' + k)])));
return {
  table: rows('#comparison tr[data-plan]', ['plan', 'step-s', 'peak-bytes', 'fits']),
  bars: rows('#compare-step-time g.bar', ['plan', 'step-s']),
  memory: rows('#compare-memory g.bar', ['plan', 'peak-bytes']),
  measured: rows('#measured tr[data-plan]', ['plan', 'predicted-s', 'measured-s']),
  pairs: rows('#measured-steps g.pair', ['plan', 'predicted-s', 'measured-s']),
  headline: document.getElementById('headline').dataset.stepS,
  cells: Array.from(document.querySelectorAll('#layouts td.cell')).map((td) => [td.dataset.fqn, td.dataset.placement]),
  grids: document.querySelectorAll('details .layouts').length,
};
"""


def _record_plans(monkeypatch) -> dict:
    from autopar.tools import report

    seen: dict = {}
    real = report.plans_for_recipes

    def recording(*args, **kwargs):
        seen.update(real(*args, **kwargs))
        return seen

    monkeypatch.setattr(report, "plans_for_recipes", recording)
    return seen


@pytest.mark.slow  # plans a model: 2-20 s on a loaded 2-core machine
def test_compare_html_puts_the_plans_side_by_side(browser, tmp_path, monkeypatch, capsys) -> None:
    plans = _record_plans(monkeypatch)
    out = tmp_path / "compare.html"
    assert main(["compare", "mlp", "--mesh", "2", "--seq", "128", "--html", str(out)]) == 0
    assert f"report written to {out}" in capsys.readouterr().out
    assert open_report(browser, out) == []
    dom = browser.execute_script(_READ_COMPARISON)
    want = {n: p.data["predicted"] for n, p in plans.items()}
    assert [r["plan"] for r in dom["table"]] == list(want) and len(want) >= 4
    for row in dom["table"]:
        assert float(row["step-s"]) == want[row["plan"]]["step_s"]
        assert float(row["peak-bytes"]) == want[row["plan"]]["peak_memory_bytes"]
    assert {r["plan"]: float(r["step-s"]) for r in dom["bars"]} == {
        n: w["step_s"] for n, w in want.items()
    }
    assert {r["plan"]: float(r["peak-bytes"]) for r in dom["memory"]} == {
        n: w["peak_memory_bytes"] for n, w in want.items()
    }
    assert dom["grids"] == len(want)  # every plan's layouts, collapsed
    assert float(dom["headline"]) == want["auto"]["step_s"]  # the auto plan in detail
    assert dict(dom["cells"]) == plans["auto"].param_placements()
    screenshot(browser, tmp_path / "compare.png")


@pytest.mark.slow  # plans a model: 2-20 s on a loaded 2-core machine
def test_bench_cost_html_has_predicted_vs_measured(browser, tmp_path, monkeypatch, capsys) -> None:
    from autopar.tools import bench_cost, report

    measured = {"auto": 2.5e-3, "ddp": 4.0e-3}

    def fake_run(spec, plans, config, nproc):  # the plans, as if each rank had run them
        return {"ops": [], "plans": {
            name: {"mesh": "2", "predicted_step_s": plans[name].predicted_step_s, "step_s": measured[name],
                   "predicted_peak_memory_bytes": plans[name].predicted_peak_memory_bytes,
                   "peak_memory_bytes": 3e6} for name in plans}}  # fmt: skip

    monkeypatch.setattr(bench_cost, "run_bench", fake_run)
    monkeypatch.setattr(report, "plot_step_bars", lambda rows, path, title: None)
    plans = _record_plans(monkeypatch)
    out = tmp_path / "bench.html"
    argv = ["bench-cost", "mlp", "--mesh", "2", "--seq", "128", "--no-ops", "--recipes", "auto,ddp",
            "--plots", str(tmp_path / "b"), "--html", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert f"report written to {out}" in capsys.readouterr().out
    assert open_report(browser, out) == []
    dom = browser.execute_script(_READ_COMPARISON)
    for rows in (dom["measured"], dom["pairs"]):
        assert {r["plan"]: (float(r["predicted-s"]), float(r["measured-s"])) for r in rows} == {
            n: (plans[n].predicted_step_s, measured[n]) for n in measured
        }
    screenshot(browser, tmp_path / "bench.png")


@pytest.mark.slow  # plans a model: 2-20 s on a loaded 2-core machine
def test_cli_plan_writes_the_report_on_a_3d_mesh(browser, tmp_path, capsys) -> None:
    plan_file, report = tmp_path / "plan.json", tmp_path / "plan.html"
    argv = ["plan", "mlp", "--mesh", "2x2x2", "--seq", "128", "--no-cache", "--out", str(plan_file),
            "--html", str(report)]  # fmt: skip
    assert main(argv) == 0
    assert f"report written to {report}" in capsys.readouterr().out
    assert open_report(browser, report) == []
    dom = read_dom(browser)
    assert {n for _, _, n in dom["cells"]} == {3}  # one stripe per mesh axis
    assert report_mismatches(dom, Plan.load(plan_file).data) == []
    screenshot(browser, tmp_path / "plan.png")

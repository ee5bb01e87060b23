"""``autopar plan`` / ``autopar show`` output (issue 14 items 1-2): the README's quick start fits
80 columns in under 40 lines; live, cached and shown plans print the same summary; explain
answers from a saved file in a fresh process."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from autopar.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICK_START = [
    "plan",
    "llama3-8b-2l",
    "--mesh",
    "2x4",
    "--device",
    "h100",
    "--batch",
    "8",
    "--seq",
    "2048",
]


def _summary_part(text: str) -> str:
    """The printed summary without the planning-time and 'plan written' lines."""
    return "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("planned in", "planned earlier in", "plan written"))
    )


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The README's quick start at 80 columns (planned afresh: --no-cache)."""
    out = tmp_path_factory.mktemp("quick") / "plan.json"
    mp = pytest.MonkeyPatch()
    mp.setenv("COLUMNS", "80")
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main([*QUICK_START, "--no-cache", "--out", str(out)]) == 0
    mp.undo()
    return buffer.getvalue(), out


def test_quick_start_fits_80_columns_in_under_40_lines(quick_start: tuple[str, Path]) -> None:
    text, _ = quick_start
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert len(lines) < 40, text
    assert lines[0].endswith(".") and "parallel" in lines[0]
    assert "planned in " in text and "Layouts per layer block" in text
    assert "ZeRO configurations considered" not in text


def test_show_and_a_cached_run_print_the_same_summary(quick_start, monkeypatch, capsys) -> None:
    text, path = quick_start
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert _summary_part(shown) == _summary_part(text)
    assert "planned earlier in " in shown and "planned in " not in shown
    # Planned again with the cache on: the first run stores, the second is a cache hit that
    # says the planning time is the original run's.
    assert main([*QUICK_START]) == 0
    capsys.readouterr()
    assert main([*QUICK_START]) == 0
    captured = capsys.readouterr()
    # Progress on a redirected stderr: plain lines, neither wrapped nor padded.
    hit = [line for line in captured.err.splitlines() if line.startswith("plan cache hit: ")]
    assert len(hit) == 1 and hit[0].endswith(".json"), captured.err
    assert all(line == line.rstrip() for line in captured.err.splitlines())
    assert _summary_part(captured.out) == _summary_part(text)
    assert "planned earlier in " in captured.out


def test_120_columns_and_redirected_output(quick_start, monkeypatch, capsys) -> None:
    _, path = quick_start
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["show", str(path), "--verbose"]) == 0
    wide = capsys.readouterr().out
    assert max(len(line) for line in wide.splitlines()) <= 120
    assert "ZeRO configurations considered" in wide and "ZeRO choice:" in wide
    monkeypatch.delenv("COLUMNS")
    assert main(["show", str(path)]) == 0  # stdout is not a terminal here: plain unwrapped lines
    plain = capsys.readouterr().out
    assert any(
        line.startswith("  attention_norm.weight=") and "feed_forward.w2.weight=" in line
        for line in plain.splitlines()
    )


def test_explain_flag_before_or_after_the_file_and_on_plan(
    quick_start, monkeypatch, capsys
) -> None:
    _, path = quick_start
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["show", "--explain", "layers.0.attention.wq.weight", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("parameter layers.0.attention.wq.weight [4096, 4096]")
        and "layouts weighed" in out
    )
    assert max(len(line) for line in out.splitlines()) <= 80
    assert main(["show", str(path), "--explain", "output.weight,layers.1.feed_forward"]) == 0
    out = capsys.readouterr().out
    assert "parameter output.weight" in out and "module layers.1.feed_forward:" in out
    assert main(["show", str(path), "--explain", "norm", "--explain", "tok_embeddings.weight"]) == 0
    out = capsys.readouterr().out
    assert "module norm:" in out and "parameter tok_embeddings.weight" in out
    assert main([*QUICK_START, "--explain", "layers.0.attention.wq.weight"]) == 0
    out = capsys.readouterr().out
    assert "Layouts per layer block" in out and "parameter layers.0.attention.wq.weight" in out


def test_explain_from_a_saved_file_in_a_fresh_process(quick_start) -> None:
    _, path = quick_start
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "autopar.tools.cli",
            "show",
            "--explain",
            "layers.1.attention.wk.weight",
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "layouts weighed" in run.stdout and "* " in run.stdout and "slower by" in run.stdout
    assert "stores no alternatives" not in run.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "autopar.tools.cli",
            "show",
            "--explain",
            "layers.0.attention.wq.wieght",
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(
        "autopar: error: no parameter or module"
    )
    assert (
        "did you mean layers.0.attention.wq.weight" in bad.stderr and "p_layers" not in bad.stderr
    )


def test_the_program_flushes_everything_before_its_fast_exit(quick_start, tmp_path) -> None:
    """``python -m autopar plan`` ends with os._exit (autopar.tools.cli.run): the summary, the
    progress lines and the plan file are all complete, and the exit status is main's. A
    caller's ``main(...)`` (the fixture, in this process) freezes nothing in its collector."""
    import gc

    from autopar.plan.document import Plan

    assert gc.get_freeze_count() == 0
    out = tmp_path / "mlp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    run = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "mlp", "--mesh", "2", "--no-cache", "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip().endswith(f"plan written to {out}") and "Step " in run.stdout
    assert run.stderr.startswith("capture:") and "solve auto:" in run.stderr
    assert Plan.load(out).data["model"]["name"] == "mlp"
    bad = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "mlp", "--mesh", "2", "--budget", "1B"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.rstrip().splitlines()[-1].startswith(
        "autopar: error:"
    )

"""Optional dependencies are checked before any work: matplotlib (``autopar[plot]``) for PNGs.

Each case runs the CLI in a subprocess whose ``sys.modules["matplotlib"]`` is None (``import
matplotlib`` then fails as on a plain install). Asking for plots explicitly without matplotlib is
a one-line error before capture, planning or measuring; the default plots are skipped with a note
instead (tests/distributed/test_collective_order.py runs a whole bench-cost that way).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BLOCKED_CLI = (
    "import sys; sys.modules['matplotlib'] = None; from autopar.tools.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def run_cli_without_matplotlib(
    *argv: str, cwd: str = ROOT, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess:
    """``autopar ARGV`` in a subprocess that cannot import matplotlib (``env`` added)."""
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_CLI, *argv],
        capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )  # fmt: skip


def test_plotting_unavailable_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from autopar.tools.report import plotting_unavailable; print(plotting_unavailable())"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == (
        "matplotlib is not installed (optional, for PNG plots); "
        "install it with pip install 'autopar[plot]'"
    ), out.stderr


def test_plotting_available_here() -> None:
    from autopar.tools.report import plotting_unavailable

    assert plotting_unavailable() is None


BENCH_ARGV = ("bench-cost", "mlp", "--mesh", "2", "--recipes", "fsdp", "--no-ops", "--steps", "1")
SWEEP_ARGV = ("plan", "mlp", "--mesh", "2", "--sweep-budget", "3")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ((*BENCH_ARGV, "--plots", "out/bench"), "--plots out/bench"),
        ((*SWEEP_ARGV, "--sweep-plot", "sweep.png"), "--sweep-plot sweep.png"),
    ],
    ids=["bench-cost", "plan-sweep"],
)
def test_requested_plots_without_matplotlib_fail_before_any_work(
    argv: tuple[str, ...], flag: str
) -> None:
    start = time.monotonic()
    out = run_cli_without_matplotlib(*argv)
    seconds = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == (
        f"autopar: error: {flag}: matplotlib is not installed (optional, for PNG plots); install "
        f"it with pip install 'autopar[plot]' (or leave out {flag.split()[0]} to skip the plots)"
    ), out.stderr[-2000:]
    assert out.stdout == ""  # nothing captured, planned or measured
    assert seconds < 60, seconds  # python and torch start-up only, no capture or ranks

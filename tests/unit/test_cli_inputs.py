"""Inputs that never surprise: every bad CLI or model-name input is one line naming the fix."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.presets import build_preset
from autopar.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one line on stderr, no traceback."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors exit
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _parsers(parser: argparse.ArgumentParser, prog: str = "autopar"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = [
        f"{prog} {'/'.join(action.option_strings) or action.dest}"
        for prog, parser in _parsers(build_parser())
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []
    subcommands = {prog for prog, _ in _parsers(build_parser())}
    assert {"autopar plan", "autopar show", "autopar compare", "autopar bench-cost"} <= subcommands


def test_optimizer_help_lists_the_choices() -> None:
    plan = dict(_parsers(build_parser()))["autopar plan"]
    (optimizer,) = [a for a in plan._actions if "--optimizer" in a.option_strings]
    assert "adamw" in optimizer.help and "sgd" in optimizer.help and "lamb" in optimizer.help


def test_version_prints_autopar_version(capsys) -> None:
    import autopar

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"autopar {autopar.__version__}"


def test_compare_and_bench_cost_take_only_flags_they_use() -> None:
    parsers = dict(_parsers(build_parser()))
    for prog in ("autopar compare", "autopar bench-cost"):
        flags = {f for a in parsers[prog]._actions for f in a.option_strings}
        assert not flags & {"--recipe", "--zero", "--checkpoint", "--no-cache"}, prog
    bench = {f for a in parsers["autopar bench-cost"]._actions for f in a.option_strings}
    assert "--recipes" in bench and "--mixed-precision" not in bench


def test_compare_rejects_recipe_in_one_line(capsys) -> None:
    err = _one_line_error(capsys, ["compare", "mlp", "--mesh", "2", "--recipe", "ddp"])
    assert "--recipe" in err


@pytest.mark.parametrize("argv", [["--budget", "-5GiB"], ["--budget=-5GiB"], ["--budget", "0GiB"]])
def test_non_positive_budget_is_a_one_line_budget_error(capsys, argv) -> None:
    err = _one_line_error(capsys, ["plan", "mlp", "--mesh", "2", *argv])
    assert "--budget" in err and "positive" in err
    assert "expected one argument" not in err


def test_unreadable_budget_names_the_format(capsys) -> None:
    err = _one_line_error(capsys, ["plan", "mlp", "--mesh", "2", "--budget", "5Gx"])
    assert "40GiB" in err


def test_show_of_a_directory_is_one_line(capsys, tmp_path) -> None:
    err = _one_line_error(capsys, ["show", str(tmp_path)])
    assert "is a directory" in err and "plan JSON" in err


def test_show_of_a_missing_file_is_one_line(capsys, tmp_path) -> None:
    _one_line_error(capsys, ["show", str(tmp_path / "nope.json")])


# --------------------------------------------------------------------------------------------
# hf: models


def test_hf_unknown_key_names_close_matches(capsys) -> None:
    with pytest.raises(ValueError, match=r"no key 'n_layers'; did you mean n_layer") as error:
        build_preset("hf:gpt2?n_layers=2", batch=1, seq=8)
    assert "\n" not in str(error.value)
    err = _one_line_error(capsys, ["plan", "hf:gpt2?n_layers=2", "--mesh", "2"])
    assert "n_layer" in err


def test_hf_attribute_map_keys_are_known() -> None:
    model, _, _ = build_preset(
        "hf:gpt2?num_hidden_layers=1&n_embd=32&n_head=2", batch=1, seq=8, device="meta"
    )
    assert len(model.transformer.h) == 1


def test_hf_bad_value_is_one_line(capsys) -> None:
    err = _one_line_error(capsys, ["plan", "hf:gpt2?n_layer=abc", "--mesh", "2"])
    assert "n_layer" in err and "abc" in err and "int" in err


def test_hf_unknown_model_type_is_short_with_close_matches(capsys) -> None:
    err = _one_line_error(capsys, ["plan", "hf:gtp2", "--mesh", "2"])
    assert "gpt2" in err and "types are known" in err and len(err) < 300
    err = _one_line_error(capsys, ["plan", "hf:foo", "--mesh", "2"])
    assert "unknown model type 'foo'" in err and len(err) < 300


def test_hf_build_and_forward_print_no_transformers_warning(capfd) -> None:
    import torch

    model, args, kwargs = build_preset(
        "hf:bert?num_hidden_layers=1&hidden_size=32&num_attention_heads=2&intermediate_size=64&vocab_size=128",
        batch=2,
        seq=8,
        device="cpu",
    )
    loss = model(*args, **kwargs).loss
    assert torch.isfinite(loss)
    captured = capfd.readouterr()
    assert "transformers" not in captured.err + captured.out, captured.err


# --------------------------------------------------------------------------------------------
# Factories from the working directory


def test_factory_next_to_the_user_imports_without_pythonpath(tmp_path) -> None:
    (tmp_path / "mymodels_h.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build(batch, seq):
                return torch.nn.Linear(8, 8), (torch.randn(batch, 8),)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # -P: Python itself adds no working directory to sys.path (as the installed script).
    run = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "autopar",
            "plan",
            "mymodels_h:build",
            "--mesh",
            "2",
            "--batch",
            "4",
            "--device",
            "cpu",
            "--no-cache",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "mymodels_h:build" in run.stdout


def test_missing_factory_is_one_line(capsys) -> None:
    err = _one_line_error(capsys, ["plan", "no_such_module_h:build", "--mesh", "2"])
    assert "working directory" in err


# --------------------------------------------------------------------------------------------
# bench-cost without op timings


def test_bench_cost_without_ops_prints_no_nan_and_names_only_written_plots(
    monkeypatch, tmp_path, capsys
) -> None:
    from autopar.tools import bench_cost, report

    def fake_run(spec, plans, config, nproc):
        return {
            "ops": [],
            "plans": {
                name: {
                    "mesh": "2",
                    "predicted_step_s": 1e-3,
                    "step_s": 2e-3,
                    "predicted_peak_memory_bytes": 1e6,
                    "peak_memory_bytes": 1e6,
                }
                for name in plans
            },
        }

    written = []
    monkeypatch.setattr(bench_cost, "run_bench", fake_run)
    monkeypatch.setattr(report, "plot_step_bars", lambda rows, path, title: written.append(path))
    monkeypatch.setattr(report, "plot_op_scatter", lambda ops, path, title: written.append(path))
    prefix = str(tmp_path / "b")
    assert (
        main(
            [
                "bench-cost",
                "mlp",
                "--mesh",
                "2",
                "--no-ops",
                "--recipes",
                "auto,ddp",
                "--plots",
                prefix,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "nan" not in out and "ops not timed" in out
    assert written == [f"{prefix}_steps.png"]
    assert f"plots written to {prefix}_steps.png\n" in out and "_ops.png" not in out

"""``python -m autopar ...`` (e.g. under ``torchrun -m autopar calibrate``): the CLI."""

from autopar.tools.cli import run

run()

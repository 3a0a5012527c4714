"""GPUMix as one command, `gpumix` (gpumix/cli.py), installed by `pip install .` (pyproject.toml)."""

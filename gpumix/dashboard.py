"""`gpumix dashboard`: the Streamlit dashboard (app.py), as scripts/dashboard.sh starts it.

Streamlit reads a config.toml only from the working directory and the script's folder, so the
dashboard's settings (the checkout's .streamlit/config.toml: this machine only, headless, no
usage statistics; installed as gpumix/streamlit_config, see pyproject.toml) are passed as flags
and hold wherever `gpumix dashboard` is started. Flags after `dashboard` go to `streamlit run`
and win over them (`gpumix dashboard --server.port 8502`). app.py lies beside the packages, in a
checkout as in site-packages (contracts.paths.PROJECT_ROOT).
"""
from __future__ import annotations

import argparse
import os
import sys
import tomllib

from contracts.paths import PROJECT_ROOT, SOURCE_CHECKOUT

HELP = "start the dashboard (Streamlit, http://localhost:8501); further flags go to `streamlit run`"
APP = os.path.join(PROJECT_ROOT, "app.py")
CONFIG = (os.path.join(PROJECT_ROOT, ".streamlit", "config.toml") if SOURCE_CHECKOUT
          else os.path.join(os.path.dirname(os.path.abspath(__file__)), "streamlit_config", "config.toml"))


def config_flags(path: str = CONFIG) -> list[str]:
    """The settings of a Streamlit config.toml as `streamlit run` flags (--section.option=value)."""
    with open(path, "rb") as f:
        config = tomllib.load(f)

    def text(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return [f"--{section}.{option}={text(value)}" for section, options in config.items() for option, value in options.items()]


def command(streamlit_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", APP, *config_flags(), *streamlit_args]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("streamlit_args", nargs="*", metavar="STREAMLIT_FLAG",
                        help="passed to `streamlit run` (e.g. --server.port 8502)")


def run(args: argparse.Namespace) -> int:
    cmd = command(args.streamlit_args)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # the dashboard takes this process: Ctrl-C and signals reach Streamlit itself
    return 0  # not reached

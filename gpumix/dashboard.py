"""`gpumix dashboard`: the Streamlit dashboard (app.py), as scripts/dashboard.sh starts it.

Streamlit reads a config.toml only from the working directory and the script's folder, so the
dashboard's settings (the checkout's .streamlit/config.toml: this machine only, headless, no
usage statistics; installed as gpumix/streamlit_config, see pyproject.toml) are passed as flags
and hold wherever `gpumix dashboard` is started. Flags after `dashboard` go to `streamlit run`
and win over them (`gpumix dashboard --server.port 8502`). app.py lies beside the packages, in a
checkout as in site-packages (contracts.paths.PROJECT_ROOT). It prints the URL with the access
token (GPUMIX_DASHBOARD_TOKEN, else a new one), which reaches the server in its environment.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tomllib

from contracts.paths import PROJECT_ROOT, SOURCE_CHECKOUT
from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM, new_token

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


DEFAULT_PORT = 8501
PORT_SEARCH = 100  # ports tried from DEFAULT_PORT up when none is given


def given_port(streamlit_args: list[str]) -> int | None:
    """The port of `--server.port N` or `--server.port=N` among the flags, if any."""
    for i, arg in enumerate(streamlit_args):
        if arg == "--server.port":
            value = streamlit_args[i + 1] if i + 1 < len(streamlit_args) else ""
        elif arg.startswith("--server.port="):
            value = arg.partition("=")[2]
        else:
            continue
        if not value.isdigit():
            raise ValueError(f"--server.port needs a port number, got {value!r}")
        return int(value)
    return None


def first_free_port(start: int = DEFAULT_PORT) -> int:
    """The first port from `start` that nothing listens on here. Chosen here and passed to
    Streamlit, which otherwise moves past a busy port on its own and the printed URL is wrong."""
    for port in range(start, start + PORT_SEARCH):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ValueError(f"no free port in {start}-{start + PORT_SEARCH - 1}: give one with --server.port")


def command(streamlit_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", APP, *config_flags(), *streamlit_args]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("streamlit_args", nargs="*", metavar="STREAMLIT_FLAG",
                        help="passed to `streamlit run` (e.g. --server.port 8502)")


def run(args: argparse.Namespace) -> int:
    streamlit_args = list(args.streamlit_args)
    port = given_port(streamlit_args)
    if port is None:
        port = first_free_port()
        streamlit_args = ["--server.port", str(port), *streamlit_args]
    # the environment, not argv: `ps` shows a process's arguments to every user of the machine
    token = os.environ.get(ENV_DASHBOARD_TOKEN) or new_token()
    os.environ[ENV_DASHBOARD_TOKEN] = token
    cmd = command(streamlit_args)
    print(f"GPUMix dashboard (this machine only): http://localhost:{port}/?{TOKEN_PARAM}={token}")
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # the dashboard takes this process: Ctrl-C and signals reach Streamlit itself
    return 0  # not reached

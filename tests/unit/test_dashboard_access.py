"""Safe on a shared machine, the dashboard's side: app.py lets in only a session with the access
token, typed paths are confined to the allowed roots (contracts/paths.py), passwords in URLs are
masked (contracts/secrets.py), and `gpumix dashboard` prints the URL with its token."""
from __future__ import annotations

import argparse
import os

import pytest
from streamlit.testing.v1 import AppTest

from contracts import paths
from contracts.secrets import ENV_DASHBOARD_TOKEN, TOKEN_PARAM, mask_secrets, mask_url, new_token, token_matches
from gpumix import dashboard
from testkit import ROOT
from ui.common import error_message

APP = os.path.join(ROOT, "app.py")
MEMORY_PAGE = os.path.join(ROOT, "ui", "memory.py")
TIMEOUT_S = 60
REFUSAL = "needs its access token"


def _app(token: str | None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.query_params.pop(TOKEN_PARAM, None)  # tests/conftest.py gives every session the right one
    if token is not None:
        at.query_params[TOKEN_PARAM] = token
    at.run()
    assert not at.exception
    return at


def _refused(at: AppTest) -> bool:
    """Only the one refusal line: no title, no page list, no widget."""
    return ([e.value for e in at.error] and all(REFUSAL in e.value for e in at.error) and not at.title
            and not at.get("page_link") and not at.selectbox and not at.button)


@pytest.mark.parametrize("token", [None, "", "wrong", "test-dashboard-token-but-longer"])
def test_a_session_without_the_right_token_sees_no_page(token):
    at = _app(token)
    assert _refused(at), [e.value for e in at.error]
    assert "cluster" not in at.session_state  # no page ran


def test_the_token_opens_every_page_of_the_session(dashboard_token):
    at = _app(dashboard_token)
    assert any("Inventory" in t.value for t in at.title)
    # the next page's URL has no query any more: the session itself is let in, and the token is
    # put back into the URL so that a reload works too
    at.query_params.clear()
    at.switch_page("ui/plan.py").run()
    assert not at.exception and any("Plan" in t.value for t in at.title)
    assert at.query_params.get(TOKEN_PARAM) == dashboard_token


def test_a_server_without_a_token_lets_no_one_in(monkeypatch):
    monkeypatch.delenv(ENV_DASHBOARD_TOKEN)
    at = _app("")
    assert not at.title and [e.value for e in at.error] and "no access token" in at.error[0].value


def test_token_comparison():
    assert token_matches("abc", "abc")
    assert not token_matches("abd", "abc") and not token_matches("", "") and not token_matches(None, "abc")
    assert not token_matches("abc", "")
    assert len(new_token()) >= 32 and new_token() != new_token()


# ---- typed paths ----------------------------------------------------------------------


def test_paths_under_the_data_folder_and_the_examples_are_allowed(data_dir, monkeypatch):
    monkeypatch.delenv(paths.ENV_ALLOWED_ROOTS, raising=False)
    inside = os.path.join(data_dir, "corpus-src", "a.txt")
    assert paths.confined_path(inside) == os.path.realpath(inside)
    example = os.path.join(paths.EXAMPLES_DIR, "clusters", "lab.json")
    assert paths.confined_path(example) == os.path.realpath(example)


@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/hostname", "/", "~/.ssh/id_rsa"])
def test_paths_elsewhere_are_refused_in_one_line(path, monkeypatch):
    monkeypatch.delenv(paths.ENV_ALLOWED_ROOTS, raising=False)
    with pytest.raises(ValueError, match=f"Dataset '{path}' is outside the folders the dashboard may read") as e:
        paths.confined_path(path, "Dataset")
    assert "\n" not in str(e.value) and paths.ENV_ALLOWED_ROOTS in str(e.value)


def test_a_symlink_or_dotdot_out_of_the_data_folder_is_refused(data_dir, monkeypatch):
    monkeypatch.delenv(paths.ENV_ALLOWED_ROOTS, raising=False)
    os.symlink("/etc", os.path.join(data_dir, "etc"))
    for escape in (os.path.join(data_dir, "etc", "hostname"), os.path.join(data_dir, "..", "..", "x"),
                   data_dir.rstrip("/") + "-next-door/x"):  # a sibling whose name starts with the root's
        with pytest.raises(ValueError, match="outside"):
            paths.confined_path(escape)


def test_allowed_roots_come_from_the_environment(tmp_path, monkeypatch):
    mine, other = tmp_path / "datasets", tmp_path / "models"
    monkeypatch.setenv(paths.ENV_ALLOWED_ROOTS, f"{mine}::relative/dir:{other}")
    roots = paths.allowed_roots()
    assert str(mine) in roots and str(other) in roots
    assert not any(r.endswith("relative/dir") for r in roots)  # would depend on the server's cwd
    assert paths.confined_path(str(other / "llama" / "config.json")) == str(other / "llama" / "config.json")
    with pytest.raises(ValueError):
        paths.confined_path(str(tmp_path / "elsewhere"))


def _memory_page() -> AppTest:
    at = AppTest.from_file(MEMORY_PAGE, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    return at


def test_model_and_memory_refuses_a_dataset_or_tokenizer_outside_the_roots(data_dir, monkeypatch):
    monkeypatch.delenv(paths.ENV_ALLOWED_ROOTS, raising=False)
    at = _memory_page()
    at.text_input(key="mem_data").set_value("/etc/hostname").run()
    assert not at.exception
    assert any("Dataset '/etc/hostname' is outside" in e.value for e in at.error), [e.value for e in at.error]
    assert at.session_state["training_inputs"]["corpus_dir"] is None  # Launch never gets it
    assert not [b for b in at.button if b.key == "mem_count_tokens"]  # nothing to count: nothing read
    assert not os.path.exists(os.path.join(data_dir, "corpus"))
    at.text_input(key="mem_data").set_value("")
    at.text_input(key="mem_tokenizer").set_value("/etc/passwd").run()
    assert any("Tokenizer '/etc/passwd' is outside" in e.value for e in at.error)
    # a path under the data folder is taken, resolved
    at.text_input(key="mem_tokenizer").set_value("")
    at.text_input(key="mem_data").set_value(os.path.join(data_dir, "mine.jsonl")).run()
    assert not at.error and at.session_state["training_inputs"]["corpus_dir"] == os.path.realpath(
        os.path.join(data_dir, "mine.jsonl"))


def test_model_and_memory_refuses_a_model_folder_outside_the_roots(monkeypatch):
    monkeypatch.delenv(paths.ENV_ALLOWED_ROOTS, raising=False)
    at = _memory_page()
    at.selectbox(key="mem_model").set_value("A Hugging Face model folder…").run()
    at.text_input(key="mem_folder").set_value("/etc").run()
    assert not at.exception
    assert any("Model folder '/etc' is outside" in e.value for e in at.error)
    assert at.session_state["model"] != "/etc/config.json"


# ---- passwords -----------------------------------------------------------------------------


@pytest.mark.parametrize("url, shown", [
    ("postgresql://bob:s3cret@db:5432/gpumix", "postgresql://bob:***@db:5432/gpumix"),
    ("postgresql://bob@db/gpumix?sslmode=require&password=s3cret", "postgresql://bob@db/gpumix?sslmode=require&password=***"),
    ("postgres://bob:p%40ss@db/x?PASSWORD=s3cret", "postgres://bob:***@db/x?PASSWORD=***"),
    ("sqlite:///data/runs/r1/metrics.sqlite", "sqlite:///data/runs/r1/metrics.sqlite"),
    ("postgresql://db/gpumix", "postgresql://db/gpumix"),
])
def test_mask_url(url, shown):
    assert mask_url(url) == shown


def test_an_error_on_a_page_never_shows_a_password():
    e = ValueError("store postgresql://bob:s3cret@db/x?password=s3cret: connection refused (host=db password=s3cret)")
    shown = error_message(e)
    assert "s3cret" not in shown and "bob:***@db" in shown and mask_secrets(str(e)) == shown


# ---- gpumix dashboard ------------------------------------------------------------------------


def test_gpumix_dashboard_prints_the_url_with_a_token_it_hands_over_in_the_environment(monkeypatch, capsys):
    monkeypatch.delenv(ENV_DASHBOARD_TOKEN)
    ran = []
    monkeypatch.setattr(dashboard.os, "execv", lambda exe, argv: ran.append(argv))
    dashboard.run(argparse.Namespace(streamlit_args=["--server.port=8765"]))
    token = os.environ[ENV_DASHBOARD_TOKEN]
    assert capsys.readouterr().out.strip().endswith(f"http://localhost:8765/?{TOKEN_PARAM}={token}")
    (argv,) = ran
    assert not any(token in a for a in argv)  # `ps` shows argv to everyone
    assert "--server.address=127.0.0.1" in argv and "--server.enableXsrfProtection=true" in argv


def test_gpumix_dashboard_chooses_a_free_port_itself_and_keeps_a_given_token(monkeypatch, capsys):
    monkeypatch.setenv(ENV_DASHBOARD_TOKEN, "my-token")
    ran = []
    monkeypatch.setattr(dashboard.os, "execv", lambda exe, argv: ran.append(argv))
    dashboard.run(argparse.Namespace(streamlit_args=[]))
    (argv,) = ran
    port = int(argv[argv.index("--server.port") + 1])  # explicit: Streamlit would move past a busy one silently
    assert capsys.readouterr().out.strip().endswith(f"http://localhost:{port}/?{TOKEN_PARAM}=my-token")
    assert dashboard.given_port(["--server.port", "8502"]) == 8502 and dashboard.given_port(["-x"]) is None
    with pytest.raises(ValueError, match="port number"):
        dashboard.given_port(["--server.port", "--server.headless"])

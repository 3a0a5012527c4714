"""mask_secrets masks the secret alone: the punctuation that closes it in the text stays."""
import pytest

from contracts.secrets import mask_secrets


@pytest.mark.parametrize("text, masked", [
    ("(password=x)", "(password=***)"),
    ("connect failed (host=db password=s3cret)", "connect failed (host=db password=***)"),
    ("[pwd=abc], next", "[pwd=***], next"),
    ("password=x; port=5", "password=***; port=5"),
    ("f(g(password=pa)ss))", "f(g(password=***))"),  # an inner ')' with no opener is the secret's
    ("password=a)b", "password=***"),
    ("password='a b c')", "password=***)"),
    ("(see postgresql://u:p@h/db?password=z), x", "(see postgresql://u:***@h/db?password=***), x"),
])
def test_only_the_secret_is_masked(text, masked):
    assert mask_secrets(text) == masked


def test_no_secret_left_in_any_case():
    for text in ("(password=hunter2)", "{passwd=hunter2}", "<pwd=hunter2>", "password=hunter2,"):
        assert "hunter2" not in mask_secrets(text)

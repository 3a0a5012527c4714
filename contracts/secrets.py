"""Secrets GPUMix holds and must never show: the dashboard's access token, database passwords.

- The dashboard is opened with `?token=…`; the token reaches the server process through
  `GPUMIX_DASHBOARD_TOKEN` (the environment, never argv: `ps` shows argv to every user).
  `new_token` makes one, `token_matches` compares in constant time.
- `mask_url` hides the password of one URL (`user:pass@` and `?password=`); `mask_secrets` does
  it to every URL in a text (an error message that quotes a store URL) and to libpq's
  `password=…`. See docs/DESIGN.md
  ("Safe on shared machines").
"""
from __future__ import annotations

import hmac
import re
import secrets
import urllib.parse

ENV_DASHBOARD_TOKEN = "GPUMIX_DASHBOARD_TOKEN"
TOKEN_PARAM = "token"  # the dashboard URL's query parameter
TOKEN_BYTES = 24  # 192 random bits, 32 URL-safe characters
MASK = "***"
# query keys libpq and SQLAlchemy read a password or a secret from
SECRET_KEYS = frozenset({"password", "passwd", "pwd", "sslpassword", "token", "secret"})
# a URL inside free text: a scheme, "://", then anything up to whitespace or a quote
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# a libpq key=value connection string's password ("host=db password=s3cret")
_KEYWORD_RE = re.compile(r"\b(password|passwd|pwd)(\s*=\s*)('[^']*'|[^\s'\"]+)", re.IGNORECASE)


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_matches(given: str | None, expected: str | None) -> bool:
    """True when both are non-empty and equal; the comparison takes the same time wherever they differ."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def mask_url(url: str) -> str:
    """`url` with the password of its `user:password@` and the values of its password-like query
    keys replaced by ***; a text that is not such a URL comes back unchanged."""
    try:
        u = urllib.parse.urlsplit(url)
        password = u.password
    except ValueError:  # a malformed netloc (a bad port): mask what looks like user:pass@
        return re.sub(r"(//[^/:@]*:)[^/@]*@", rf"\g<1>{MASK}@", url)
    netloc = u.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{MASK}@{host}"
    query = u.query
    if query:
        # key by key, so that the rest of the query keeps its exact spelling
        query = "&".join(_mask_pair(pair) for pair in query.split("&"))
    if (netloc, query) == (u.netloc, u.query):
        return url
    # by hand: urlunsplit drops the empty authority of sqlite:///path
    return (f"{u.scheme}://{netloc}{u.path}" + (f"?{query}" if query else "")
            + (f"#{u.fragment}" if u.fragment else ""))


def _mask_pair(pair: str) -> str:
    key, eq, _ = pair.partition("=")
    return f"{key}={MASK}" if eq and urllib.parse.unquote_plus(key).lower() in SECRET_KEYS else pair


def mask_secrets(text: str) -> str:
    """Every URL in `text` passed through `mask_url`, and every `password=…` of a libpq
    key=value string masked too."""
    text = _URL_RE.sub(lambda m: _mask_in_text(text[:m.start()], m.group(0)), text)
    return _KEYWORD_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}{_trailing(text[:m.start()], m.group(3))}", text)


def _mask_in_text(before: str, url: str) -> str:
    end = _trailing(before, url)
    return mask_url(url[:len(url) - len(end)]) + end


_CLOSERS = {")": "(", "]": "[", "}": "{", ">": "<"}


def _trailing(before: str, value: str) -> str:
    """The punctuation that ends `value` in its text rather than belonging to it: a closing
    bracket whose opener stands before the keyword ("(password=x)"), or a comma or semicolon
    after it ("password=x, user=y"). Only these stay visible."""
    if value.startswith("'"):
        return ""
    opened = {o: before.count(o) - before.count(c) for c, o in _CLOSERS.items()}
    kept = ""
    while len(value) - len(kept) > 1:
        ch = value[len(value) - len(kept) - 1]
        if ch in ",;":
            kept = ch + kept
        elif ch in _CLOSERS and opened[_CLOSERS[ch]] > 0:
            opened[_CLOSERS[ch]] -= 1
            kept = ch + kept
        else:
            break
    return kept

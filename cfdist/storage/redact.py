"""Secrets never leave the process: one place that knows what a credential looks like.

Credentials reach cfdist two ways: in a URL (``s3://KEY:SECRET@bucket/run``) or in
``storage_options`` (``key``, ``secret``, ``token``, ``password``, ``client_kwargs={
"aws_secret_access_key": ...}``, ...). :func:`~cfdist.storage.url.open_storage` moves URL
credentials into the options and registers every secret value here; from then on

* :func:`redact_url` gives the URL to show (userinfo and secret query parameters masked);
* :func:`redact` scrubs any text (an exception message, a log line, a repr) of every registered
  secret and of URL userinfo;
* :func:`redact_options` gives the options to show (secret values masked).

``Storage.url`` is already clean; storage errors are scrubbed where they are made
(``Storage._error``); config reprs and driver logs that hold raw URLs go through these functions.
The registry lives in this process (a writer process or Ray actor registers its own when it opens
its storage). Thread-safe.
"""

from __future__ import annotations

import re
import threading
from typing import Any

MASK = "***"

_SECRET_KEY = re.compile(
    r"(secret|token|password|passwd|credential|signature|private|sas|session|apikey|api_key|"
    r"access_key|account_key|^key$|_key$|key_id$|^auth|connection_string)", re.I)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<info>[^/@\s'\"]+)@")
_QUERY = re.compile(r"(?P<k>[?&][^=&\s'\"]*(?:secret|token|password|signature|sig|key|credential)[^=&\s'\"]*=)"
                    r"(?P<v>[^&\s'\"]+)", re.I)

_SECRETS: set[str] = set()
_LOCK = threading.Lock()


def is_secret_key(key: object) -> bool:
    """Whether an option name holds a credential (``key``, ``secret``, ``token``, ``*_key``, ...)."""
    return isinstance(key, str) and bool(_SECRET_KEY.search(key))


def secrets_in(options: Any) -> set[str]:
    """Every string value under a secret-looking key, at any depth of ``options``."""
    out: set[str] = set()

    def walk(o: Any, secret: bool) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                walk(v, secret or is_secret_key(k))
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, secret)
        elif secret and isinstance(o, (str, bytes)) and len(o) >= 3:
            out.add(o.decode(errors="replace") if isinstance(o, bytes) else o)

    walk(options, False)
    return out


def register(secrets: set[str] | list[str]) -> None:
    """Remember ``secrets`` so that :func:`redact` scrubs them from any text of this process."""
    with _LOCK:
        _SECRETS.update(s for s in secrets if isinstance(s, str) and len(s) >= 3)


def redact_url(url: str) -> str:
    """``url`` with its userinfo (``user:password@``) and secret query parameters masked."""
    if not isinstance(url, str):
        return url
    url = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", url)
    return _QUERY.sub(lambda m: f"{m['k']}{MASK}", url)


def redact(text: object, extra: set[str] | frozenset[str] = frozenset()) -> str:
    """``str(text)`` without any registered (or ``extra``) secret, URL userinfo or secret query
    parameter."""
    s = str(text)
    with _LOCK:
        secrets = sorted(_SECRETS | set(extra), key=len, reverse=True)
    for sec in secrets:
        if sec in s:
            s = s.replace(sec, MASK)
    return redact_url(s)


def redact_options(options: Any) -> Any:
    """A copy of ``options`` with every value under a secret-looking key masked."""
    if isinstance(options, dict):
        return {k: (MASK if is_secret_key(k) and v is not None and not isinstance(v, (dict, list, tuple))
                    else redact_options(v)) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(redact_options(v) for v in options)
    return options


def split_credentials(scheme: str, url: str) -> tuple[str, dict]:
    """``(url without user:password@, options they stand for)`` for schemes whose fsspec
    implementation does not read credentials from the URL itself (s3: ``key``/``secret``).

    Other schemes keep their URL (their filesystem parses it); only its display is redacted.
    """
    if scheme not in ("s3", "s3a"):
        return url, {}
    m = _USERINFO.match(url)
    if not m or ":" not in m["info"]:
        return url, {}
    from urllib.parse import unquote

    key, _, secret = m["info"].partition(":")
    return m["scheme"] + url[m.end():], {"key": unquote(key), "secret": unquote(secret)}

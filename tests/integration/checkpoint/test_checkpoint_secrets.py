"""Secrets: credentials in a URL or in ``storage_options`` never appear in logs, manifests,
exceptions, reprs or the event log.

Each test runs save, restore and failure paths with distinctive fake credentials, captures
every output (log records at DEBUG, warnings, exception messages with their whole cause chain,
reprs, every file written to the storage, the event log file) and greps it for the secrets.
"""

from __future__ import annotations

import errno
import json
import logging
import traceback
import warnings

import pytest

import cfdist
from cfdist.checkpoint.retry import RetryPolicy, StorageUnavailable
from cfdist.cluster.config import FitConfig
from cfdist.cluster.events import EventLog
from cfdist.storage import open_storage, open_storages
from cfdist.testing import faulty, flaky
from cfdist.storage.redact import MASK

KEY = "AKIAFAKEKEYID7777"
SECRET = "wJalrFAKEsecretVALUE-9b8c"
TOKEN = "tokFAKEsessionTOKEN-4411"
SECRETS = (KEY, SECRET, TOKEN)


def _chain(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)) + repr(e)


def _grep(texts: list[str]) -> list[str]:
    return [f"{s!r} in {t[:200]!r}..." for t in texts for s in SECRETS if s in t]


@pytest.fixture
def cases(request, tmp_path, mlp_state):
    """``(url, storage_options, read_back)`` for the backend under test, credentials included;
    ``read_back()`` returns every file's bytes written under the root, decoded."""
    if request.param == "file":
        root = tmp_path / "ckpt"
        opts = {"key": KEY, "secret": SECRET, "token": TOKEN}   # accepted and ignored by file://
        return (f"file://{root}", opts,
                lambda: [p.read_bytes().decode(errors="replace") for p in root.rglob("*") if p.is_file()])
    s3_url = request.getfixturevalue("s3_url")
    base = request.getfixturevalue("s3_storage_options")
    bucket_path = s3_url[len("s3://"):]
    if request.param == "s3-url":
        url, opts = f"s3://{KEY}:{SECRET}@{bucket_path}", {"client_kwargs": dict(base["client_kwargs"])}
    else:
        url = s3_url
        opts = {"key": KEY, "secret": SECRET, "client_kwargs": {**base["client_kwargs"], "aws_session_token": TOKEN}}

    def read_back():
        import s3fs

        fs = s3fs.S3FileSystem(**base)
        return [fs.cat_file(p).decode(errors="replace") for p in fs.find(bucket_path)]

    return url, opts, read_back


@pytest.mark.parametrize("cases", ["file", "s3-url", "s3-options"], indirect=True)
def test_secrets_appear_in_no_output(cases, mlp_state, train, caplog, tmp_path):
    """Real: the Checkpointer on file:// and on the moto S3 server (credentials in the URL or in
    storage_options), its logs, retention, restore, ``cfdist.load``/``list_checkpoints``, an
    EventLog file. Faked: the failures (a write fault, reads that keep failing, a bucket that
    does not exist).
    The point: none of the outputs contains the key, the secret or the token; where a URL with
    credentials is shown, its userinfo reads ``***``.
    """
    url, opts, read_back = cases
    caplog.set_level(logging.DEBUG, logger="cfdist")   # botocore's own DEBUG log prints the key id: not ours
    texts: list[str] = []
    model, opt, sched = mlp_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, url, cfdist.Every(2), keep=1,
                                   storage_options=opts)
        texts += [repr(ckpt.storages), repr(ckpt.config), ckpt.storages[0].url]
        train(model, opt, ckpt, 4, sched)
        ckpt.close()
        texts.append(json.dumps(ckpt.stats))
        texts.append(json.dumps(cfdist.list_checkpoints(url, include_rejected=True, **opts)))
        assert cfdist.load(url, **opts)["step"] == 4

        # a persist that fails: the error reaches stats, the log and wait()
        st = faulty(open_storage(url, **opts), fail_every_n_writes=1, errno=errno.EIO)
        model, opt, sched = mlp_state()
        bad = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, st, cfdist.Every(2))
        train(model, opt, bad, 2, sched)
        with pytest.raises(OSError) as ei:
            bad.wait()
        texts += [_chain(ei.value), json.dumps(bad.stats)]
        bad.close()

        # a restore whose reads keep failing
        down = flaky(open_storage(url, **opts), match="step-*/*", failures=None)
        model, opt, sched = mlp_state()
        r = cfdist.Checkpointer({"model": model, "optim": opt, "sched": sched}, down, cfdist.Every(2),
                                load=cfdist.LoadOptions(read_retry=RetryPolicy(tries=2, first_delay_s=0.01)))
        with pytest.raises(StorageUnavailable) as ei:
            r.restore()
        texts.append(_chain(ei.value))
        r.close()

        # a missing bucket / an unusable root, and an option the filesystem refuses
        missing = url.replace("cfdist-", "no-such-bucket-") if url.startswith("s3") else url + "/\0bad"
        with pytest.raises((OSError, ValueError)) as ei:
            open_storages(missing, **opts)[0].listdir("")
        texts.append(_chain(ei.value))

    # the driver side: config repr, log lines and the event log file
    cfg = FitConfig(storage=str(tmp_path / "local"), shared_storage=url, storage_options=opts)
    texts += [repr(cfg), str(cfg)]
    logging.getLogger("cfdist.test").warning("config %s", cfg)
    ev = EventLog(str(tmp_path / "events.jsonl"))
    ev.emit("end", error=f"copying to {url} failed with {opts}", checkpoint=cfg.shared_url())
    ev.close()
    texts.append((tmp_path / "events.jsonl").read_text())
    assert f"{MASK}" in texts[-1] or "s3://" not in url

    texts += [str(w.message) for w in caught]
    texts.append(caplog.text)
    texts += read_back()
    leaks = _grep(texts)
    assert not leaks, leaks
    if url.startswith("s3://AKIA"):
        assert f"s3://{MASK}@" in repr(cfg)

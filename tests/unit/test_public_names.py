"""What users may import from the top level (``cfdist.__all__``) is what the code really uses.

``RetryPolicy`` (how patiently a storage read is retried) and ``StorageUnavailable`` (raised when
it still fails) are needed by anyone restoring from flaky storage, so they are public names: these
tests check they are importable from ``cfdist`` and are the very classes ``cfdist.load`` takes and
raises, not look-alikes.
"""

from __future__ import annotations

import pytest
import torch

import cfdist
from cfdist.storage import open_storage
from cfdist.testing import flaky


def test_every_name_in_all_is_importable():
    for name in cfdist.__all__:
        assert hasattr(cfdist, name), f"cfdist.__all__ lists {name!r} but cfdist has no such attribute"


def test_retry_names_are_public():
    assert {"RetryPolicy", "StorageUnavailable"} <= set(cfdist.__all__)
    assert issubclass(cfdist.StorageUnavailable, OSError)


def _committed(url: str) -> None:
    model = torch.nn.Linear(2, 2)
    ckpt = cfdist.Checkpointer({"model": model}, url, cfdist.Every(1000), keep=1)
    ckpt.save(block=True)
    ckpt.close()


def test_load_takes_the_public_retry_policy_and_raises_the_public_error(tmp_path):
    """Faked: every read of a step's files fails with EIO. The point: ``cfdist.load`` retries
    exactly ``cfdist.RetryPolicy(tries=3)`` times, then raises ``cfdist.StorageUnavailable``."""
    url = f"file://{tmp_path}"
    _committed(url)
    st = flaky(open_storage(url), match="step-*/*", failures=None)
    with pytest.raises(cfdist.StorageUnavailable, match="failed 3 time"):
        cfdist.load(st, read_retry=cfdist.RetryPolicy(tries=3, first_delay_s=0, max_delay_s=0))
    assert st.injected == 3
    st.heal()
    assert cfdist.load(st)["step"] == 0

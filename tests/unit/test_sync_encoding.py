"""The carrier's encoding (cfdist.checkpoint.sync): exact in every bucket dtype, pure."""

import pytest
import torch

from cfdist.checkpoint.sync import DIGITS, SyncHookError, attach_sync_hook, decode, encode
from cfdist.policy import Auto, Every


@pytest.mark.parametrize("values", [(0,), (1,), (37,), (16**8 - 1,), (5, 123456, 0)])
def test_encode_decode_round_trip(values):
    digits = encode(values, len(values))
    assert len(digits) == DIGITS * len(values) and all(0 <= d < 16 for d in digits)
    assert decode(digits, len(values)) == values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("world", [2, 8, 200])
def test_sum_with_zeros_from_other_ranks_is_exact_in_every_bucket_dtype(dtype, world):
    value = (987654321,)
    rank0 = torch.tensor([1.0] + encode(value, 1), dtype=dtype)
    others = torch.tensor([1.0] + [0.0] * DIGITS, dtype=dtype)
    total = rank0.clone()
    for _ in range(world - 1):  # the order a ring would add them in does not matter: + 0
        total += others
    assert int(total[0].item()) == world
    assert decode(total[1:].float().tolist(), 1) == value


@pytest.mark.parametrize("bad", [(-1,), (16**8,)])
def test_encode_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match="outside"):
        encode(bad, 1)


def test_width_mismatch_is_reported():
    with pytest.raises(ValueError, match="sync_width=2"):
        encode((1,), 2)


def test_policies_without_the_carrier_protocol_or_opted_out_are_left_alone():
    model = torch.nn.Linear(2, 2)
    assert attach_sync_hook(model, Every(5)) is False
    assert attach_sync_hook(model, Auto(sync=False)) is False
    with pytest.raises(SyncHookError, match="DistributedDataParallel"):
        attach_sync_hook(model, Auto())

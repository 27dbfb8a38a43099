"""Helpers shared by the Python package's tests."""
import math

import pytest
import torch

import dimattn as da


def named(dims, seed=0, dtype=torch.float32, requires_grad=False):
    """A unit-normal dimattn.Tensor over `dims` (sizes from the dims, or the
    padded extent given as (dim, size) pairs for dynamic dims)."""
    g = torch.Generator().manual_seed(seed)
    shape, ds = [], []
    for d in dims:
        if isinstance(d, tuple):
            d, size = d
        else:
            size = d.size
        shape.append(size)
        ds.append(d)
    raw = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return da.Tensor(raw.requires_grad_(requires_grad), ds)


def masked_attention(q, k, v, mask, scale=None):
    """Plain torch attention on [..., Tq, D] x [..., Tk, D] with a bool mask
    (True = attend) broadcast over [..., Tq, Tk]; rows without any allowed
    position give 0."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    e = (q @ k.transpose(-1, -2)) * scale
    e = e.masked_fill(~mask, float("-inf"))
    w = torch.softmax(e, -1).nan_to_num(0.0)
    return w @ v


@pytest.fixture(autouse=True)
def _no_env_forcing(monkeypatch):
    monkeypatch.delenv("DIMATTN_SDPA", raising=False)

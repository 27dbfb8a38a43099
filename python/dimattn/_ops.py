"""Loads the op library (python/csrc, built by the project's CMake) and gives its
ops fake kernels, so that torch.compile and torch.library.opcheck can trace them.

Where the library is found, first hit wins:
  1. the environment variable DIMATTN_TORCH_OPS (a path to libdimattn_torch_ops.so);
  2. the package's own ``_lib`` folder (an installed wheel);
  3. ``build/python`` of the checkout the package is imported from.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_LIB_NAME = "libdimattn_torch_ops.so"


def _library_path() -> Path:
    env = os.environ.get("DIMATTN_TORCH_OPS")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here / "_lib" / _LIB_NAME, here.parent.parent / "build" / "python" / _LIB_NAME):
        if candidate.is_file():
            return candidate
    raise ImportError(f"dimattn: {_LIB_NAME} not found in {here / '_lib'} or the checkout's build/python; "
                      "install the package (pip install --no-build-isolation <checkout>), build the checkout "
                      "(scripts/build), or set DIMATTN_TORCH_OPS to the library's path")


torch.ops.load_library(str(_library_path()))
ops = torch.ops.dimattn


@functools.lru_cache(maxsize=1024)
def _spec_lists(spec: str) -> dict:
    """The name lists of a call spec (q, k, v, out, energy), and the aux indices of
    its sinks and bias ("sinks", "bias", absent without)."""
    lists = {}
    for entry in spec.split(";"):
        key, _, value = entry.partition("=")
        if key in ("q", "k", "v", "out", "energy"):
            lists[key] = value.split(",") if value else []
        elif key in ("sinks", "bias"):
            lists[key] = int(value.partition(":")[0])
    return lists


def _sizes(lists: dict, query, keys, values) -> dict:
    sizes = {}
    for tag, t in (("q", query), ("k", keys), ("v", values)):
        for name, size in zip(lists[tag], t.shape):
            sizes[name] = size
    return sizes


@torch.library.register_fake("dimattn::dot_attention")
def _dot_attention_fake(query, keys, values, aux, spec):
    lists = _spec_lists(spec)
    sizes = _sizes(lists, query, keys, values)
    return query.new_empty([sizes[n] for n in lists["out"]])


@torch.library.register_fake("dimattn::dot_attention_backward")
def _dot_attention_backward_fake(grad_output, query, keys, values, aux, spec):
    # The fourth and fifth outputs are the gradients of the sinks and the bias,
    # each of its aux tensor's shape, or size 0 for a call without it.
    lists = _spec_lists(spec)

    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def learned(key):
        return query.new_empty(0) if lists.get(key) is None else like(aux[lists[key]])

    return like(query), like(keys), like(values), learned("sinks"), learned("bias")

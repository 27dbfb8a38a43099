"""Loads the op library (python/csrc, built by the project's CMake) and gives its
ops fake kernels, so that torch.compile and torch.library.opcheck can trace them.

Where the library is found, first hit wins:
  1. the environment variable DIMATTN_TORCH_OPS (a path to libdimattn_torch_ops.so);
  2. the package's own ``_lib`` folder (an installed wheel);
  3. ``build/python`` of the checkout the package is imported from.
"""
from __future__ import annotations

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


# The ops' arguments are typed (python/csrc/op_args.h), passed positionally
# after the operands (or by name): the fake kernels read them by name.
_ARGUMENT_NAMES = tuple(name for group in ops.argument_names() for name in group)


def _named(args, kwargs) -> dict:
    a = dict(zip(_ARGUMENT_NAMES, args))
    a.update(kwargs)
    return a


@torch.library.register_fake("dimattn::dot_attention")
@torch.library.register_fake("dimattn::dot_attention.full")
@torch.library.register_fake("dimattn::context_parallel_attention")
def _dot_attention_fake(query, keys, values, *args, **kwargs):
    # dims: the query's, keys', values' and result's names, split by the ranks.
    dims = _named(args, kwargs)["dims"]
    sizes = dict(zip(dims, (*query.shape, *keys.shape, *values.shape)))
    return query.new_empty([sizes[n] for n in dims[query.dim() + keys.dim() + values.dim():]])


# The learnable variant tensors (their gradients are the backward op's list
# output, in field order): "name:learnable" in the library's variant fields.
_LEARNABLE = tuple(f.split(":")[0] for f in ops.variant_fields() if f.endswith(":learnable"))


@torch.library.register_fake("dimattn::dot_attention_backward")
def _dot_attention_backward_fake(grad_output, query, keys, values, *args, **kwargs):
    a = _named(args, kwargs)

    def like(x):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    learned = [like(a[n]) for n in _LEARNABLE if a.get(n) is not None]
    return like(query), like(keys), like(values), learned


def _split_names(query, keys, values, dims):
    nq, nk, nv = query.dim(), keys.dim(), values.dim()
    return dims[:nq], dims[nq:nq + nk], dims[nq + nk:nq + nk + nv], dims[nq + nk + nv:]


@torch.library.register_fake("dimattn::dot_attention_lse")
def _dot_attention_lse_fake(query, keys, values, *args, **kwargs):
    # The output, and each row's lse over the output's dims but the value
    # features (key_dim, or dims neither the query nor the keys have).
    a = _named(args, kwargs)
    q, k, v, out = _split_names(query, keys, values, a["dims"])
    sizes = dict(zip(a["dims"], (*query.shape, *keys.shape, *values.shape)))
    features = {n for n in v if n == a["key_dim"] or (n not in k and n not in q)}
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return (query.new_empty([sizes[n] for n in out]),
            query.new_empty([sizes[n] for n in out if n not in features], dtype=lse_dtype))


@torch.library.register_fake("dimattn::dot_attention_backward.lse")
def _dot_attention_backward_lse_fake(grad_output, output, lse, query, keys, values, *args, **kwargs):
    return _dot_attention_backward_fake(grad_output, query, keys, values, *args, **kwargs)

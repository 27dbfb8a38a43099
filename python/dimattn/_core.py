"""Dims with identity, a light named-tensor wrapper, and the package's error type."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class Error(RuntimeError, ValueError):
    """Bad input or an unsupported request. The message starts with the op in
    brackets ("[dot_attention] ...") and names the dims involved with their sizes,
    as dimattn's C++ errors do (it carries their message)."""


class Dim:
    """A named dimension with identity: a Dim equals only itself, never another
    Dim made separately, whatever its name and size (Python's default ``==``).

    Static: ``Dim("batch", 3)``. Dynamic: ``Dim.dynamic("time", lengths)`` where
    ``lengths`` is an integer :class:`Tensor` of per-entry lengths over the dim's
    own dims (e.g. ``[batch]``); tensors lay the dim out with its padded extent
    and positions past an entry's length are padding.
    """

    __slots__ = ("name", "size", "lengths")

    def __init__(self, name: str, size: Optional[int] = None):
        if size is not None and size < 0:
            raise Error(f"[Dim] size of {name!r} must be >= 0, got {size}")
        self.name = name
        self.size = size
        self.lengths: Optional[Tensor] = None

    @staticmethod
    def dynamic(name: str, lengths: "Tensor") -> "Dim":
        if not isinstance(lengths, Tensor):
            raise Error(f"[Dim] lengths of dynamic dim {name!r} must be a dimattn.Tensor over its own dims, "
                        f"got {type(lengths).__name__}")
        if lengths.raw.dtype not in (torch.int32, torch.int64):
            raise Error(f"[Dim] lengths of dynamic dim {name!r} must be int32 or int64, got {lengths.raw.dtype}")
        d = Dim(name)
        d.lengths = lengths
        return d

    @property
    def is_dynamic(self) -> bool:
        return self.lengths is not None

    def __repr__(self) -> str:
        if self.lengths is not None:
            over = ", ".join(d.name for d in self.lengths.dims)
            return f"{self.name}[dynamic over {over}]" if over else f"{self.name}[dynamic]"
        return f"{self.name}[{self.size}]"


class Tensor:
    """A torch tensor and the Dims naming its axes, in order. The order is a
    storage detail: dimattn's ops find axes by Dim, never by position."""

    __slots__ = ("raw", "dims")

    def __init__(self, raw: torch.Tensor, dims: Sequence[Dim]):
        dims = tuple(dims)
        if raw.dim() != len(dims):
            raise Error(f"[Tensor] the torch tensor has {raw.dim()} axes {tuple(raw.shape)} but {len(dims)} dims "
                        f"were given: {_dims_repr(dims)}")
        for i, d in enumerate(dims):
            if not isinstance(d, Dim):
                raise Error(f"[Tensor] axis {i} is named by a {type(d).__name__}, not a dimattn.Dim")
            if d.size is not None and raw.shape[i] != d.size:
                raise Error(f"[Tensor] axis {i} has size {raw.shape[i]} but dim {d!r} has size {d.size}; "
                            f"shape {tuple(raw.shape)} vs dims {_dims_repr(dims)}")
            for e in dims[:i]:
                if e is d:
                    raise Error(f"[Tensor] dim {d!r} appears twice in {_dims_repr(dims)}; give each axis its own Dim")
        self.raw = raw
        self.dims = dims

    @classmethod
    def _trusted(cls, raw: torch.Tensor, dims) -> "Tensor":
        """Without the checks: for results whose dims the op guarantees."""
        t = object.__new__(cls)
        t.raw, t.dims = raw, tuple(dims)
        return t

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def axis_of(self, dim: Dim) -> int:
        for i, d in enumerate(self.dims):
            if d is dim:
                return i
        raise Error(f"[Tensor] dim {dim!r} is not in {_dims_repr(self.dims)}")

    def has(self, dim: Dim) -> bool:
        return any(d is dim for d in self.dims)

    def raw_in(self, dims: Sequence[Dim]) -> torch.Tensor:
        """The torch tensor with its axes in the order of ``dims`` (a permuted view)."""
        if len(dims) != len(self.dims):
            raise Error(f"[Tensor] raw_in needs all of {_dims_repr(self.dims)}, got {_dims_repr(dims)}")
        return self.raw.permute([self.axis_of(d) for d in dims])

    def __repr__(self) -> str:
        return f"dimattn.Tensor({_dims_repr(self.dims)}, {self.raw.dtype}, {self.raw.device})"


def _dims_repr(dims: Sequence[Dim]) -> str:
    return "(" + ", ".join(repr(d) for d in dims) + ")"

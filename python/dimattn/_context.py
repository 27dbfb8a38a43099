"""The run context of dot_attention calls, per thread: the train flag, forced
kernels and active traces."""
from __future__ import annotations

import dataclasses
import threading
from typing import List, Optional, Sequence, Tuple, Union

from ._core import Error, Tensor
from ._ops import ops


class _State(threading.local):
    def __init__(self):
        self.train = False
        self.force: List[Tuple[str, ...]] = []
        self.traces: List["trace"] = []


state = _State()

# Fixed once the library is loaded; read here, not through the op, so that
# force() works inside torch.compile too.
_KERNEL_NAMES = tuple(ops.kernel_names())


def kernel_names() -> List[str]:
    """Every kernel name of the built library.

    Returns:
        "reference" and the kernels of its backends' tables.
    """
    return list(_KERNEL_NAMES)


def train_flag() -> bool:
    """Whether dropout acts in calls that pass no ``train=``.

    Returns:
        The innermost :class:`train_scope`'s flag on this thread, else False.
    """
    return state.train


class train_scope:
    """``with dimattn.train_scope(True):`` dropout acts inside (per thread), as
    RETURNN's run_ctx.train_flag; a call's ``train=`` argument overrides it."""

    def __init__(self, on: bool = True):
        self.on = bool(on)

    def __enter__(self):
        self.saved = state.train
        state.train = self.on
        return self

    def __exit__(self, *exc):
        state.train = self.saved
        return False


class force:
    """``with dimattn.force("reference"):``, ``force(["cpu_flash", "aten_flash_cpu"])``
    or ``force("cpu_flash,aten_flash_cpu")``: only these kernels may run calls made
    inside (per thread, forward and backward); "auto" lets selection decide. A
    forced kernel that cannot run a call is an error giving the reason, never a
    silent fallback. Without a scope the environment variable DIMATTN_SDPA (a comma
    list) applies."""

    def __init__(self, kernels: Union[str, Sequence[str]]):
        names = kernels.split(",") if isinstance(kernels, str) else list(kernels)
        names = tuple(k.strip() for k in names)
        unknown = [k for k in names if k not in _KERNEL_NAMES and k != "auto"]
        if unknown or not names:
            raise Error(f"[force] unknown kernel {', '.join(unknown) or '(none given)'}; known: auto, "
                        f"{', '.join(_KERNEL_NAMES)}")
        self.kernels = names

    def __enter__(self):
        state.force.append(self.kernels)
        return self

    def __exit__(self, *exc):
        state.force.pop()
        return False


def forced() -> Optional[Tuple[str, ...]]:
    """The kernels the innermost force scope allows, None outside one."""
    return state.force[-1] if state.force else None


@dataclasses.dataclass
class AttentionTrace:
    """One traced call. With capture_tensors, ``energy`` (q·k·scale before masking)
    and ``att_weights`` (after masking, softmax and dropout) are named tensors with
    the call's own dims (the kv side of self-attention is a new dim, ``axis'``)."""
    kernel: str
    output: Tensor
    energy: Optional[Tensor] = None
    att_weights: Optional[Tensor] = None


class trace:
    """``with dimattn.trace() as t:`` records each dot_attention call made inside
    (per thread) in ``t.records``. With ``capture_tensors`` (default) calls run the
    reference path and records hold energy and weights; without, calls run as
    selected and records hold the kernel that ran and the output. Eager mode only:
    inside torch.compile nothing is recorded."""

    def __init__(self, capture_tensors: bool = True):
        self.capture_tensors = capture_tensors
        self.records: List[AttentionTrace] = []

    def _scopes(self) -> list:
        """The per-thread list of open traces this one joins (dimattn.returnn.trace: its own)."""
        return state.traces

    def __enter__(self):
        self._scopes().append(self)
        return self

    def __exit__(self, *exc):
        self._scopes().remove(self)
        return False

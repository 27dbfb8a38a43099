"""dimattn for PyTorch: dot_attention over named dims as a torch custom op.

    import dimattn
    batch, heads, feat = dimattn.Dim("batch", 2), dimattn.Dim("heads", 4), dimattn.Dim("feat", 16)
    time = dimattn.Dim.dynamic("time", dimattn.Tensor(torch.tensor([7, 5]), [batch]))
    q = dimattn.Tensor(torch.randn(2, 4, 7, 16), [batch, heads, time, feat])
    out = dimattn.dot_attention(q, k, v, key_dim=feat, axis=time, causal_query_spatial_dim=time)

See docs/python.md.
"""
from ._core import Dim, Error, Tensor
from ._context import AttentionTrace, force, kernel_names, trace, train_flag, train_scope
from ._variants import Variants
from ._attention import Decision, Rejection, dot_attention, explain
from ._context_parallel import ContextParallel, shard, shard_ranges
from ._varlen import packed_attention, varlen_attention
from ._sdpa import scaled_dot_product_attention, sdpa_patched
from ._kv_cache import kv_cache_append, kv_cache_attention
from . import nn

__all__ = ["Dim", "Error", "Tensor", "AttentionTrace", "Decision", "Rejection", "Variants", "dot_attention", "explain",
           "force", "kernel_names", "trace", "train_flag", "train_scope", "ContextParallel", "shard", "shard_ranges",
           "packed_attention", "varlen_attention", "scaled_dot_product_attention", "sdpa_patched", "kv_cache_attention",
           "kv_cache_append"]
__version__ = "0.1.0"

"""A transformer encoder layer written with dimattn, and its twin on plain torch ops.

The attention of EncoderLayer names its dims: `time` is dynamic (per-sequence
lengths), so padding is masked by dimattn itself, and q, k and v are strided views
of one fused projection, read as they are. PlainEncoderLayer is the same layer with
F.scaled_dot_product_attention and an explicit padding mask; with the same weights
both compute the same function (tests/python/test_training.py trains both).

    python examples/python/encoder_layer.py
"""
import torch
import torch.nn.functional as F
from torch import nn

import dimattn as da


class EncoderLayer(nn.Module):
    def __init__(self, model_dim=32, num_heads=4, ff_dim=64, att_dropout=0.0):
        super().__init__()
        self.num_heads, self.att_dropout = num_heads, att_dropout
        self.per_head = model_dim // num_heads
        self.norm1, self.norm2 = nn.LayerNorm(model_dim), nn.LayerNorm(model_dim)
        self.qkv = nn.Linear(model_dim, 3 * model_dim)
        self.proj = nn.Linear(model_dim, model_dim)
        self.ff = nn.Sequential(nn.Linear(model_dim, ff_dim), nn.ReLU(), nn.Linear(ff_dim, model_dim))

    def attend(self, q, k, v, lengths):
        """q, k, v: [B, T, H, D] views; lengths: [B]."""
        B, T, H, D = q.shape
        batch, heads, feat = da.Dim("batch", B), da.Dim("heads", H), da.Dim("per_head", D)
        time = da.Dim.dynamic("time", da.Tensor(lengths, [batch]))
        dims = [batch, time, heads, feat]
        # Values carry the key feature dim too: it is reduced only in q·k.
        out = da.dot_attention(da.Tensor(q, dims), da.Tensor(k, dims), da.Tensor(v, dims), key_dim=feat, axis=time,
                               att_dropout=self.att_dropout, train=self.training)
        return out.raw_in(dims)

    def forward(self, x, lengths):
        """x: [B, T, model_dim], lengths: [B] (positions >= length are padding)."""
        B, T, M = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.num_heads, self.per_head).unbind(2)
        x = x + self.proj(self.attend(q, k, v, lengths).reshape(B, T, M))
        return x + self.ff(self.norm2(x))


class PlainEncoderLayer(EncoderLayer):
    """The same layer on torch's SDPA with an explicit kv padding mask."""

    def attend(self, q, k, v, lengths):
        T = q.shape[1]
        mask = (torch.arange(T, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             dropout_p=self.att_dropout if self.training else 0.0)
        return out.transpose(1, 2)


def train(model, steps=20, seed=0, batch=4, time=10, model_dim=32):
    """Trains `model` to map random sequences to random targets; the loss per step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, time, model_dim, generator=g)
    target = torch.randn(batch, time, model_dim, generator=g)
    lengths = torch.randint(1, time + 1, (batch,), generator=g)
    lengths[0] = time
    valid = (torch.arange(time)[None, :] < lengths[:, None])[..., None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x, lengths) - target) ** 2 * valid).sum() / (valid.sum() * model_dim)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    torch.manual_seed(0)
    a = EncoderLayer()
    b = PlainEncoderLayer()
    b.load_state_dict(a.state_dict())
    for step, (la, lb) in enumerate(zip(train(a), train(b))):
        print(f"step {step:2d}  dimattn {la:.6f}  plain torch {lb:.6f}  diff {abs(la - lb):.1e}")

"""The encoder layer of examples/python trained for 20 steps with dimattn and
with plain torch ops from the same seed: the losses agree."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))
import encoder_layer  # noqa: E402


def test_twenty_steps_match_plain_torch():
    torch.manual_seed(0)
    a = encoder_layer.EncoderLayer()
    b = encoder_layer.PlainEncoderLayer()
    b.load_state_dict(a.state_dict())
    la, lb = encoder_layer.train(a), encoder_layer.train(b)
    assert len(la) == 20
    assert la[-1] < la[0]  # it learns
    assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5, (la, lb)


def test_compiled_layer_trains_like_eager():
    torch.manual_seed(0)
    a = encoder_layer.EncoderLayer()
    b = encoder_layer.EncoderLayer()
    b.load_state_dict(a.state_dict())
    la = encoder_layer.train(a, steps=3)
    lb = encoder_layer.train(torch.compile(b, fullgraph=True, backend="aot_eager"), steps=3)
    assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5, (la, lb)


def test_returnn_style_adapter_example():
    import returnn_adapter
    returnn_adapter.demo()

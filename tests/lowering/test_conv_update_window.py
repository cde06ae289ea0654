"""lowering/inductor/conv_update_window.py: the whole-window (W-column) state update."""

import pytest
import torch
import torch.nn.functional as F

from tests.lowering.compiled import compile_kda
from tests.lowering.conv_cases import BATCH, CHANNELS, WIDTH, check_formulation


def window_update(x, conv_state, weight, bias, activation):
    window = torch.cat([conv_state[..., 1:], x.unsqueeze(-1)], -1)
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias
    conv_state.copy_(window)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_window_update_fuses_in_place_every_variant(dtype):
    check_formulation(window_update, "conv_update_window", dtype, (BATCH, CHANNELS))


def test_unrelated_cat_and_sum_stay_untouched():
    """A cat + weighted sum whose window is not written back, one written back whose
    "weight" is per batch row (not a depthwise conv weight), and a norm without gate."""

    def fn(x, state, weight, per_row, other_state, h, norm_weight):
        window = torch.cat([state[..., 1:], x.unsqueeze(-1)], -1)
        plain = F.silu((window * weight).sum(-1))
        window2 = torch.cat([other_state[..., 1:], x.unsqueeze(-1)], -1)
        not_conv = F.silu((window2 * per_row).sum(-1))
        other_state.copy_(window2)
        hf = h.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
        return plain, not_conv, torch.sigmoid(normed)

    args = (torch.randn(BATCH, CHANNELS), torch.randn(BATCH, CHANNELS, WIDTH),
            torch.randn(CHANNELS, WIDTH), torch.randn(BATCH, CHANNELS, WIDTH),
            torch.randn(BATCH, CHANNELS, WIDTH), torch.randn(4, 16), torch.randn(16))  # fmt: skip
    _, counts, code = compile_kda(fn, *args)
    assert counts == {}
    assert "kda." not in code


def test_log_names_the_formulation_and_the_model_line(monkeypatch, caplog):
    monkeypatch.setenv("KDA_LOG_PASSES", "1")
    args = (torch.randn(BATCH, CHANNELS), torch.randn(BATCH, CHANNELS, WIDTH),
            torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS), "silu")  # fmt: skip
    with caplog.at_level("WARNING", logger="lowering.inductor"):
        compile_kda(window_update, *args)
    assert (
        "kda pass conv_update_window: matched whole-window conv update (cat shift, x [B, D] "
        "unsqueezed, sum, bias, silu) at "
        "test_conv_update_window.py:" in caplog.text
    )
    assert "(window_update)" in caplog.text

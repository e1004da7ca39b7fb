"""fxmem.calibrate: per-unit statistics of the hidden units that feed linears/convs, on real data."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from fxmem.calibrate import CalibrationStats, calibrate, normalize_item
from fxmem.errors import FxmemError
from tests.conftest import example, example_module


def _digits_program():
    model, args, kwargs, _ = example("mlp_digits", hidden=32)
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    return model, p


def _hidden_acts(model, items):
    """The eager model's ReLU outputs feeding net.2 (the second Linear), concatenated over items."""
    acts = []
    h = model.net[1].register_forward_hook(lambda m, i, o: acts.append(o.detach()))
    try:
        with torch.no_grad():
            for it in items:
                model(*normalize_item(it)[0])
    finally:
        h.remove()
    return torch.cat(acts)


def test_stats_match_a_direct_computation_on_real_digits():
    model, p = _digits_program()
    data = example_module("mlp_digits").calibration_data(n_batches=6)
    st = calibrate(p, data, max_batches=4, eps=0.0, progress=False)
    assert st.batches == 4
    layer = st.layers["net.2"]  # the units that feed net.2 (ReLU outputs)
    a = _hidden_acts(model, data[:4]).double()
    assert layer.units == 32 and layer.count == a.shape[0] == 4 * 32
    torch.testing.assert_close(layer.mean, a.mean(0))
    torch.testing.assert_close(layer.mean_abs, a.abs().mean(0))
    torch.testing.assert_close(layer.var, a.var(0, unbiased=False))
    # ReLU with eps=0: firing = exact non-zeros
    torch.testing.assert_close(layer.freq, (a != 0).double().mean(0))
    assert 0 < float(layer.freq.mean()) < 1  # trained-or-not, ReLU silences some units on real digits


def test_relative_eps_counts_magnitude_for_gelu_models():
    """GELU almost never gives exact zeros: firing is |a| > eps * (the layer's mean |a|)."""
    gpt = example_module("gpt")
    model, args, kwargs, _ = example("gpt", n_layer=1, d_model=32, n_head=2)
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    data = gpt.calibration_data(n_batches=2)
    zero = calibrate(p, data, eps=0.0, progress=False).layers["h.0.mlp.c_proj"]
    rel = calibrate(p, data, eps=0.5, progress=False).layers["h.0.mlp.c_proj"]
    assert zero.units == 128
    assert float(zero.freq.min()) == 1.0  # every GELU output is non-zero
    assert float(rel.freq.mean()) < 0.9  # relative to the layer's scale, many are "cold"
    # by hand for one unit
    acts = []
    h = model.h[0].mlp.gelu.register_forward_hook(lambda m, i, o: acts.append(o.detach().reshape(-1, 128)))
    with torch.no_grad():
        for (x,) in data:
            model.eval()(x)
    h.remove()
    fired = torch.cat([(a.abs() > 0.5 * a.abs().mean()).double() for a in acts]).mean(0)
    torch.testing.assert_close(rel.freq, fired)


def test_histograms_plot_and_summary(tmp_path):
    _, p = _digits_program()
    st = calibrate(p, example_module("mlp_digits").calibration_data(n_batches=2), progress=False)
    h = st.histograms(bins=10)
    assert len(h["bin_edges"]) == 11
    for name in ("net.0", "net.2", "net.4"):
        assert sum(h[name]) == st.layers[name].units
    s = st.summary()
    assert s["layers"]["net.2"]["units"] == 32 and s["batches"] == 2
    st.plot(tmp_path / "cold.png", tmp_path / "cold.svg")
    assert (tmp_path / "cold.png").read_bytes()[:4] == b"\x89PNG"
    assert "<svg" in (tmp_path / "cold.svg").read_text()


def test_conv_channels_and_gnn_hidden_dims():
    unet = example_module("unet")
    model, args, kwargs, _ = example("unet", base=8)
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    st = calibrate(p, unet.calibration_data(n_batches=1), progress=False)
    conv = st.layers["enc1.3"]  # input of the second conv: 8 channels on dim 1
    assert conv.channel_dim == 1 and conv.units == 8 and conv.count == 8 * 16 * 16
    gcn = example_module("gcn")
    model, args, kwargs, _ = example("gcn")
    p = fxmem.capture(model, args, kwargs, mode="inference")
    p.refresh()
    st = calibrate(p, gcn.calibration_data(n_batches=2), progress=False)
    assert st.layers["convs.1.lin"].units == 16


def test_errors_and_cap():
    _, p = _digits_program()
    with pytest.raises(FxmemError, match="no data"):
        calibrate(p, None)
    with pytest.raises(FxmemError, match="empty"):
        calibrate(p, [], progress=False)
    st = calibrate(p, iter(example_module("mlp_digits").calibration_data(n_batches=8)), max_batches=3,
                   progress=False)
    assert isinstance(st, CalibrationStats) and st.batches == 3


def test_module_stays_in_its_mode_and_buffers_untouched():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 1, 6, 6)
    p = fxmem.capture(model, (x,), mode="train")
    p.refresh()
    rm = p.module.get_submodule("1").running_mean.clone()
    p.module.train()
    st = calibrate(p, [(torch.randn(3, 1, 6, 6),)], progress=False)
    assert p.module.training
    assert torch.equal(p.module.get_submodule("1").running_mean, rm)
    assert st.layers["3"].units == 4


def test_accepts_a_plain_module():
    model, _ = _digits_program()
    data = example_module("mlp_digits").calibration_data(n_batches=2)
    st = calibrate(model, data, progress=False)
    assert st.batches == 2 and st.layers["net.2"].units == 32
    with pytest.raises(FxmemError, match="Program or an nn.Module"):
        calibrate("model", data)

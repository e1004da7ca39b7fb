"""Small U-Net for stroke segmentation of handwritten digits (sklearn ``load_digits``).

What it is
    Encoder: two (Conv3x3-BN-ReLU) x 2 blocks, each followed by 2x max-pool down-sampling (twice),
    a bottleneck block, then a decoder that up-samples with ``ConvTranspose2d(k=2, s=2)``,
    concatenates the matching encoder feature map (skip connection) and applies a block;
    a 1x1 conv gives one logit per pixel. ``forward(x) -> logits (B, 1, H, W)``.

Task and data
    The 8x8 digits that ship with scikit-learn (``sklearn.datasets.load_digits``, 1797 images,
    no download) are scaled to [0, 1], bilinearly up-sampled to ``size`` x ``size`` and given mild
    deterministic Gaussian noise (std 0.1). The task is to segment the strokes: the target mask is
    ``avg_pool3x3(x) > 0.35``, computed from the input by ``loss_fn`` (binary cross-entropy with
    logits), so a smoothing-and-threshold function of the noisy image has to be learned.
    Split: images 0..1499 feed ``example_inputs`` / ``calibration_data``; images 1500.. are held out
    for ``evaluate`` (mean Dice score, higher is better).

Default size
    base width 16 channels (16-32-64), input (8, 1, 16, 16), about 0.1 M parameters.

Scaling
    ``build_model(base=32)`` widens all layers; ``example_inputs(batch=..., size=32)`` (size must be
    a multiple of 4 because of the two 2x down-samplings).

Export notes
    Captures with ``torch.export(strict=False)`` in train and eval mode; BatchNorm's running-stat
    updates in train mode show up as buffer mutations in the graph signature. Under ``Dim.AUTO``
    batch, height and width stay dynamic (H and W must stay divisible by 4 for the skip concat);
    the channel dim (1) is specialised.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULTS = dict(base=16, in_channels=1, out_channels=1)
INPUT_DEFAULTS = dict(batch=8, size=16)
_N_TRAIN = 1500


def _block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, base=16, in_channels=1, out_channels=1):
        super().__init__()
        self.enc1 = _block(in_channels, base)
        self.enc2 = _block(base, 2 * base)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _block(2 * base, 4 * base)
        self.up2 = nn.ConvTranspose2d(4 * base, 2 * base, kernel_size=2, stride=2)
        self.dec2 = _block(4 * base, 2 * base)
        self.up1 = nn.ConvTranspose2d(2 * base, base, kernel_size=2, stride=2)
        self.dec1 = _block(2 * base, base)
        self.out = nn.Conv2d(base, out_channels, kernel_size=1)

    def forward(self, x):
        e1 = self.enc1(x)                      # (B, c, H, W)
        e2 = self.enc2(self.pool(e1))          # (B, 2c, H/2, W/2)
        b = self.bottleneck(self.pool(e2))     # (B, 4c, H/4, W/4)
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.out(d1)


def build_model(**kwargs):
    cfg = {**DEFAULTS, **{k: v for k, v in kwargs.items() if k in DEFAULTS}}
    torch.manual_seed(0)
    return UNet(**cfg)


# ---------------------------------------------------------------- sklearn digits (ships with sklearn)

def _digits(start, count, size, seed):
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images[start:start + count], dtype=torch.float32) / 16.0
    x = F.interpolate(images.unsqueeze(1), size=(size, size), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    return (x + 0.1 * torch.randn(x.shape, generator=g)).contiguous()


def example_inputs(batch=INPUT_DEFAULTS["batch"], size=INPUT_DEFAULTS["size"], **_):
    return (_digits(0, batch, size, seed=0),)


def _target(x):
    return (F.avg_pool2d(x, 3, stride=1, padding=1) > 0.35).to(x.dtype)


def loss_fn(output, inputs):
    """Binary cross-entropy of the pixel logits against the stroke mask derived from the input."""
    return F.binary_cross_entropy_with_logits(output, _target(inputs[0]))


def calibration_data(n_batches=8, batch=INPUT_DEFAULTS["batch"], size=INPUT_DEFAULTS["size"]):
    """Consecutive batches of real digits from the training split (images 0..1499)."""
    return [(_digits((i * batch) % (_N_TRAIN - batch), batch, size, seed=1 + i),) for i in range(n_batches)]


@torch.no_grad()
def evaluate(module, n_images=256, size=INPUT_DEFAULTS["size"]):
    """Mean Dice score of the predicted stroke masks on held-out digits (images 1500..)."""
    was_training = getattr(module, "training", False)
    try:
        module.eval()
    except NotImplementedError:  # bare torch.export module: evaluated in the mode it was captured in
        pass
    try:
        dice = []
        for start in range(_N_TRAIN, _N_TRAIN + n_images, INPUT_DEFAULTS["batch"]):
            x = _digits(start, INPUT_DEFAULTS["batch"], size, seed=start)
            pred = (module(x) > 0).float()
            tgt = _target(x)
            inter = (pred * tgt).sum(dim=(1, 2, 3))
            dice.append((2 * inter + 1) / (pred.sum(dim=(1, 2, 3)) + tgt.sum(dim=(1, 2, 3)) + 1))
        return torch.cat(dice).mean().item()
    finally:
        if was_training:
            try:
                module.train()
            except NotImplementedError:
                pass

"""How close reconstructions are to the true images: PSNR, SSIM, the noise floor, and the best matching.

Images are (N, C, H, W) in [0, 1]. SSIM is scikit-image's ``structural_similarity`` (Wang, Bovik, Sheikh and
Simoncelli 2004, its standard constants and 7x7 window), from the ``privacy`` extra. The noise floor is what a
reconstruction scores without any information: the better of a uniform random image and the dataset's mean
image. A batch's reconstructions come in any order, so each is matched to a true image by the assignment of
highest total PSNR (``scipy.optimize.linear_sum_assignment``).
"""
from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment

from edgetrain.errors import EdgetrainError

# Imported inside functions: skimage (the privacy extra; ssim says so in one line where it is missing).


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two images in [0, 1]."""
    mse = float((a.double() - b.double()).pow(2).mean())
    return float("inf") if mse == 0 else -10.0 * torch.log10(torch.tensor(mse)).item()


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Structural similarity of two (C, H, W) images in [0, 1]."""
    try:
        from skimage.metrics import structural_similarity
    except ImportError:
        raise EdgetrainError("SSIM needs scikit-image; install it with pip install 'edgetrain[privacy]'") from None
    return float(structural_similarity(a.double().numpy(), b.double().numpy(), channel_axis=0, data_range=1.0))


def match(reconstructed: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """``reconstructed`` reordered so that its i-th image is the one assigned to ``true[i]``."""
    scores = torch.tensor([[psnr(r, t) for r in reconstructed] for t in true])
    rows, cols = linear_sum_assignment(scores.clamp(max=100).numpy(), maximize=True)
    return reconstructed[torch.as_tensor(cols[rows.argsort()])]


def scores(reconstructed: torch.Tensor, true: torch.Tensor) -> tuple[float, float]:
    """(mean PSNR, mean SSIM) of the matched reconstructions."""
    matched = match(reconstructed, true)
    pairs = list(zip(matched, true))
    return sum(psnr(r, t) for r, t in pairs) / len(pairs), sum(ssim(r, t) for r, t in pairs) / len(pairs)


def noise_floor(true: torch.Tensor, mean_image: torch.Tensor, seed: int = 0) -> float:
    """Mean PSNR of the better guess without information: a uniform random image or ``mean_image``."""
    random = torch.rand(true.shape, generator=torch.Generator().manual_seed(seed))
    guesses = (random, mean_image.expand_as(true))
    return max(sum(psnr(g, t) for g, t in zip(guess, true)) / len(true) for guess in guesses)

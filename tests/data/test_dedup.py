"""Near-duplicate filtering (data/dedup.py): planted duplicates found, distinct images kept, the first by
index kept, the same answer every time; ``edgetrain data dedup`` and ``--dedup`` in training."""
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from edgetrain_testing import CIFAR, FAST, run_cli
from edgetrain import train
from edgetrain.cli import main
from edgetrain.config import load_config
from edgetrain.data import dedup, digits
from edgetrain.data.cifar import load_cifar10
from edgetrain.errors import EdgetrainError
from edgetrain.spec import DEDUP_DEFAULT_THRESHOLD, DedupSpec, parse_dedup


def shifted(images: torch.Tensor) -> torch.Tensor:
    """One pixel to the right, the first column repeated (as a camera that moved a little)."""
    out = torch.roll(images, 1, dims=3)
    out[..., 0] = images[..., 0]
    return out


def brighter(images: torch.Tensor) -> torch.Tensor:
    return (images.float() * 1.05).clamp(0, 255).round().to(torch.uint8)


def jpeg(images: torch.Tensor, quality: int = 75) -> torch.Tensor:
    """A real JPEG round trip (Pillow), as a re-encoded frame."""
    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, "JPEG", quality=quality)
        out.append(torch.from_numpy(np.array(Image.open(buffer))).permute(2, 0, 1))
    return torch.stack(out)


@pytest.fixture(scope="module")
def cifar_images():
    if not (CIFAR / "data_batch_1").is_file():
        pytest.skip(f"CIFAR-10 subset not found at {CIFAR}")
    (train_images, _), (test_images, _) = load_cifar10(CIFAR)
    return train_images, test_images


@pytest.mark.parametrize("perturb", [shifted, brighter, jpeg])
def test_planted_near_duplicates_are_found_and_point_at_their_original(cifar_images, perturb):
    originals = cifar_images[0][:200]
    # original i at 2i, its near duplicate right after it at 2i + 1, as consecutive video frames
    images = torch.stack([originals, perturb(originals)], dim=1).flatten(0, 1)
    report = dedup.find_near_duplicates(images, DEDUP_DEFAULT_THRESHOLD)
    found = report.duplicate_of[1::2]
    assert (report.duplicate_of[0::2] == -1).all()  # no original removed
    assert (found >= 0).mean() >= 0.95, f"found {(found >= 0).mean():.0%} of the {perturb.__name__} copies"
    assert (found[found >= 0] == np.arange(0, 400, 2)[found >= 0]).all()  # each names its own original
    assert report.removed == (found >= 0).sum() and report.bytes_removed == report.removed * 3 * 32 * 32


def test_distinct_cifar_images_are_all_kept_at_the_default_threshold(cifar_images):
    report = dedup.find_near_duplicates(cifar_images[1], DEDUP_DEFAULT_THRESHOLD)  # the 1,024 test images
    assert report.samples == len(cifar_images[1]) and report.removed == 0 and report.bytes_removed == 0


def test_the_first_kept_image_wins_and_a_chain_keeps_its_far_end():
    # hashes: 1 is 4 bits from 0; 2 is 4 bits from 1 but 8 from 0; 3 equals 0
    hashes = np.zeros((4, 144), dtype=bool)
    hashes[1, :4] = True
    hashes[2, :8] = True
    assert dedup.duplicate_of(hashes, 4).tolist() == [-1, 0, -1, 0]
    assert dedup.duplicate_of(hashes, 3).tolist() == [-1, -1, -1, 0]


def test_blocks_give_the_same_groups_as_all_pairs_at_once(monkeypatch):
    rng = np.random.default_rng(0)
    base = rng.random((30, 144)) < 0.5
    hashes = base[rng.integers(0, 30, 200)] ^ (rng.random((200, 144)) < 0.05)  # noisy copies of 30 images
    whole = dedup.duplicate_of(hashes, 20)
    monkeypatch.setattr(dedup, "BLOCK", 7)  # pairs straddle blocks
    assert (dedup.duplicate_of(hashes, 20) == whole).all()
    distance = (hashes[:, None] != hashes[None]).sum(-1)
    for j in np.flatnonzero(whole >= 0):  # every removed image is near its kept original
        assert whole[whole[j]] == -1 and distance[j, whole[j]] <= 20
    kept = np.flatnonzero(whole < 0)
    assert (distance[np.ix_(kept, kept)] + 1000 * np.eye(len(kept)) > 20).all()  # kept ones pairwise far


def test_the_same_images_give_the_same_answer_every_time(cifar_images):
    images = torch.cat([cifar_images[0][:300], shifted(cifar_images[0][:100])])
    first, second = (dedup.find_near_duplicates(images, DEDUP_DEFAULT_THRESHOLD) for _ in range(2))
    assert (first.duplicate_of == second.duplicate_of).all() and first.removed > 0


def test_a_dataset_without_images_and_odd_shapes_are_one_line_errors():
    with pytest.raises(EdgetrainError, match="exposing its images"):
        dedup.images_of(object())
    with pytest.raises(EdgetrainError, match="1 or 3 channels"):
        dedup.perceptual_hashes(torch.zeros(2, 2, 8, 8))


def test_dedup_option_parses_once_and_refuses_out_of_range():
    assert parse_dedup("off") is None and parse_dedup("on") == DedupSpec(DEDUP_DEFAULT_THRESHOLD)
    assert parse_dedup("12") == DedupSpec(12)
    for bad in ("73", "-1", "lots"):
        with pytest.raises(EdgetrainError, match="Hamming distance 0..72"):
            load_config(dedup=bad)


def test_cli_prints_the_counts_and_writes_the_kept_indices(tmp_path):
    done = run_cli("data", "dedup", "--dataset", "digits", "--threshold", "16", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "dedup-digits-train.json").read_text())
    assert written["removed"] > 0 and written["removed"] + len(written["kept"]) == written["samples"] == 1437
    assert f"{written['removed']:,} of 1,437 images removed" in done.stdout
    assert all(int(i) not in written["kept"] and j in written["kept"] for i, j in written["duplicate_of"].items())


@pytest.mark.parametrize("args, message", [
    (("--dataset", "imagenet"), "unknown dataset 'imagenet'; known datasets: digits"),
    (("--threshold", "99"), "argument --threshold: expected a number of bits 0..72"),
    (("--dataset", "cifar10", "--data-dir", "/nonexistent"), "CIFAR-10 directory /nonexistent does not exist"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    try:
        status = main(["data", "dedup", *args, "--output", str(tmp_path / "out")])
    except SystemExit as e:  # argparse's errors exit from the parser
        status = e.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.startswith("edgetrain: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_training_with_dedup_drops_duplicates_before_sampling_and_records_it(tmp_path):
    summary = train(dict(FAST, dataset="digits", dedup="16", epochs=1, batch_size=64, output=str(tmp_path)))
    expected = dedup.find_near_duplicates(digits().train.images, 16)
    recorded = summary["dedup"]  # RunSummary.details, which summary.json writes flat
    assert recorded["removed"] == expected.removed > 0 and recorded["samples"] == 1437
    assert summary["steps"] == (1437 - expected.removed) // 64  # an epoch is over the kept images only

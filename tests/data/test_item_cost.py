"""What one item costs the loader (data/storage.py ``load_npy``, data/images.py ``normalise``): the same values as
``np.load`` and the out-of-place normalisation, with the waste measured in docs/benchmarks/storage.md gone (an
``.npy`` header parsed per item; four new float images per item where one will do)."""
import io

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgetrain.data import storage
from edgetrain.data.images import TensorImages, random_crop_flip
from edgetrain.data.storage import load_npy


def npy(a: np.ndarray, version=None) -> bytes:
    f = io.BytesIO()
    if version is None:
        np.save(f, a)
    else:
        np.lib.format.write_array(f, a, version=version)
    return f.getvalue()


@pytest.mark.parametrize("a", [
    np.random.default_rng(0).integers(0, 255, (3, 7, 5), dtype=np.uint8),
    np.random.default_rng(1).random((1, 4, 6)).astype(np.float32),
    np.random.default_rng(2).random((2, 3)),
    np.asfortranarray(np.random.default_rng(3).random((4, 5))),
    np.arange(6, dtype=">i4").reshape(2, 3),
    np.zeros((0, 3), dtype=np.uint8),
])
@pytest.mark.parametrize("version", [None, (2, 0)])
def test_load_npy_gives_what_np_load_gives(a, version):
    raw = npy(a, version)
    for _ in range(2):  # the second time from the parsed header
        got, want = load_npy(raw), np.load(io.BytesIO(raw), allow_pickle=False)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        assert got.flags.writeable and got.flags.f_contiguous == want.flags.f_contiguous
        got[...] = 0  # its own memory, not the raw bytes'
    assert np.array_equal(np.load(io.BytesIO(raw), allow_pickle=False), a)


def test_load_npy_refuses_what_np_load_refuses():
    raw = npy(np.arange(100, dtype=np.uint8).reshape(10, 10))
    load_npy(raw)
    with pytest.raises(EOFError, match="ends 7 bytes early"):
        load_npy(raw[:-7])  # a truncated member, its header already known
    with pytest.raises(ValueError):
        load_npy(b"not an array at all")
    with pytest.raises(ValueError, match="allow_pickle"):
        load_npy(npy(np.array([{"a": 1}], dtype=object)))


def test_a_packed_sets_npy_header_is_parsed_once(monkeypatch):
    calls = []
    parse = np.lib.format.read_array_header_1_0
    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", lambda f, *a: calls.append(1) or parse(f, *a))
    monkeypatch.setattr(storage, "_NPY_HEADERS", {})
    rng = np.random.default_rng(0)
    for _ in range(10):  # ten items of one shape and type, as a packed set's
        a = rng.integers(0, 255, (3, 8, 8), dtype=np.uint8)
        assert np.array_equal(load_npy(npy(a)), a)
    assert len(calls) == 1


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
@pytest.mark.parametrize("augment", [False, True])
def test_normalise_gives_the_out_of_place_values_with_one_new_image(dtype, augment):
    images = (torch.rand(6, 3, 9, 9) * 255).to(dtype)
    kept = images.clone()
    data = TensorImages(images, torch.arange(6), [0.4, 0.5, 0.6], [0.2, 0.25, 0.3], augment=augment, seed=5)
    for k in range(6):
        x = images[k].float() / data.scale  # the out-of-place form the loader used before
        if augment:
            x = random_crop_flip(x, np.random.default_rng((5, 1, k)))
        want = (x - data.mean) / data.std
        with Ops() as ops:
            got, _ = data[(k, 1)]
        assert torch.equal(got, want) and got.dtype == torch.float32 and got.is_contiguous()
        # The float copy, then in place (augmenting: the pad, the flip and one subtraction make their own).
        made = [n for n in ops.names if not n.endswith("_.Tensor") and not n.endswith("_.Scalar")
                and n.split(".")[0] not in ("slice", "view", "alias", "detach", "t", "select", "empty")]
        if not augment:
            assert made == ["_to_copy.default"], ops.names
    assert torch.equal(images, kept)  # the data itself never written, float32 included

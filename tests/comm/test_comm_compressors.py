"""Compressors on their own: error bounds, error feedback, payload sizes, spec errors."""
from __future__ import annotations

import math

import pytest
import torch

from edgetrain.comm.compress import (QSGD, DGCMemory, HalfCast, Int8, LowBit, MajorityVote, NoCompression, RandomK,
                                     ResidualMemory, ScaledSign, Threshold, TopK, link_threshold, unpack)
from edgetrain.errors import EdgetrainError
from edgetrain.spec import get_link, parse_compress


def sample(n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) * 0.1


def roundtrip(c, x):
    p = c.encode(x)
    return p, c.decode(p)


def test_none_is_exact():
    x = sample()
    p, d = roundtrip(NoCompression(), x)
    assert torch.equal(d, x) and p.nbytes == 4 * x.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_cast_bound(dtype):
    x = torch.cat([sample(), torch.tensor([1e-7, -3e-6, 70000.0, 123.456])])
    p, d = roundtrip(HalfCast(dtype), x)
    assert p.nbytes == 2 * x.numel()
    if dtype == torch.float16:
        inside = x.abs() <= 65504
        bound = torch.maximum(x.abs() * 2 ** -11, torch.tensor(2 ** -25))
        assert ((x - d).abs()[inside] <= bound[inside]).all()
        assert d[~inside].abs().max() == 65504  # clamped, not inf
    else:
        assert ((x - d).abs() <= x.abs() * 2 ** -8).all()


def test_int8_bound_and_size():
    x = sample()
    p, d = roundtrip(Int8(), x)
    assert ((x - d).abs() <= x.abs().max() / 254 * (1 + 1e-5)).all()
    assert p.nbytes == x.numel() + 4


def test_qsgd_bound_and_unbiased():
    x = sample(200)
    c = QSGD(levels=4, seed=1)
    p, d = roundtrip(c, x)
    assert ((x - d).abs() <= x.norm() / 4 * (1 + 1e-5)).all()
    assert p.nbytes == x.numel() + 4
    mean = torch.stack([c.decode(c.encode(x)) for _ in range(3000)]).mean(0)
    assert (mean - x).abs().max() < 0.1 * x.norm() / 4  # unbiased: E[d] = x


def test_topk_keeps_largest():
    x = sample()
    c = TopK(0.05)
    p, d = roundtrip(c, x)
    k = math.ceil(0.05 * x.numel())
    kept = d != 0
    assert kept.sum() == k and p.nbytes == 8 * k
    assert torch.equal(d[kept], x[kept])
    assert x.abs()[~kept].max() <= x.abs()[kept].min()
    assert (x - d).norm() ** 2 <= (1 - k / x.numel()) * x.norm() ** 2 + 1e-9


def test_topk_compact_gap_codes_bridge_long_gaps():
    n = 300_000  # > 4 x 65535: positions need fillers
    x = torch.zeros(n)
    where = torch.tensor([0, 1, 65535, 65536, 200_000, 262_141, n - 1])
    x[where] = torch.arange(1.0, 8.0) * torch.tensor([1, -1, 1, -1, 1, -1, 1])
    x += torch.randn(n) * 1e-6
    c = TopK(len(where) / n, compact=True)
    p, d = roundtrip(c, x)
    assert torch.equal(torch.nonzero(d).flatten(), where)
    assert torch.allclose(d[where], x[where], rtol=2 ** -11)
    assert p.nbytes == 4 * (len(where) + (n - 1) // 65535)  # fp16 value + int16 gap, fixed size
    buf = p.pack()
    assert torch.equal(c.decode(unpack(buf, c.layout(n, p.nbytes), n)), d)


def test_topk_compact_matches_plain_selection_at_half_the_bytes():
    x = sample(5000)
    plain_p, plain = roundtrip(TopK(0.02), x)
    compact_p, compact = roundtrip(TopK(0.02, compact=True), x)
    assert torch.equal(plain != 0, compact != 0)
    assert torch.allclose(compact, plain, rtol=2 ** -11, atol=0)
    assert compact_p.nbytes == plain_p.nbytes // 2


def test_topk_dgc_warmup_density():
    c = TopK(0.001, warmup_steps=8)
    densities = []
    for _ in range(10):
        densities.append(c.density())
        c.encode(sample())
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]


def test_randk_shared_indices_and_bound():
    x = sample()
    a, b = RandomK(0.1, seed=3), RandomK(0.1, seed=3)
    pa, pb = a.encode(x), b.encode(x * 2)
    assert torch.equal(pa.ctx, pb.ctx)  # two devices draw the same coordinates
    assert pa.nbytes == 4 * math.ceil(0.1 * x.numel())
    d = a.decode(pa)
    assert torch.equal(d[pa.ctx], x[pa.ctx]) and d.count_nonzero() <= pa.ctx.numel()
    assert not torch.equal(a.encode(x).ctx, pa.ctx)  # a new draw at the next call


def test_scaled_sign_error_identity():
    x = sample(1001)
    p, d = roundtrip(ScaledSign(), x)
    assert p.nbytes == 4 + (1001 + 7) // 8
    expected = x.norm() ** 2 - x.abs().sum() ** 2 / x.numel()
    assert torch.isclose((x - d).norm() ** 2, expected, rtol=1e-4)
    assert torch.equal(d.sign(), torch.where(x >= 0, 1.0, -1.0))


def test_majority_vote():
    c = MajorityVote()
    xs = [torch.tensor([1.0, -1.0, 2.0, -3.0]), torch.tensor([1.0, 1.0, -2.0, -1.0]),
          torch.tensor([-1.0, 1.0, 2.0, -2.0])]
    combined = c.combine([c.decode(c.encode(x)) for x in xs])
    scale = sum(x.abs().mean() for x in xs) / 3
    assert torch.allclose(combined, torch.tensor([1.0, 1.0, 1.0, -1.0]) * scale)


def test_threshold_sends_crossing_entries_as_sign_and_index():
    x = torch.tensor([0.5, -0.05, -0.3, 0.2, 0.0, -0.21])
    c = Threshold(0.2)
    p, d = roundtrip(c, x)
    # crossed: 0.5, 0.2 (mean 0.35) and -0.3, -0.21 (mean 0.255); the rest stays behind
    assert torch.allclose(d, torch.tensor([0.35, 0.0, -0.255, 0.35, 0.0, -0.255]))
    assert p.nbytes == 8 + 4 * 4  # two magnitudes, then one 32-bit word (index and sign) per entry sent
    assert torch.equal(c.decode(unpack(p.pack(), c.layout(6, p.nbytes), 6)), d)
    assert c.decode(c.encode(torch.full((5,), 0.1))).count_nonzero() == 0


def test_threshold_higher_on_poorer_links():
    lan, wifi, lte = (link_threshold(0.001, get_link(n)) for n in ("lan-1g", "wifi-20m", "lte-10m"))
    assert lan == pytest.approx(0.001) and lan < wifi < lte
    assert lte == pytest.approx(0.01)


@pytest.mark.parametrize("make", [lambda: TopK(0.01), lambda: TopK(0.01, compact=True), lambda: RandomK(0.02),
                                  ScaledSign, lambda: Threshold(0.05), Int8, lambda: TopK(0.05, bits=2),
                                  lambda: LowBit(4), lambda: LowBit(2)])
def test_error_feedback_loses_nothing(make):
    c, memory = make(), ResidualMemory()
    inputs, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
    for step in range(30):
        x = sample(500, seed=step)
        inputs += x
        compensated = memory.compensate(x)
        d = c.decode(c.encode(compensated))
        memory.update(compensated, d)
        sent += d
    assert torch.allclose(sent + memory.residuals[0].double(), inputs, atol=1e-5)


def test_dgc_memory_momentum_correction():
    c, memory = TopK(0.1), DGCMemory(momentum=0.5)
    u = torch.zeros(100)
    v = torch.zeros(100)
    for step in range(5):
        g = sample(100, seed=step)
        u = 0.5 * u + g
        v = v + u
        compensated = memory.compensate(g)
        assert torch.allclose(compensated, v)
        d = c.decode(c.encode(compensated))
        memory.update(compensated, d)
        mask = d != 0
        u[mask] = 0
        v[mask] = 0


def test_pack_unpack_roundtrip():
    for c in (Int8(), TopK(0.1), ScaledSign(), QSGD(8), TopK(0.1, bits=2), TopK(0.1, bits=3), LowBit(4), LowBit(3)):
        x = sample(333)
        p = c.encode(x)
        buf = p.pack()
        assert buf.dtype == torch.uint8 and buf.numel() == p.nbytes
        assert torch.equal(c.decode(unpack(buf, c.layout(333, p.nbytes), 333)), c.decode(p))


@pytest.mark.parametrize("spec, message", [
    ("topk:0", "fraction in (0, 1]"), ("topk:2", "fraction in (0, 1]"), ("topk", "needs the fraction"),
    ("randk:-1", "fraction"), ("zip", "unknown compression"), ("topk:0.01:foo", "unknown option"),
    ("qsgd:500", "levels"), ("quant:1", "from 2 to 8"), ("topk:0.01:bits=9", "from 1 to 8"),
    ("topk:0.01:bits=2:compact", "drop :compact"), ("fp16:3", "takes no number"), ("topk:0.01:momentum=0.9", "add :dgc"),
])
def test_bad_compress_specs(spec, message):
    with pytest.raises(EdgetrainError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_compress(spec)


def test_good_compress_specs():
    assert parse_compress("topk:0.01:dgc:warmup=100").options == {"dgc": True, "warmup": 100.0}
    assert parse_compress("topk:0.005:compact").options == {"compact": True}
    assert parse_compress(None).method == "none" and parse_compress("fp32").method == "none"
    assert parse_compress("powersgd:4").arg == 4


# -- per-tensor (segment) behaviour: a DDP bucket holds several layers end to end --------
SEGMENTS = (300, 7, 693)


def layered() -> torch.Tensor:
    x = sample()
    x[300:307] = torch.tensor([1.0, -2.0, 1.5, -1.2, 3.0, 1.1, -1.3])  # a layer of far larger entries (a bias)
    return x


def test_per_layer_scales_for_sign_int8_qsgd():
    x = layered()
    parts = torch.split(x, SEGMENTS)
    p = ScaledSign().encode(x, segments=SEGMENTS)
    d = ScaledSign().decode(p)
    assert p.nbytes == 4 * 3 + (1000 + 7) // 8
    for xs, ds in zip(parts, torch.split(d, SEGMENTS)):
        assert torch.isclose((xs - ds).norm() ** 2, xs.norm() ** 2 - xs.abs().sum() ** 2 / xs.numel(), rtol=1e-4)
    p = Int8().encode(x, segments=SEGMENTS)
    d = Int8().decode(p)
    assert p.nbytes == 4 * 3 + 1000
    for xs, ds in zip(parts, torch.split(d, SEGMENTS)):
        assert ((xs - ds).abs() <= xs.abs().max() / 254 * (1 + 1e-5)).all()
    p = QSGD(8, seed=0).encode(x, segments=SEGMENTS)
    d = QSGD(8).decode(p)
    for xs, ds in zip(parts, torch.split(d, SEGMENTS)):
        assert ((xs - ds).abs() <= xs.norm() / 8 * (1 + 1e-5)).all()


def test_topk_global_and_layerwise():
    x = layered()
    d = TopK(0.01).decode(TopK(0.01).encode(x, segments=SEGMENTS))
    assert d.count_nonzero() == 10 and d[300:307].count_nonzero() == 7  # global: the large layer wins
    c = TopK(0.01, layerwise=True)
    p = c.encode(x, segments=SEGMENTS)
    d = c.decode(p)
    counts = [int(part.count_nonzero()) for part in torch.split(d, SEGMENTS)]
    assert counts == [3, 1, 7] and p.nbytes == 8 * 11  # ceil(1% of each layer)


def test_threshold_mean_is_per_layer_and_sign():
    x = torch.tensor([0.3, -0.5, 0.01, 5.0, -2.0, 3.0])
    c = Threshold(0.2)
    p = c.encode(x, segments=(3, 3))
    d = c.decode(unpack(p.pack(), c.layout(6, p.nbytes, (3, 3)), 6, (3, 3)))
    assert torch.allclose(d, torch.tensor([0.3, -0.5, 0.0, 4.0, -2.0, 4.0]))
    assert p.nbytes == 4 * 4 + 4 * 5
    strom = Threshold(0.2, decode_to="strom")
    assert torch.allclose(strom.decode(strom.encode(x, segments=(3, 3))),
                          torch.tensor([0.2, -0.2, 0.0, 0.2, -0.2, 0.2]))


@pytest.mark.parametrize("make", [lambda: TopK(0.02, layerwise=True), ScaledSign, lambda: Threshold(0.05),
                                  Int8])
def test_error_feedback_loses_nothing_with_layers(make):
    c, memory = make(), ResidualMemory()
    inputs, sent = torch.zeros(1000, dtype=torch.float64), torch.zeros(1000, dtype=torch.float64)
    for step in range(20):
        x = layered() * (step + 1) / 10
        inputs += x
        compensated = memory.compensate(x)
        d = c.decode(c.encode(compensated, segments=SEGMENTS))
        memory.update(compensated, d)
        sent += d
    assert torch.allclose(sent + memory.residuals[0].double(), inputs, atol=1e-4)


@pytest.mark.parametrize("make_memory", [ResidualMemory, lambda: DGCMemory(momentum=0.9)])
def test_memory_follows_named_parts_whatever_their_order(make_memory):
    """Fed the same tensors in a new order at every step, a memory sends each tensor what it sends in a fixed order."""
    sizes = {"head": 40, "bias": 3, "conv": 57}
    orders = [("head", "bias", "conv"), ("conv", "bias", "head"), ("bias", "head", "conv"), ("conv", "head", "bias")]
    fixed, moving, c = make_memory(), make_memory(), TopK(0.05)

    def step(memory, order, grads):
        parts = tuple((name, sizes[name]) for name in order)
        x = torch.cat([grads[name] for name in order])
        compensated = memory.compensate(x, parts=parts)
        d = c.decode(c.encode(compensated))
        memory.update(compensated, d, parts=parts)
        return dict(zip(order, d.split([sizes[name] for name in order])))

    for i in range(12):
        grads = {name: sample(n, seed=10 * i + j) for j, (name, n) in enumerate(sizes.items())}
        want = step(fixed, orders[0], grads)
        got = step(moving, orders[i % len(orders)], grads)
        for name in sizes:
            assert torch.equal(got[name], want[name]), f"step {i}: {name} differs"


def test_compression_benchmark_help_lists_methods():
    """``benchmarks/compression.py --help`` crashed: argparse formats help with %, and one method is "randk-1%"."""
    import subprocess
    import sys

    from edgetrain_testing import REPO

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compression.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-500:]
    assert "randk-1%" in done.stdout


def test_topk_warmup_of_buckets_made_after_step_0_follows_the_same_schedule():
    """Step 0 in one bucket, then three (as DDP rebuilds them): every bucket at the density of the step."""
    c, reference = TopK(0.001, warmup_steps=8), TopK(0.001, warmup_steps=8)
    for step in range(10):
        want = reference.density()
        reference.encode(sample())
        for key in ([0] if step == 0 else [0, 1, 2]):
            kept = c.encode(sample(), key).tensors[0].numel()
            assert kept == math.ceil(want * 1000), f"step {step}, bucket {key}: kept {kept}"


def test_topk_with_bits_keeps_the_selection_signs_and_group_means():
    x = sample(70_000)
    plain, coded = TopK(0.01), TopK(0.01, bits=2)
    d, p = coded.decode(coded.encode(x)), coded.encode(x)
    kept = plain.decode(plain.encode(x)) != 0
    assert torch.equal(d != 0, kept) and torch.equal(d[kept].sign(), x[kept].sign())
    # two magnitude groups of equal count, each decoded to its mean magnitude
    mags = x[kept].abs().sort().values
    half = len(mags) // 2
    means = [mags[:half].mean().item(), mags[half:].mean().item()]
    assert sorted(d[kept].abs().unique().tolist()) == pytest.approx(means)
    # 2 fp32 group means, a 16-bit gap and 2 bits of value per slot: 700 entries and the one gap filler that
    # 70,000 positions may need (compact's fixed size)
    slots = 700 + 1
    assert p.nbytes == 2 * 4 + 2 * slots + math.ceil(2 * slots / 8)


def test_lowbit_bound_and_packed_size():
    x = layered()
    for bits in (2, 4, 8):
        c = LowBit(bits)
        p = c.encode(x, segments=SEGMENTS)
        d = c.decode(p)
        assert p.nbytes == 4 * len(SEGMENTS) + math.ceil(len(x) * bits / 8)
        for part, dpart in zip(torch.split(x, SEGMENTS), torch.split(d, SEGMENTS)):
            levels = 2 ** (bits - 1) - 1
            assert (part - dpart).abs().max() <= part.abs().max() / (2 * levels) + 1e-6

"""The split planner (pipelining/split.py): memory limits respected, slow devices get less, clear refusals."""
import pytest
from torch import nn

from edgetrain.cluster.profiles import BUILTIN_PROFILES
from edgetrain.errors import EdgetrainError
from edgetrain.models import build_model
from edgetrain.plan.costs import count_activation_bytes, count_flops
from edgetrain.pipelining.split import MIB, LayerCost, PipelineStep, StageDevice, layer_costs, plan_split
from edgetrain.pipelining.stages import pipeline_layers


def _layers(count, flops=1e9, param_mib=10.0, activation_kib=0.0):
    return [LayerCost(f"layer{i}", flops, int(param_mib * MIB), 0, activation_kib * 1024, 4096.0)
            for i in range(count)]


def _sizes(plan):
    return [end - first for first, end in plan.bounds]


def test_a_slow_device_gets_fewer_layers_and_the_split_beats_an_even_one():
    devices = [StageDevice("fast", 40.0), StageDevice("slow", 10.0)]
    plan = plan_split(_layers(10), devices, PipelineStep(batch=32, microbatches=4))
    assert _sizes(plan) == [8, 2]  # 4x the speed, 4x the layers: both stages take 6.4 s
    assert plan.stage_s == pytest.approx([8 * 32e9 / 40e9, 2 * 32e9 / 10e9])
    assert plan.even_step_s == pytest.approx(5 * 32e9 / 10e9) and plan.even_step_s / plan.step_s == pytest.approx(2.5)
    assert "bottleneck" in plan.explain()[-1] and "2.50x" in plan.explain()[-1]


def test_every_stage_fits_its_devices_memory_even_when_speed_would_want_otherwise():
    # The fast device would take 8 of 10 layers, but 4 layers' weights, gradients and momentum
    # (3 x 10 MiB each), one more gradient being accumulated (4 micro-batches) and 100 MiB fixed fill its 230 MiB.
    devices = [StageDevice("fast-small", 40.0, memory_mb=230), StageDevice("slow-big", 10.0, memory_mb=4096)]
    plan = plan_split(_layers(10), devices, PipelineStep(batch=32, microbatches=4, optimizer_copies=1, fixed_mb=100))
    assert _sizes(plan) == [4, 6]
    for memory, device in zip(plan.memory_mb, devices):
        assert memory <= device.memory_mb
    assert plan.memory_mb[0] == pytest.approx(100 + 4 * 30 + 10)


def test_1f1b_holds_fewer_micro_batches_on_early_stages_than_gpipe():
    # 1 MiB saved per sample per layer; 1 MiB of weights (3 MiB with gradients and momentum), + 1 accumulating
    layers = _layers(4, param_mib=1.0, activation_kib=1024.0)
    devices = [StageDevice("a", 10.0), StageDevice("b", 10.0)]
    gpipe = plan_split(layers, devices, PipelineStep(batch=64, microbatches=8, schedule="gpipe"))
    one_f_one_b = plan_split(layers, devices, PipelineStep(batch=64, microbatches=8, schedule="1f1b"))
    assert gpipe.memory_mb == pytest.approx([7 + 2 * 64, 7 + 2 * 64])
    assert one_f_one_b.memory_mb == pytest.approx([7 + 2 * 2 * 8, 7 + 2 * 1 * 8])  # min(M, S - s) micro-batches of 8


def test_a_model_that_does_not_fit_even_pooled_says_what_it_needs_and_what_the_cluster_has():
    devices = [StageDevice(f"speaker{i}", 10.0, memory_mb=100) for i in range(3)]
    with pytest.raises(EdgetrainError, match=r"does not fit these 3 devices even pooled: its stages need about "
                                             r"400 MiB .* the devices have 300 MiB"):
        plan_split(_layers(12), devices, PipelineStep(batch=8, microbatches=2, fixed_mb=10))


def test_a_layer_too_big_for_any_device_is_named():
    # 200 MiB of weights, as much of gradients and of momentum, and one more gradient while accumulating
    layers = _layers(4)
    layers[2] = LayerCost("huge.embedding", 1e9, 200 * MIB, 0, 0.0, 4096.0)
    with pytest.raises(EdgetrainError, match=r"layer 2 \(huge.embedding\) .* alone needs 800 MiB .* largest device's 512"):
        plan_split(layers, [StageDevice("zero2w", 5.0, 512), StageDevice("zero2w", 5.0, 512)], PipelineStep(batch=8, microbatches=2))


def test_counted_layer_costs_add_up_to_the_whole_models():
    model = build_model("small_cnn", 1, 10)
    costs = layer_costs(pipeline_layers(model), (1, 8, 8))
    assert [c.name for c in costs][-1] == "classifier"
    assert sum(c.train_flops for c in costs) == count_flops(model, (1, 8, 8), 10)[0]
    # The whole-model count also holds the loss's few saved bytes.
    assert sum(c.activation_bytes for c in costs) == pytest.approx(count_activation_bytes(model, (1, 8, 8), 10),
                                                                    abs=64)
    assert sum(c.param_bytes for c in costs) == 4 * sum(p.numel() for p in model.parameters())


def test_on_the_small_device_profiles_pi_zeros_get_fewer_layers_and_stay_under_512_mib():
    profiles = [BUILTIN_PROFILES[name] for name in ("rpi5", "rpi-zero-2w", "rpi5", "rpi-zero-2w")]
    devices = [StageDevice(p.name, p.gflops, p.memory_mb) for p in profiles]
    plan = plan_split(_layers(24, activation_kib=64.0), devices, PipelineStep(batch=64, microbatches=8, schedule="1f1b",
                      fixed_mb=300))
    sizes = _sizes(plan)
    assert sizes[1] < sizes[0] and sizes[3] < sizes[2]
    assert all(memory <= device.memory_mb for memory, device in zip(plan.memory_mb, devices))


def test_no_stage_is_left_without_parameters_to_train():
    # weights, activation, weights, activation: a very slow device would rather take one activation alone
    layers = [LayerCost(f"layer{i}", 1e9, int(MIB) if i % 2 == 0 else 0, 0, 0.0, 4096.0) for i in range(4)]
    plan = plan_split(layers, [StageDevice("fast", 100.0), StageDevice("slow", 0.1)], PipelineStep(batch=8, microbatches=2))
    assert plan.bounds == [(0, 2), (2, 4)]


def test_a_cut_over_a_slow_link_moves_to_where_the_activations_are_small():
    # six equal layers; layer 1's output is 1 KiB per sample, every other one 1 MiB
    layers = [LayerCost(f"layer{i}", 1e9, MIB, 0, 0.0, 1024.0 if i == 1 else float(MIB)) for i in range(6)]
    devices = [StageDevice("a", 10.0), StageDevice("b", 10.0)]
    assert plan_split(layers, devices, PipelineStep(batch=32, microbatches=4)).bounds == [(0, 3), (3, 6)]  # no link: balanced
    slow = plan_split(layers, devices, PipelineStep(batch=32, microbatches=4), transfer_s=lambda s, nbytes: 0.01 + nbytes / 1e6)
    assert slow.bounds == [(0, 2), (2, 6)]
    # 4 micro-batches of 8 samples, an activation forward and a gradient back each: 8 transfers of 8 KiB
    assert slow.cut_s == pytest.approx([8 * (0.01 + 8 * 1024 / 1e6)])
    assert slow.step_s == pytest.approx(4 * 32e9 / 10e9)  # the 4-layer stage; cutting after layer 2 would cost 67 s
    assert "link to the next" in slow.explain()[0]


def test_an_element_wise_layer_on_large_maps_costs_its_memory_traffic_not_its_flops():
    layers = layer_costs([("conv", nn.Conv2d(3, 16, 3, padding=1)), ("bn", nn.BatchNorm2d(16)), ("relu", nn.ReLU())],
                         (3, 32, 32))
    relu, maps = layers[2], 16 * 32 * 32 * 4  # bytes of one sample's 16 x 32 x 32 float map
    # counted by hand: forward reads x and writes y; backward reads the gradient and y and writes x's gradient
    assert relu.train_flops == 0 and relu.traffic_bytes == 5 * maps and relu.pass_traffic_bytes == 0
    assert layers[1].traffic_bytes == 5 * maps  # BatchNorm too: no FLOPs counted, five maps moved
    compute_only = plan_split(layers, [StageDevice("zero", 10.3)], PipelineStep(batch=64, microbatches=4))
    roofline = plan_split(layers, [StageDevice("zero", 10.3, memory_gbps=3.6)], PipelineStep(batch=64, microbatches=4))
    conv_s = layers[0].train_flops * 64 / 10.3e9
    assert compute_only.stage_s[0] == pytest.approx(conv_s)
    # conv stays compute-bound; BatchNorm and ReLU each take 5 maps x 64 samples (+ BatchNorm's weights per pass)
    # at 3.6 GB/s
    elementwise_s = (2 * 5 * maps * 64 + 4 * layers[1].pass_traffic_bytes) / 3.6e9
    assert roofline.stage_s[0] == pytest.approx(conv_s + elementwise_s)
    assert roofline.stage_s[0] > 2 * compute_only.stage_s[0]


def test_when_the_link_bounds_the_step_the_stages_still_balance_behind_it():
    # every cut carries the same 1 MiB per sample, so every split's link time ties; the fast device gets more
    layers = [LayerCost(f"layer{i}", 1e9, MIB, 0, 0.0, float(MIB)) for i in range(10)]
    devices = [StageDevice("fast", 40.0), StageDevice("slow", 10.0)]
    plan = plan_split(layers, devices, PipelineStep(batch=32, microbatches=4), transfer_s=lambda s, nbytes: 1.0 + nbytes / 1e6)
    assert plan.step_s == plan.cut_s[0] > max(plan.stage_s)
    assert _sizes(plan) == [8, 2]  # as without the link: 4x the speed, 4x the layers


def test_only_micro_batches_after_the_first_accumulate_a_gradient():
    layers, device = _layers(2), [StageDevice("a", 10.0)]
    assert plan_split(layers, device, PipelineStep(batch=8, microbatches=1)).memory_mb == pytest.approx([2 * 30])
    assert plan_split(layers, device, PipelineStep(batch=8, microbatches=2)).memory_mb == pytest.approx([2 * 30 + 10])

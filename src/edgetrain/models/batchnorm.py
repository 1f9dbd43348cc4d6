"""BatchNorm whose statistics span several devices.

PyTorch's ``nn.SyncBatchNorm`` refuses CPU tensors, and edge devices have no
GPU, so edgetrain carries its own. The statistics travel in one all-reduce per
layer (latency is what hurts on edge links), computed around a shift that every
device shares (the running mean) so that the one-pass variance does not lose
precision. The all-reduce is differentiable (``AllReduceSum``): its backward sums the
gradient of the statistics over devices, which is exactly the gradient
single-device BatchNorm would give.

The same moments serve the spatially tiled layers (``edgetrain.tiling``),
where each device holds a tile of the feature map instead of a slice of the
batch.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn


class AllReduceSum(torch.autograd.Function):
    """Sum over the devices of ``group``; the gradient of a sum is the sum of the gradients.

    (``torch.distributed.nn.functional.all_reduce`` does the same and is deprecated in torch 2.13.)
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group=None) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def cross_device_moments(x: torch.Tensor, group=None, shift: torch.Tensor | None = None,
                         dims: tuple[int, ...] = (0, 2, 3)):
    """Mean and biased variance per channel over ``dims`` of ``x`` on every device of ``group``.

    Returns ``(mean, var, count)``; differentiable with respect to ``x``.
    """
    channels = x.shape[1]
    shape = [1] * x.dim()
    shape[1] = channels
    k = x.new_zeros(channels) if shift is None else shift.detach().to(x.dtype)
    xs = x - k.view(shape)
    count = x.new_tensor([x.numel() / channels])
    packed = torch.cat([xs.sum(dims), (xs * xs).sum(dims), count])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        packed = AllReduceSum.apply(packed, group)
    s1, s2, n = packed[:channels], packed[channels:2 * channels], packed[-1]
    mean_shifted = s1 / n
    var = (s2 / n - mean_shifted * mean_shifted).clamp_min(0)
    return mean_shifted + k, var, n


class CrossDeviceBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with batch statistics over the whole process group in training.

    In eval mode, or with a single device, it is plain ``nn.BatchNorm2d``.
    """

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1
        if not (self.training and distributed):
            return super().forward(x)
        shift = self.running_mean if self.track_running_stats else None
        mean, var, n = cross_device_moments(x, self.group, shift)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                unbiased = var.detach() * (n / (n - 1)).clamp_min(0)
                self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        shape = (1, -1, 1, 1)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_batchnorm(module: nn.Module, group=None) -> nn.Module:
    """Replace every ``nn.BatchNorm2d`` in ``module`` by a ``CrossDeviceBatchNorm2d`` sharing its state."""
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, CrossDeviceBatchNorm2d):
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        # on the module's device: a model still on the meta device (models/init.py) stays without storage
        new = CrossDeviceBatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                                     module.track_running_stats, group=group, device=own[0].device if own else None)
        if module.running_mean is not None:
            new.to(module.running_mean.dtype)
        elif module.weight is not None:
            new.to(module.weight.dtype)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_batchnorm(child, group))
    return module


def local_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` itself, or, where it holds ``CrossDeviceBatchNorm2d`` layers, a copy with plain ``nn.BatchNorm2d``
    in their place and their state: the same compute on this device's batch alone, without a collective (the
    throttle's reference pass runs on one device while the others wait)."""
    if not any(isinstance(m, CrossDeviceBatchNorm2d) for m in module.modules()):
        return module

    def plain(layer: nn.Module) -> nn.Module:
        if not isinstance(layer, CrossDeviceBatchNorm2d):
            for name, child in layer.named_children():
                setattr(layer, name, plain(child))
            return layer
        state = next(iter(layer.state_dict().values()), None)
        new = nn.BatchNorm2d(layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats,
                             device=None if state is None else state.device)
        new.load_state_dict(layer.state_dict())
        new.to(layer.running_mean.dtype if layer.running_mean is not None else layer.weight.dtype)
        return new.train(layer.training)

    return plain(copy.deepcopy(module))

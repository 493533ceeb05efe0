"""Your own training loop with stabletrain's pieces, without the built-in loop.

    python examples/own_loop.py
"""

import torch
from torch import nn

from stabletrain import AccumulationWindow, GradClipper, LRSchedule, PrecisionPolicy, StepMetrics, as_sum_count, grad_norms

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
params = list(model.parameters())
optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)  # fused: skips bad steps on the device

precision = PrecisionPolicy("auto", device)          # bf16 on a recent GPU, fp32 on CPU
schedule = LRSchedule(optimizer, warmup_steps=10, max_steps=100)  # held on skipped steps
clipper = GradClipper(max_norm=1.0)
window = AccumulationWindow(params)
metrics = StepMetrics(capacity=20, num_params=len(params), device=device)
w = torch.randn(16, 1, device=device)

for step in range(1, 101):
    optimizer.zero_grad(set_to_none=True)
    window.begin()
    micro_batches = [torch.randn(n, 16, device=device) for n in (8, 8, 8, 5)]  # a short tail is fine
    for i, x in enumerate(micro_batches):
        with precision.autocast():
            loss = nn.functional.mse_loss(model(x).float(), x @ w)
        loss_sum, count = as_sum_count(loss, len(x))
        precision.backward(window.normalize(loss_sum, count, last=i == len(micro_batches) - 1))
    precision.unscale_(optimizer)                     # true grads before measuring and clipping
    norm, per_param = grad_norms(params)              # device tensors, no sync
    finite = torch.isfinite(norm) & torch.isfinite(window.mean_loss)
    clipped = clipper.clip_(params, norm, finite)
    applied = precision.step(optimizer, finite)
    schedule.step(applied)
    metrics.update(step, loss=window.mean_loss, grad_norm=norm, post_clip_norm=clipper.post_clip_norm(norm),
                   clipped=clipped, applied=applied, finite=finite, lr=schedule.lr(), loss_scale=precision.loss_scale(),
                   count=window.global_count, per_param_norms=per_param, num_samples=29)
    if step % 20 == 0:
        summary, rows, _ = metrics.reduce()           # the one host sync of the interval
        print(f"step {step}: loss {summary['loss']:.4f}  grad_norm {summary['grad_norm']:.3f}  "
              f"clip_rate {summary['clip_rate']:.2f}  lr {summary['lr']:.2e}  skipped {summary['num_skipped']}")

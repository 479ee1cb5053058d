"""The roofline's two numbers: the memory bandwidth measured by a device copy, and the weight
bytes one batch-1 step reads. (Step timing is the engine's own: `engine/calibrate.py`.)"""

from __future__ import annotations

import torch

from metrale.engine.calibrate import median_time


def bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (bytes read plus bytes written)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / median_time(lambda: dst.copy_(src), device, reps=10)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 step reads: every weight once (tied ones once), except that
    a sparse MoE block's routed experts count only `num_experts_per_tok` of `num_experts`."""
    hybrid = getattr(getattr(model, "config", None), "hybrid", None)
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        size = p.numel() * p.element_size()
        if hybrid is not None and ".experts." in name + "." and hybrid.num_experts:
            size = size * hybrid.num_experts_per_tok // hybrid.num_experts
        total += size
    return total

"""The anchor: a plain graph-captured PyTorch decode step of the same model (the gpt-fast way),
timed in the same process, so `metrale bench` can say how far its decode step is from what plain
PyTorch reaches on this device.

The anchor reads the engine's own weights (the same bytes) and keeps a static contiguous KV
cache [layers, batch, kv heads, context + 1, head dim]; every sequence is at the same position, so
attention is one `scaled_dot_product_attention` over the whole cache, no mask and no paging. One
decode step (embedding, the layers with torch's RMSNorm, rotary, SDPA with grouped heads, SwiGLU,
the final norm, float32 logits and their argmax) is captured once per batch size as a CUDA graph
and replayed. Dense Qwen3 targets on CUDA only; its output is not used, only its time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.engine.calibrate import median_time, sync


class StaticCacheDecode:
    """One captured decode step of `batch` sequences with `context` cached tokens each."""

    def __init__(self, model, batch: int, context: int, capture: bool = True) -> None:
        """`capture=False`: no graph (CPU tests call `_step` directly)."""
        cfg, inner = model.config, model.model
        self.model, self.inner = model, inner
        dev, dtype = model.head_weight.device, model.head_weight.dtype
        layers = len(inner.layers)
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        shape = (layers, batch, self.kv_heads, context + 1, self.head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device=dev) * 0.1
        self.v_cache = torch.randn(shape, dtype=dtype, device=dev) * 0.1
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.full((1,), context, dtype=torch.long, device=dev)
        self.batch = batch
        if not capture:
            return
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self._step()  # warm-up outside the capture
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        rotary = self.inner.rotary
        cos = rotary.cos[self.pos].to(x.dtype)  # [1, D/2]
        sin = rotary.sin[self.pos].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _step(self) -> torch.Tensor:
        b, hq, hkv, d = self.batch, self.heads, self.kv_heads, self.head_dim
        x = self.inner.embed_tokens(self.ids)  # [B, H]
        for i, layer in enumerate(self.inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            h = F.rms_norm(x, (x.shape[-1],), ln1.weight, ln1.eps)
            q, k, v = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias).split(
                [hq * d, hkv * d, hkv * d], dim=-1
            )
            q = F.rms_norm(q.view(b, hq, d), (d,), attn.q_norm.weight, attn.q_norm.eps)
            k = F.rms_norm(k.view(b, hkv, d), (d,), attn.k_norm.weight, attn.k_norm.eps)
            q, k = self._rope(q), self._rope(k)
            self.k_cache[i].index_copy_(2, self.pos, k.unsqueeze(2))
            self.v_cache[i].index_copy_(2, self.pos, v.view(b, hkv, 1, d))
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), self.k_cache[i], self.v_cache[i], enable_gqa=True
            )  # [B, Hq, 1, D]
            x = x + F.linear(o.reshape(b, hq * d), attn.o_proj.weight, attn.o_proj.bias)
            h = F.rms_norm(x, (x.shape[-1],), ln2.weight, ln2.eps)
            gate, up = F.linear(h, mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        norm = self.inner.norm
        x = F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
        return F.linear(x, self.model.head_weight).float().argmax(dim=-1)

    def time(self) -> float:
        return median_time(self.graph.replay, self.k_cache.device, reps=20)


@torch.inference_mode()
def anchor_step_times(model, batch_sizes, context: int) -> dict[int, float] | None:
    """Seconds per anchor decode step at each batch size, or None where it does not apply (no
    CUDA, or a hybrid target)."""
    if not torch.cuda.is_available() or model.head_weight.device.type != "cuda":
        return None
    if getattr(model.config, "hybrid", None) is not None:
        return None
    out = {}
    for b in batch_sizes:
        anchor = StaticCacheDecode(model, b, context)
        out[b] = anchor.time()
        del anchor
        sync(model.head_weight.device)
        torch.cuda.empty_cache()
    return out

"""Triton kernels, one file per family: the fast paths that `models/` dispatches to on CUDA.

Each kernel names the torch reference in `models/` that it must equal (the CPU path and the tests'
oracle): `paged_attention` (decode/verify attention over KV pages), `fused` (residual add +
RMSNorm, QK-norm + rotary, SiLU * up, gated RMSNorm), `gdn_recurrent` (the gated delta rule per
row), `gdn_chunk` (its chunked WY form for prefill), `gdn_conv` (the causal conv window),
`gdn_fused` (a GDN layer's gates, padding and gated norm), `moe_routing` (router top-k, ending in
the grouped GEMMs' plan of `moe_plan`), `moe` (the grouped expert GEMMs and their combine) and
`next_attention` (Qwen3-Next's QK-norm + partial rotary and output gate); `dispatch` says when
the hybrid target's kernels run, `pdl` how the step's kernels launch on Hopper (programmatic
dependent launch). The tests run them under `TRITON_INTERPRET=1` on CPU.
"""

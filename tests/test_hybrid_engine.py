"""The engine on a hybrid (Qwen3-Next, Gated DeltaNet) target, on CPU in float32: greedy output
equals transformers', a batch equals each sequence alone (chunked prefill, preemption), and
speculative decoding is lossless with the recurrent state written on accept: outputs equal plain
decoding and the committed state equals the state plain decoding reaches."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.speculative.replay import ReplayDrafter
from metrale.speculative.verify_key import verify_graph_key
from tests.test_qwen3_next import TINY_NEXT, hf_next, randomize, transformers

PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(6 + 5 * i)] for i in range(5)]


def write_hybrid(path, tokenizer_dir, seed: int, **overrides):
    """A tiny random Qwen3-Next checkpoint (TINY_NEXT, vocabulary 320, `overrides`) in `path`,
    with the default model's tokenizer."""
    cfg = transformers.Qwen3NextConfig(**{**TINY_NEXT, "vocab_size": 320, **overrides})
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    randomize(hf, seed=seed)
    hf.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tokenizer_dir):
    return write_hybrid(tmp_path_factory.mktemp("hybrid"), tokenizer_dir, seed=3)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def llm_for(path, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", **kw)


def test_greedy_matches_transformers(hybrid_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=torch.float32).eval()
    out = llm_for(hybrid_dir).generate([PROMPTS[1]], greedy(24))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([PROMPTS[1]]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
        )
    assert out[0].outputs[0].token_ids == ref[0, len(PROMPTS[1]) :].tolist()


def test_batch_equals_alone_with_chunked_prefill_and_preemption(hybrid_dir):
    alone = [llm_for(hybrid_dir).generate([p], greedy(20))[0].outputs[0].token_ids for p in PROMPTS]
    tight = llm_for(hybrid_dir, page_size=4, num_kv_pages=20, max_num_batched_tokens=16)
    outs = tight.generate(PROMPTS, greedy(20))
    assert tight.engine.telemetry.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dcut", [False, True])
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_speculation_is_lossless_and_commits_the_accepted_state(hybrid_dir, alpha, dcut, variant):
    # Synchronous engines: the state each leaves in slot 0 is compared below, and a step run
    # ahead past a sequence's last token advances its slot's state by a thrown-away row (a
    # slot's next sequence starts from a fresh state: `engine/ahead.py`)
    sync = dict(async_scheduling=False)
    plain_llm = llm_for(hybrid_dir, **sync)
    plain = plain_llm.generate(PROMPTS, greedy(24))
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain, strict=True)}
    drafter = ReplayDrafter(truth, alpha, vocab_size=320, seed=7)
    # A small token budget mixes prefill chunks with verify rows in one step.
    spec_llm = llm_for(
        hybrid_dir,
        drafter=drafter,
        spec={"num_drafts": 3, "dcut": dcut},
        max_num_batched_tokens=24,
        hybrid_verify_state=variant,
        **sync,
    )
    spec = spec_llm.generate(PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    tel = spec_llm.engine.telemetry.spec
    if alpha == 1.0:
        assert tel.num_accepted_tokens == tel.num_draft_tokens > 0
    if alpha == 0.0:
        assert tel.num_accepted_tokens == 0 and tel.num_draft_tokens > 0
    # Verify keys carry the variant's sentinel (no WY tables in verify).
    woa = variant == "write_on_accept"
    assert tel.verify_keys and {key[-1] for key in tel.verify_keys} == {
        verify_graph_key([], wy_tables_null=True, write_on_accept=woa)[-1]
    }
    # Per-row slots hold K + 1 = 4 states per sequence, write-on-accept one (+ the dummy).
    seqs = spec_llm.engine.config.max_num_seqs
    assert spec_llm.engine.runner.states.pool.ssm[0].shape[0] == 1 + seqs * (1 if woa else 4)
    # One prompt alone in each engine: both end in slot 0 with the state after the same tokens.
    one = [PROMPTS[3]]
    assert plain_llm.generate(one, greedy(24))[0].outputs[0].token_ids == truth[tuple(one[0])]
    assert spec_llm.generate(one, greedy(24))[0].outputs[0].token_ids == truth[tuple(one[0])]
    for layer in range(3):
        ref_conv, ref_ssm = plain_llm.engine.runner.states.entry(0, layer)
        conv, ssm = spec_llm.engine.runner.states.entry(0, layer)
        torch.testing.assert_close(conv, ref_conv, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-5)


def test_ngram_speculation_is_lossless(hybrid_dir):
    prompts = [p * 3 for p in PROMPTS[:3]]  # repeats: the n-gram drafter finds matches
    plain = llm_for(hybrid_dir).generate(prompts, greedy(24))
    spec_llm = llm_for(hybrid_dir, spec={"method": "ngram", "num_drafts": 4})
    spec = spec_llm.generate(prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.telemetry.spec.num_draft_tokens > 0


@pytest.fixture(scope="module")
def hybrid_mtp_dir(hybrid_dir, tmp_path_factory):
    """The hybrid checkpoint plus a random MTP head in the Qwen3-Next layout: `mtp.fc`, its
    (1 + w) norms, and `mtp.layers.0`, a full-attention decoder layer with the sparse MoE (the
    tensors of transformers' own layer class)."""
    path = tmp_path_factory.mktemp("hybrid-mtp")
    for f in hybrid_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = transformers.AutoConfig.from_pretrained(hybrid_dir)
    full = cfg.layer_types.index("full_attention")
    layer = hf_next.Qwen3NextDecoderLayer(cfg, full)
    randomize(layer, seed=5)
    gen = torch.Generator().manual_seed(6)
    h = cfg.hidden_size
    tensors = {f"mtp.layers.0.{k}": v.contiguous() for k, v in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(h, generator=gen) * 0.1
    save_file(tensors, str(path / "mtp.safetensors"))
    return path


def test_mtp_speculation_on_a_hybrid_target_is_lossless(hybrid_mtp_dir):
    plain = llm_for(hybrid_mtp_dir).generate(PROMPTS, greedy(20))
    spec_llm = llm_for(hybrid_mtp_dir, spec={"method": "mtp", "num_drafts": 3})
    heads = spec_llm.engine.runner.mtp
    assert heads is not None and heads.depths[0].layer.layer_type == "full_attention"
    saved = load_file(str(hybrid_mtp_dir / "mtp.safetensors"))
    module = heads.depths[0]
    torch.testing.assert_close(module.fc.weight, saved["mtp.fc.weight"], rtol=0, atol=0)
    experts = module.layer.mlp.experts.down_proj
    torch.testing.assert_close(
        experts, saved["mtp.layers.0.mlp.experts.down_proj"].view_as(experts), rtol=0, atol=0
    )
    # The random head is never right: this pins the drafter's catch-up and chain on the hybrid
    # target (its KV, the target's hiddens); the accept path is pinned by the replay tests.
    spec = spec_llm.generate(PROMPTS, greedy(20))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine.telemetry.spec.num_draft_tokens > 0


@pytest.mark.gpu
def test_cuda_hybrid_mtp_speculation_equals_cpu(hybrid_mtp_dir):
    """On CUDA (float32, graphed target and MTP chain): the hybrid's MTP heads (a full-attention
    layer with the sparse MoE) speculate losslessly, as on the CPU."""
    cpu = llm_for(hybrid_mtp_dir).generate(PROMPTS, greedy(20))
    spec_llm = LLM(hybrid_mtp_dir, device="cuda", dtype="float32", spec={"method": "mtp"})
    spec = spec_llm.generate(PROMPTS, greedy(20))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in cpu]
    assert spec_llm.engine.telemetry.spec.num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("gdn_triton", [False, True])
@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_cuda_hybrid_speculation_equals_cpu(hybrid_dir, gdn_triton, variant, monkeypatch):
    """On CUDA (float32), with the torch delta rule or the Triton kernel, in both verify
    variants, graphed: plain and replayed speculative greedy outputs equal the CPU's."""
    from metrale.knobs import knobs

    monkeypatch.setenv("METRALE_NO_GDN_TRITON", "0" if gdn_triton else "1")
    knobs.cache_clear()
    try:
        cpu = llm_for(hybrid_dir).generate(PROMPTS, greedy(24))
        truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, cpu, strict=True)}
        plain = LLM(hybrid_dir, device="cuda", dtype="float32").generate(PROMPTS, greedy(24))
        drafter = ReplayDrafter(truth, 0.6, vocab_size=320)
        spec_llm = LLM(
            hybrid_dir,
            device="cuda",
            dtype="float32",
            drafter=drafter,
            spec={"num_drafts": 3},
            hybrid_verify_state=variant,
        )
        spec = spec_llm.generate(PROMPTS, greedy(24))
    finally:
        knobs.cache_clear()
    want = [o.outputs[0].token_ids for o in cpu]
    assert [o.outputs[0].token_ids for o in plain] == want
    assert [o.outputs[0].token_ids for o in spec] == want


@pytest.mark.parametrize("budget", [None, 8])  # 8: prefill and the state rebuild in chunks
def test_a_failure_mid_forward_ends_only_its_sequence_and_corrupts_no_state(
    hybrid_dir, budget, monkeypatch
):
    """A forward that raises after two GDN layers advanced their state (a NaN check, say): the
    failing sequence ends with an error, and the others, whose state those layers had already
    advanced, go on to exactly the output they have alone."""
    llm = llm_for(hybrid_dir, **({"max_num_batched_tokens": budget} if budget else {}))
    runner, layer = llm.engine.runner, llm.engine.runner.model.model.layers[2]
    real_execute, real_layer = runner.execute, layer.forward
    current: list = []

    def execute(batch, **kw):
        current[:] = [e.seq.request_id for e in batch.entries]
        return real_execute(batch, **kw)

    calls = iter(range(10**6))

    def failing_layer(*args, **kwargs):
        # Runs after layers 0 and 1 (GDN) wrote their new states; fails mid-generation (not at
        # the first prefill), and from then on whenever req-2 runs, batched or alone.
        if "req-2" in current and next(calls) >= 3:
            raise RuntimeError("NaN in layer 2")
        return real_layer(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(layer, "forward", failing_layer)
    outs = llm.generate(PROMPTS, greedy(16))
    monkeypatch.undo()
    assert outs[2].outputs[0].finish_reason == "error"
    assert "NaN in layer 2" in outs[2].outputs[0].error
    for i in (0, 1, 3, 4):
        alone = llm_for(hybrid_dir).generate([PROMPTS[i]], greedy(16))[0].outputs[0].token_ids
        assert outs[i].outputs[0].token_ids == alone, i
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_triton_state_kernels_in_the_engine_equal_the_torch_path(hybrid_dir, variant, monkeypatch):
    """The GDN state's Triton paths (recurrent, chunked and conv kernels on the pool, the
    write-on-accept commit) inside the engine, run by the Triton interpreter on CPU: speculative
    output equals plain torch decoding. (On the H200 the gpu tests above run them natively.)"""
    from metrale.kernels import gdn_recurrent
    from metrale.models import gdn_state

    if gdn_recurrent.triton is None or not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("needs Triton's interpreter")
    prompts = [p * 4 for p in PROMPTS[:3]]  # >16 rows: the chunked kernel's prefill
    plain = llm_for(hybrid_dir).generate(prompts, greedy(12))
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}
    monkeypatch.setattr(gdn_state, "triton_gdn_enabled", lambda x: True)
    spec_llm = llm_for(
        hybrid_dir,
        drafter=ReplayDrafter(truth, 0.6, vocab_size=320, seed=5),
        spec={"num_drafts": 3},
        hybrid_verify_state=variant,
    )
    spec = spec_llm.generate(prompts, greedy(12))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    tel = spec_llm.engine.telemetry.spec
    assert 0 < tel.num_accepted_tokens < tel.num_draft_tokens


def _states_by_position(llm, prompts, params, on_step=None) -> dict:
    """Run `prompts` step by step; after every step, each running sequence's committed state
    (every GDN layer's conv window and delta-rule state), keyed by (prompt, tokens computed)."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    seen: dict = {}
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.slot < 0 or seq.num_computed_tokens == 0:
                continue
            key = (tuple(seq.prompt_token_ids), seq.num_computed_tokens)
            layers = len(engine.runner.states.pool.ssm)
            seen[key] = [
                [t.clone() for t in engine.runner.states.entry(seq.slot, layer)]
                for layer in range(layers)
            ]
    return seen


@pytest.mark.parametrize("variant", ["write_on_accept", "per_row_slots"])
def test_committed_state_after_every_verify_equals_plain_decoding(hybrid_dir, variant):
    """After every step, with drafts accepted in part (alpha 0.5, D-Cut mixing depths) and
    preemptions, each sequence's committed state equals the state plain decoding reaches at the
    same position: rejected rows leave nothing behind, in either verify variant."""
    params = greedy(16)
    plain = _states_by_position(llm_for(hybrid_dir), PROMPTS, params)
    truth = {
        tuple(p): o.outputs[0].token_ids
        for p, o in zip(PROMPTS, llm_for(hybrid_dir).generate(PROMPTS, params), strict=True)
    }
    spec_llm = llm_for(
        hybrid_dir,
        drafter=ReplayDrafter(truth, 0.5, vocab_size=320, seed=11),
        spec={"num_drafts": 3},
        hybrid_verify_state=variant,
        page_size=4,
        num_kv_pages=24,
        max_num_batched_tokens=16,
    )
    spec = _states_by_position(spec_llm, PROMPTS, params)
    tel = spec_llm.engine.telemetry
    assert tel.preemptions > 0 and 0 < tel.spec.num_accepted_tokens < tel.spec.num_draft_tokens
    compared = [key for key in spec if key in plain]
    assert len(compared) > 30
    for key in compared:
        for (conv, ssm), (ref_conv, ref_ssm) in zip(spec[key], plain[key], strict=True):
            torch.testing.assert_close(conv, ref_conv, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "async_scheduling, error, where",
    [
        (False, KeyboardInterrupt, "layer"),  # Ctrl-C during a forward
        (True, KeyboardInterrupt, "layer"),
        (False, RuntimeError, "commit"),  # an error escaping the synchronous commit
    ],
)
def test_an_exception_escaping_a_step_leaves_the_others_state_right(
    hybrid_dir, async_scheduling, error, where
):
    """An exception that escapes `step()` after the forward ran (nothing rebuilds then) left
    the GDN state of the other live requests past their counters: their rows ran again on it
    and their output changed (found in review). They are now recomputed from their tokens."""
    params = greedy(16)
    want = llm_for(hybrid_dir).generate([PROMPTS[2]], params)[0].outputs[0].token_ids
    llm = llm_for(hybrid_dir, async_scheduling=async_scheduling, prefix_caching=False)
    armed = [False]
    if where == "layer":
        layer = llm.engine.runner.model.model.layers[1]  # after GDN layer 0 wrote its state
        real = layer.forward
        target, name = layer, "forward"
    else:
        real = llm.engine._commit
        target, name = llm.engine, "_commit"

    def hook(*args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise error("injected")
        return real(*args, **kwargs)

    setattr(target, name, hook)
    first, second = llm.stream(PROMPTS[1], params), llm.stream(PROMPTS[2], params)
    for _ in range(4):
        next(first)
        next(second)
    armed[0] = True
    with pytest.raises(error):
        while True:
            next(first)  # the step raises here; the first stream ends (aborted)
    got = None
    for out in second:  # the second request goes on
        got = out.outputs[0].token_ids
    assert got == want

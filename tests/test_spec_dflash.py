"""The DFlash block drafter: a tiny random drafter saved in the published layout loads and drafts;
speculative output equals plain output (greedy, seeded sampling, a batch of 16 with preemption),
on dense and hybrid targets; the drafter's context after a verify is exactly the committed rows'
features."""

from __future__ import annotations

import json
import os

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import ModelConfig, SpecConfig
from metrale.engine.kv_cache import DUMMY_PAGE
from metrale.knobs import knobs
from metrale.models.dflash import DFlashConfig, DFlashDraftModel, load_dflash, save_dflash
from tests.test_hybrid_engine import hybrid_dir  # noqa: F401

PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + (3 * i) % 11)] for i in range(16)]


def write_dflash(
    target_dir, path, block_size=4, layers=(0, 1), seed=0, num_layers=1, echo_mask=None
):
    """A random DFlash drafter for the target in `target_dir`, in the published layout.

    `echo_mask`: a drafter whose layers add nothing (o_proj and down_proj zero), with that token
    as its MASK: every draft is then argmax(head(norm(embed(MASK)))), which on a tied random
    model is the MASK token itself, so drafts are accepted wherever the target repeats it."""
    target = json.loads((target_dir / "config.json").read_text())
    tcfg = ModelConfig.from_hf(target_dir)
    cfg = DFlashConfig(
        hidden_size=tcfg.hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope=tcfg.rope,
        block_size=block_size,
        mask_token_id=tcfg.vocab_size - 1 if echo_mask is None else echo_mask,
        target_layer_ids=tuple(layers),
    )
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg, 64)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
            if echo_mask is not None and name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    return save_dflash(model, path, target)


@pytest.fixture(scope="module")
def dense_dflash(tiny_model_dir, tmp_path_factory):
    return write_dflash(tiny_model_dir, tmp_path_factory.mktemp("dflash") / "d")


def plain(model_dir, prompts, params, **kw):
    llm = LLM(model_dir, device="cpu", dtype="float32", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_published_layout_loads_with_its_names(tiny_model_dir, dense_dflash):
    from safetensors import safe_open

    with safe_open(dense_dflash / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.0.self_attn.k_norm.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    raw = json.loads((dense_dflash / "config.json").read_text())
    assert raw["dflash_config"]["target_layer_ids"] == [0, 1]
    tcfg = ModelConfig.from_hf(tiny_model_dir)
    model = load_dflash(dense_dflash, tcfg, 64, torch.device("cpu"), torch.float32)
    assert model.config.block_size == 4 and model.config.mask_token_id == tcfg.vocab_size - 1
    bad = json.loads((dense_dflash / "config.json").read_text())
    bad["dflash_config"]["target_layer_ids"] = [0, 7]
    (dense_dflash.parent / "bad").mkdir(exist_ok=True)
    (dense_dflash.parent / "bad" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="target_layer_ids"):
        load_dflash(dense_dflash.parent / "bad", tcfg, 64, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_greedy_output_equals_plain_alone_and_in_a_batch(tiny_model_dir, dense_dflash, num_drafts):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS, params)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": num_drafts}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == want[0]
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    tel = llm.engine.telemetry.spec
    assert tel.num_draft_tokens > 0  # it really drafted, and every verify was judged


def test_depth_defaults_to_the_drafters_block(tiny_model_dir, dense_dflash):
    """Without num_drafts DFlash verifies its block's B - 1 drafts (a block of 4: 3), as SGLang
    defaults it from the drafter's config; the other drafters' default, 4, is more than a block
    of 4 proposes, so `spec=dict(method="dflash")` was refused for such a drafter. Given
    explicitly, a depth past the block is still refused, naming the field."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS, params)
    spec = {"method": "dflash", "model": str(dense_dflash), "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    assert llm.engine.config.spec.num_drafts == llm.engine.spec.cfg.num_drafts == 3
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert len(llm.engine.telemetry.spec.drafted_per_pos) == 3  # verified 3 deep
    with pytest.raises(ValueError, match="spec.num_drafts=4"):
        LLM(tiny_model_dir, device="cpu", dtype="float32", spec={**spec, "num_drafts": 4})
    assert SpecConfig(method="ngram").num_drafts == SpecConfig(method="mtp").num_drafts == 4


def test_a_block_of_one_is_refused_by_its_block_size(tiny_model_dir, tmp_path):
    """A block of 1 holds no draft: refused naming the drafter's block_size, not a
    `num_drafts=1` the user never gave (found in review)."""
    path = write_dflash(tiny_model_dir, tmp_path / "d1", block_size=1)
    with pytest.raises(ValueError, match="block_size 1: it proposes no drafts"):
        LLM(tiny_model_dir, device="cpu", spec={"method": "dflash", "model": str(path)})


def test_a_batch_of_16_with_preemption(tiny_model_dir, dense_dflash):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS, params)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec, num_kv_pages=40)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.engine.telemetry.preemptions > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_seeded_sampling_equals_plain_seeded_sampling(tiny_model_dir, dense_dflash):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, ignore_eos=True, seed=i)
        for i in range(8)
    ]
    want = plain(tiny_model_dir, PROMPTS[:8], params)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3}
    assert plain(tiny_model_dir, PROMPTS[:8], params, spec=spec) == want


def test_hybrid_target(hybrid_dir, tmp_path):  # noqa: F811
    drafter = write_dflash(hybrid_dir, tmp_path / "d", layers=(1, 1))  # one layer read twice
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[t % 300 + 3 for t in p] for p in PROMPTS[:5]]
    want = plain(hybrid_dir, prompts, params)
    spec = {"method": "dflash", "model": str(drafter), "num_drafts": 3}
    assert plain(hybrid_dir, prompts, params, spec=spec) == want


def test_context_holds_exactly_the_committed_rows_features(tiny_model_dir, dense_dflash):
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    check_context(tiny_model_dir, spec, PROMPTS[3])


def check_context(tiny_model_dir, spec, prompt, setup=None):
    """After some verifies, every context row in the drafter's pages equals the K/V computed
    afresh from a plain forward over the sequence's committed tokens. `setup(engine)` runs
    before the first step."""
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    engine = llm.engine
    if setup is not None:
        setup(engine)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("r", prompt, params)
    for _ in range(6):
        engine.step()
    seq = engine.requests["r"].seqs[0]
    runner = engine.runner
    n = seq.num_computed_tokens
    assert n > len(prompt)
    # a fresh target forward over the committed tokens, tapping the same layers
    fresh = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec).engine
    fresh.add_request("f", seq.tokens(0, n), SamplingParams(temperature=0.0, max_tokens=1))
    fresh.step()
    taps = fresh.runner.taps.buffer[:n]
    want = runner.dflash.context_kv(taps, torch.arange(n))
    page = runner.page_size
    slots = torch.tensor([seq.block_table[p // page] * page + p % page for p in range(n)])
    for layer, (k, v) in enumerate(want):
        flat = runner.dflash_kv[layer].view(2, -1, *k.shape[1:])
        torch.testing.assert_close(flat[0][slots], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flat[1][slots], v, rtol=1e-5, atol=1e-5)


def ragged_programs(engine, prefill_rows: int = 0):
    """Run the engine's decode and verify steps (and steps with prompt chunks of up to
    `prefill_rows` rows) through CPU stand-ins for its programs (padded tables: padding rows
    on the dummy page, a prefill program's at positions 0 .. rows - 1)."""
    from tests.test_program_shapes import EagerPrograms

    runner = engine.runner
    max_q = engine.spec.cfg.num_drafts + 1
    runner.graphs = EagerPrograms(
        runner.model, max_q, runner.page_size, prefill_rows, runner.block_tables.num_pages
    )


def test_programs_write_the_context_as_the_eager_forward_does(tiny_model_dir, dense_dflash):
    """The context write is part of the target's forward, so a step replayed as a program
    padded to its bucket writes it too: the pages hold exactly the committed rows' features,
    the real pages are what the eager steps left (rejected rows included), the padding rows
    went to the dummy page alone, and greedy output in a batch equals plain decoding's."""
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    check_context(tiny_model_dir, spec, PROMPTS[3], ragged_programs)
    # 3 rows a sequence, sequences ending at different steps: a step of 3 (9 rows) pads to 10
    spec["num_drafts"] = 2
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(6)
    ]
    want = plain(tiny_model_dir, PROMPTS[:6], params)
    pages, accepted = [], []
    for graphed in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec, max_num_seqs=4)
        if graphed:
            ragged_programs(llm.engine)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], params, use_tqdm=False)]
        assert got == want
        if graphed:
            shapes = llm.engine.runner.graphs.shapes
            assert any(s.rows() > s.num_seqs for s in shapes), "no verify ran as a program"
        pages.append(llm.engine.runner.dflash_kv.clone())
        accepted.append(llm.engine.telemetry.spec.num_accepted_tokens)
    eager, graphed = pages
    real = [p for p in range(eager.shape[2]) if p != DUMMY_PAGE]
    torch.testing.assert_close(graphed[:, :, real], eager[:, :, real], rtol=1e-5, atol=1e-5)
    assert not torch.equal(graphed[:, :, DUMMY_PAGE], eager[:, :, DUMMY_PAGE])
    assert accepted[0] == accepted[1]


def test_prefill_programs_past_a_short_model_length(tiny_model_dir, dense_dflash):
    """A prefill program's padding rows sit at positions up to its width, past a short model
    length, and the target's forward writes their context rows too: the drafter's rotary
    table reaches as far as the target's (a CUDA capture of these programs failed on an
    out-of-range index when it did not)."""
    from metrale.engine.program_shapes import PrefillShape, prefill_program_rows
    from tests.test_program_shapes import record_failures

    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3}
    # one first step of 12 x 44 rows: a 640-row program, its padding rows at positions 0 .. 111
    prompts = [[(5 * i + 7 * j) % 300 + 3 for j in range(44)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = plain(tiny_model_dir, prompts, params)
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec, max_model_len=64)
    runner = llm.engine.runner
    rows = prefill_program_rows(runner.prefill_limit)
    assert rows > 64 + llm.engine.spec.cfg.num_drafts + 1
    ragged_programs(llm.engine, rows)
    failures = record_failures(runner)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert not failures
    assert [o.outputs[0].token_ids for o in got] == want
    assert any(isinstance(s, PrefillShape) and s.rows() == 640 for s in runner.graphs.shapes)


class EagerProgram:
    """A stand-in for a captured CUDA graph on CPU: replay runs the function."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.out.copy_(self.fn())


def test_draft_programs_are_captured_at_start_up(tiny_model_dir, tmp_path, monkeypatch):
    """`DraftGraphs` captures every (sequences, context) program up to its start-up width when
    it is built, none while requests run (a capture mid-run stalled a step by about 50 ms on
    the H200); drafts replayed from them, padding sequences included, give the acceptance of
    the eager drafter and plain greedy output."""
    from metrale.speculative import dflash as dflash_mod

    captured = []

    def fake_capture(fn, pool, device):
        program = EagerProgram(fn)
        program.out = fn().clone()
        captured.append(program)
        return program, program.out

    monkeypatch.setattr(dflash_mod, "capture", fake_capture)
    monkeypatch.setattr(dflash_mod, "STARTUP_CONTEXT_ROWS", 256)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(6)
    ]
    want = plain(tiny_model_dir, PROMPTS[:6], params)
    repeated = max(set(want[0]), key=want[0].count)  # drafts the target accepts at times
    echo = write_dflash(tiny_model_dir, tmp_path / "echo", echo_mask=repeated)
    spec = {"method": "dflash", "model": str(echo), "num_drafts": 3, "dcut": False}
    accepted = []
    for graphed in (False, True):
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec, max_num_seqs=5)
        drafter = llm.engine.spec.drafter
        if graphed:
            drafter.graphs = dflash_mod.DraftGraphs(drafter, 5, 256, None)
            keys = sorted(drafter.graphs._programs)
            assert keys == [(1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (4, 64)]
            assert drafter.graphs.max_seqs == 8
            at_start = len(captured)
        got = llm.generate(PROMPTS[:6], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        accepted.append(llm.engine.telemetry.spec.num_accepted_tokens)
    assert len(captured) == at_start + 1  # 5 sequences: 8 of them, first used mid-run
    assert accepted[0] == accepted[1] > 0
    # built by the drafter: as wide as a draft's context can be (the model length), not the
    # target programs' length, which reaches past it by the lookahead and the prefill width
    from types import SimpleNamespace

    runner = llm.engine.runner
    runner.graphs = SimpleNamespace(max_model_len=runner.max_model_len + 4096, pool=None)
    graphs = dflash_mod.DFlashDrafter(runner, 2).graphs
    runner.graphs = None
    assert graphs.max_context == dflash_mod.context_bucket(runner.max_model_len - 1)


def test_a_step_that_drafts_nothing_is_a_plain_step(tiny_model_dir, dense_dflash):
    """The drafter keeps no state (the forward writes its context): a step where no sequence
    drafts runs no drafter hook at all, and the drafter still drafts from a context it never
    saw being written (a plain request's pages, then a speculative request continuing them)."""
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    drafter = llm.engine.spec.drafter
    assert drafter.stateless and not drafter.needs_hidden
    assert llm.engine.spec.host.enabled  # D-Cut prices its drafting (what a plain step skips)
    calls = []
    observe = drafter.observe
    drafter.observe = lambda verdicts: (calls.append(len(verdicts)), observe(verdicts))
    off = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, speculative=False)
    llm.generate([PROMPTS[2]], off, use_tqdm=False)
    assert calls == [] and llm.engine.telemetry.spec.num_draft_tokens == 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain(tiny_model_dir, [PROMPTS[2]], params)
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPTS[2]], params)] == want
    assert calls and llm.engine.telemetry.spec.num_draft_tokens > 0


def test_num_drafts_beyond_the_block_is_refused(tiny_model_dir, dense_dflash):
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 4}
    with pytest.raises(ValueError, match="num_drafts"):
        LLM(tiny_model_dir, device="cpu", spec=spec)
    with pytest.raises(ValueError, match="spec.model"):
        LLM(tiny_model_dir, device="cpu", spec={"method": "dflash"})


def test_accepted_blocks_commit_their_rows_to_the_context(tiny_model_dir, tmp_path):
    """A drafter whose drafts the target often accepts (it echoes a token the target repeats):
    multi-row commits land in the context exactly, and the output is still plain greedy's."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS, params)
    repeated = max(set(want[0]), key=want[0].count)
    drafter = write_dflash(tiny_model_dir, tmp_path / "echo", echo_mask=repeated)
    spec = {"method": "dflash", "model": str(drafter), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    tel = llm.engine.telemetry.spec
    assert tel.num_accepted_tokens > 20
    check_context(tiny_model_dir, spec, PROMPTS[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hybrid", [False, True])
def test_cuda_graphs_tap_the_hidden_states(tiny_model_dir, hybrid_dir, tmp_path, hybrid):  # noqa: F811
    """On CUDA the target's programs write the taps themselves: the graphed context equals the
    eager one's, acceptance included (float32), and the output is plain decoding's."""
    target = hybrid_dir if hybrid else tiny_model_dir
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[t % 300 + 3 for t in p] for p in PROMPTS]
    want = [
        o.outputs[0].token_ids
        for o in LLM(target, device="cuda", dtype="float32").generate(prompts, params)
    ]
    repeated = max(set(want[0]), key=want[0].count)
    layers = (1,) if hybrid else (0, 1)
    drafter = write_dflash(target, tmp_path / "echo", echo_mask=repeated, layers=layers)
    spec = {"method": "dflash", "model": str(drafter), "num_drafts": 3, "dcut": False}
    runs = {}
    for graphs in (False, True):
        llm = LLM(target, device="cuda", dtype="float32", spec=spec, cuda_graphs=graphs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
        runs[graphs] = llm.engine.telemetry.spec.num_accepted_tokens
        # drafting ahead is opt-in (METRALE_DFLASH_AHEAD=1): then, with programs, the drafts
        # of most verifies were made right after the one before
        assert (llm.engine.spec.drafter.drafted_ahead > 0) == (graphs and knobs().dflash_ahead)
    assert runs[True] == runs[False] > 0


def test_the_shipped_model_ships_a_trained_dflash_drafter():
    """`spec=dict(method="dflash")` on the default model finds `dflash/` beside it; its drafts
    are accepted on code, and the output is plain greedy's."""
    prompts = ["import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(device="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(device="cpu", dtype="float32", spec={"method": "dflash", "num_drafts": 7})
    assert llm.engine.runner.dflash.config.block_size == 8
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    tel = llm.engine.telemetry.spec
    assert tel.num_accepted_tokens / max(tel.num_drafts, 1) > 0.8  # tokens per verify past 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_fused_layers_equal_the_torch_path(tiny_model_dir, tmp_path, monkeypatch):
    """The fused path (packed q|k|v and gate|up, q/k norms and rotary in one kernel, the context
    K/V written by it) gives the torch path's draft hidden states and context rows (float32,
    Triton's interpreter on CPU tensors); the packed projections cost no second copy of the
    weights, and a loaded drafter still saves in the published layout."""

    path = write_dflash(tiny_model_dir, tmp_path / "d", num_layers=2)
    tcfg = ModelConfig.from_hf(tiny_model_dir)
    model = load_dflash(path, tcfg, 64, torch.device("cpu"), torch.float32)
    layer = model.layers[0]
    attn = layer.self_attn
    assert attn.k_proj.weight.data_ptr() == layer.qkv[0][attn.q_proj.weight.shape[0] :].data_ptr()
    torch.manual_seed(0)
    s, b, h = 3, 4, tcfg.hidden_size
    block = torch.randn(s, b, h)
    positions = torch.tensor([5, 9, 20])[:, None] + torch.arange(b)
    ctx_k, ctx_v = torch.randn(2, 2, s, 6, 2, 16).unbind(1)
    valid = torch.arange(6)[None, :] < torch.tensor([[3], [6], [1]])
    taps = torch.randn(7, len(model.config.target_layer_ids) * h)
    slots = torch.tensor([17, 18, 19, 40, 41, 3, 2])
    runs = {}
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
        knobs.cache_clear()
        assert layer.fused(block) == forced
        kv = torch.zeros(len(model.layers), 2, 4, 16, 2, 16)
        with torch.inference_mode():
            hidden = model(block, positions, list(ctx_k), list(ctx_v), valid)
            model.write_context(kv, taps, torch.arange(7) + 3, slots)
        runs[forced] = hidden, kv
    monkeypatch.delenv("METRALE_FORCE_FUSED_KERNELS")
    knobs.cache_clear()
    for want, got in zip(runs[False], runs[True], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runs[True][1].flatten(2, 3)[:, :, slots].abs().sum() > 0
    save_dflash(model, tmp_path / "again", json.loads((tiny_model_dir / "config.json").read_text()))
    again = load_dflash(tmp_path / "again", tcfg, 64, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(again.layers[1].qkv[0], model.layers[1].qkv[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
def test_the_engine_on_fused_layers(tiny_model_dir, tmp_path, monkeypatch):
    """The engine with the drafter's fused path forced on (Triton's interpreter): plain greedy
    output, and the drafts the torch path accepts (float32)."""

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS[:4], params)
    repeated = max(set(want[0]), key=want[0].count)
    echo = write_dflash(tiny_model_dir, tmp_path / "echo", echo_mask=repeated)
    spec = {"method": "dflash", "model": str(echo), "num_drafts": 3, "dcut": False}
    accepted = []
    for forced in (False, True):
        if forced:
            monkeypatch.setenv("METRALE_FORCE_FUSED_KERNELS", "1")
        knobs.cache_clear()
        llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
        assert llm.engine.runner.dflash.layers[0].fused(torch.zeros(1)) == forced
        got = llm.generate(PROMPTS[:4], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        accepted.append(llm.engine.telemetry.spec.num_accepted_tokens)
    monkeypatch.delenv("METRALE_FORCE_FUSED_KERNELS")
    knobs.cache_clear()
    assert accepted[0] == accepted[1] > 0


def test_drafts_reach_the_verify_without_a_host_read(tiny_model_dir, dense_dflash):
    """DFlash's drafts stay on the device from its forward into the verify's input ids: at the
    verify forward no draft has been read on the host yet (the host schedules and packs the
    verify while the drafter runs), and the output is still plain greedy's."""
    from metrale.engine.device_tokens import DeviceRow

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS[:6], params)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    runner, seen = llm.engine.runner, []
    forward = runner._forward

    def watched(batch, *args, **kwargs):
        rows = [e.drafts for e in batch.entries if isinstance(e.drafts, DeviceRow)]
        seen.append((len(rows), sum(r.source._rows is not None for r in rows)))
        return forward(batch, *args, **kwargs)

    runner._forward = watched
    got = llm.generate(PROMPTS[:6], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    verifies = [read for lazy, read in seen if lazy]
    assert len(verifies) > 5 and not any(verifies)


def test_a_verify_retried_after_a_failure_equals_plain(tiny_model_dir, dense_dflash, monkeypatch):
    """A verify step that fails after its forward (the drafts' device values already taken)
    runs again one sequence at a time (`engine/isolation.py`): those verifies take the drafts
    from their host copy, and the output is plain greedy's."""
    from metrale.engine import runner as runner_mod

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain(tiny_model_dir, PROMPTS[:8], params)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    verdicts, failed = runner_mod.greedy_verdicts, []

    def failing(entries, table, forced):
        if len(failed) < 8 and len(entries) > 1 and sum(bool(e.drafts) for e in entries) > 1:
            failed.append(len(entries))
            raise RuntimeError("injected after the verify's forward")
        return verdicts(entries, table, forced)

    monkeypatch.setattr(runner_mod, "greedy_verdicts", failing)
    got = llm.generate(PROMPTS[:8], params, use_tqdm=False)
    assert len(failed) == 8 and [o.outputs[0].token_ids for o in got] == want
    assert all(o.outputs[0].finish_reason == "length" for o in got)


def test_drafts_proposed_one_sequence_at_a_time_are_each_verified(
    tiny_model_dir, dense_dflash, monkeypatch
):
    """After a failing batch propose the controller proposes one sequence at a time: each
    replays the same program, whose output buffer the next replay rewrites, and each draft
    waits on the device for the verify. Every verify row must hold the draft the host judges
    (a review found the program's output handed over uncopied: every sequence verified the
    last one's drafts). The drafter's forward is an oracle (plain greedy's next tokens), so
    drafts are accepted and a wrong row changes the output."""
    from metrale.speculative import dflash as dflash_mod

    def fake_capture(fn, pool, device):
        program = EagerProgram(fn)
        program.out = fn().clone()
        return program, program.out

    monkeypatch.setattr(dflash_mod, "capture", fake_capture)
    monkeypatch.setattr(dflash_mod, "STARTUP_CONTEXT_ROWS", 128)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = PROMPTS[:4]
    want = plain(tiny_model_dir, prompts, params)
    truth = {tuple(p): w + [0] * 8 for p, w in zip(prompts, want, strict=True)}
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec, max_num_seqs=4)
    drafter, asked = llm.engine.spec.drafter, []

    def oracle(ids, lens, tables, context):
        rows = [[0] * (ids.shape[1] - 1)] * ids.shape[0]  # a capture's dummy inputs
        if asked:
            seq = asked[0]
            rows[0] = truth[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :][:3]
        return torch.tensor(rows, dtype=torch.long)

    drafter.draft_tokens = oracle
    drafter.graphs = dflash_mod.DraftGraphs(drafter, 4, 128, None)
    propose = drafter.propose

    def one_at_a_time(seqs, caps):
        if len(seqs) > 1:
            raise RuntimeError("the batch's program failed")
        asked[:] = seqs
        return propose(seqs, caps)

    drafter.propose = one_at_a_time
    seen, forward = [], llm.engine.runner._forward

    def watched(batch, input_ids, *args, **kwargs):
        row = 0
        for e in batch.entries:
            if e.drafts:
                verified = input_ids[row + e.num_rows - len(e.drafts) : row + e.num_rows]
                seen.append((verified.tolist(), list(e.drafts)))
            row += e.num_rows
        return forward(batch, input_ids, *args, **kwargs)

    llm.engine.runner._forward = watched
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(seen) > 10 and all(verified == judged for verified, judged in seen)
    assert got == want
    assert llm.engine.telemetry.spec.num_accepted_tokens > 20


def test_the_drafters_device_stall_is_priced_as_drafting(tiny_model_dir, dense_dflash, monkeypatch):
    """`prepare` no longer waits for DFlash's forward, so D-Cut's host cost of drafting takes
    the step's wait for it from the drafts (`DeviceDrafts.stall_seconds`, 0 off CUDA): a stall
    of 50 ms a step shows in the estimate per drafted sequence."""
    from metrale.engine.device_tokens import DeviceDrafts

    monkeypatch.setattr(DeviceDrafts, "stall_seconds", lambda self: 0.05)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "dflash", "model": str(dense_dflash), "num_drafts": 3, "dcut": False}
    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", spec=spec)
    llm.generate(PROMPTS[:4], params, use_tqdm=False)
    host = llm.engine.spec.host
    assert host.enabled and host.seconds(4) > 0.05

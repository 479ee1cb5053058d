"""The acceptance report (`metrale bench --acceptance`) on the default model and a tiny held-out
corpus: held-out windows are deterministic and real, every drafter x K is reported with sane,
self-consistent rates whose counts match an independent replay of the n-gram drafter, outputs
equal plain greedy decoding, and a model without MTP weights reports MTP as skipped."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import pytest

from metrale import LLM, SamplingParams
from metrale.bench.acceptance import (
    acceptance_report,
    counter_delta,
    format_report,
    heldout_prompts,
    run_acceptance,
    spec_counters,
)
from metrale.default_model import random_model_dir
from metrale.knobs import knobs
from metrale.speculative.ngram import lookup
from metrale.telemetry import SpecTelemetry
from metrale.tokenizer import Tokenizer

KS = (1, 2, 3, 4, 5)
MAX_TOKENS = 24
PROMPT_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random model (it repeats itself, so n-gram acceptance is high, and its random
    MTP head is never right), built into a fresh METRALE_HOME."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("METRALE_HOME", str(tmp_path_factory.mktemp("home")))
        knobs.cache_clear()
        yield random_model_dir()
    knobs.cache_clear()


def _code(rng: random.Random, lines: int) -> str:
    names = ["alpha", "beta", "gamma", "total", "items", "result", "value"]
    out = []
    for i in range(lines):
        a, b = rng.choice(names), rng.choice(names)
        out.append(
            rng.choice(
                [
                    f"def {a}_{i}({b}):\n    return {b} + {i}\n",
                    f"{a} = [{b} * {i} for {b} in range({rng.randrange(2, 90)})]\n",
                    f"if {a} > {b}:\n    {a}, {b} = {b}, {a}\n",
                ]
            )
        )
    return "".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    rng = random.Random(7)
    (root / "pkg").mkdir()
    (root / "a.py").write_text(_code(rng, 12))
    (root / "pkg" / "b.py").write_text(_code(rng, 15))
    (root / "pkg" / "c.py").write_text(_code(rng, 9))
    (root / "short.py").write_text("x = 1\n")  # too short for a window: never used
    (root / "notes.txt").write_text("Z" * 500)  # not matched by the glob
    (root / "site-packages").mkdir()
    (root / "site-packages" / "dep.py").write_text("Q" * 500)  # pruned
    return root


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def prompts(corpus, tokenizer):
    return heldout_prompts(corpus, tokenizer, num_prompts=3, prompt_tokens=PROMPT_TOKENS, seed=0)


@pytest.fixture(scope="module")
def report(model_dir, prompts):
    return acceptance_report(model_dir, prompts, ks=KS, max_tokens=MAX_TOKENS, device="cpu")


@pytest.fixture(scope="module")
def plain_outputs(model_dir, prompts):
    """Greedy outputs of an engine without speculation, built here independently."""
    llm = LLM(model_dir, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_heldout_prompts_are_deterministic_windows_of_the_files(corpus, tokenizer, prompts):
    texts = [p.read_text() for p in (corpus / "a.py", corpus / "pkg/b.py", corpus / "pkg/c.py")]
    assert len(prompts) == 3 and all(len(p) == PROMPT_TOKENS for p in prompts)
    # each a contiguous window of one of the three matching files, all three used
    sources = {next(i for i, t in enumerate(texts) if tokenizer.decode(p) in t) for p in prompts}
    assert sources == {0, 1, 2}
    again = heldout_prompts(corpus, tokenizer, num_prompts=3, prompt_tokens=PROMPT_TOKENS)
    assert again == prompts
    other = heldout_prompts(corpus, tokenizer, 3, PROMPT_TOKENS, seed=1)
    assert other != prompts
    # more prompts than files: files are reused at other offsets; all windows stay inside .py
    many = heldout_prompts(corpus, tokenizer, num_prompts=8, prompt_tokens=20, seed=3)
    assert len(many) == 8 and all(any(tokenizer.decode(p) in t for t in texts) for p in many)
    # the continuation after each window is real text of the file
    text = texts[2]
    for p in heldout_prompts(
        corpus / "pkg/c.py", tokenizer, 5, 40, seed=2, min_continuation=len(text) - 60
    ):
        assert text.index(tokenizer.decode(p)) <= 20
    # a list of strings: the short one is skipped, the long one reused
    from_texts = heldout_prompts(["ab" * 30, "q"], tokenizer, num_prompts=2, prompt_tokens=10)
    assert len(from_texts) == 2 and all(tokenizer.decode(p) in "ab" * 30 for p in from_texts)
    assert all(len(p) == 10 for p in from_texts)
    with pytest.raises(ValueError, match="none of 2 sources"):
        heldout_prompts(["short", "also short"], tokenizer, 2, 64)
    with pytest.raises(FileNotFoundError):
        heldout_prompts(corpus / "missing", tokenizer, 2, 8)


def test_report_covers_every_drafter_and_k_with_consistent_rates(report, prompts):
    assert json.loads(json.dumps(report)) == report
    assert report["num_prompts"] == 3 and report["prompt_lengths"] == [PROMPT_TOKENS] * 3
    assert report["max_tokens"] == MAX_TOKENS and report["device"] == "cpu"
    assert report["dtype"] == "float32"
    # the random model has no DFlash drafter: skipped, saying why
    assert set(report["skipped"]) == {"dflash"} and "no dflash/" in report["skipped"]["dflash"]
    assert [(r["drafter"], r["k"]) for r in report["results"]] == [
        (d, k) for d in ("mtp", "ngram") for k in KS
    ]
    assert report["identical_outputs"] is True
    for row in report["results"]:
        k = row["k"]
        assert row["identical_outputs"] and row["mismatched_prompts"] == 0
        assert row["verifies"] > 0 and row["tokens"] == MAX_TOKENS * len(prompts)
        acc = row["acceptance"]
        assert len(acc) == len(row["match_rate"]) == len(row["drafted_per_pos"]) == k
        assert all(0.0 <= a <= 1.0 for a in acc)
        assert all(a >= b for a, b in zip(acc, acc[1:]))  # the accepted prefix only shrinks
        for rate in row["conditional_acceptance"] + row["match_rate"]:
            assert rate is None or 0.0 <= rate <= 1.0
        assert 1.0 <= row["mean_acceptance_length"] <= k + 1
        # every accepted token sits at one position of one verify
        assert row["mean_acceptance_length"] == pytest.approx(1 + sum(acc))
        assert row["drafted_per_pos"][0] == row["verifies"]
        assert sum(row["drafted_per_pos"]) == row["draft_tokens"] <= k * row["verifies"]
        # a verify emits its accepted drafts plus one; the first token comes from the prefill
        assert row["tokens"] == len(prompts) * MAX_TOKENS
    # With D-Cut off the MTP drafter drafts min(K, room under max_tokens) every step: with no
    # draft accepted (the random head's case) a prompt verifies at every output position but the
    # first (the prefill's) and the last (no room), and its last K - 1 verifies are 1..K-1 short.
    for row in report["results"]:
        k = row["k"]
        if row["drafter"] == "mtp" and row["accepted_tokens"] == 0:
            assert row["verifies"] == len(prompts) * (MAX_TOKENS - 2)
            short = len(prompts) * k * (k - 1) // 2
            assert row["draft_tokens"] == k * row["verifies"] - short
    table = format_report(report)
    assert len(table.splitlines()) == 2 + len(KS) * 2 + 1 + 1  # + the dflash skip line
    assert "dflash   skipped" in table
    assert "mean_len" in table and "ngram     5" in table


def simulate_ngram(prompt: list[int], output: list[int], k: int) -> dict:
    """Replay the engine's n-gram speculation over a known greedy output: the prefill emits the
    first token; each later step drafts up to min(k, room under max_tokens) tokens by lookup and
    accepts the prefix that matches the output, plus one token of the target's own."""
    counts = dict(verifies=0, draft_tokens=0, accepted_tokens=0)
    drafted, accepted = [0] * k, [0] * k
    n = 1
    while n < len(output):
        room = min(k, len(output) - n - 1)
        draft = lookup(prompt + output[:n], 1, 4, room) if room > 0 else []
        hits = 0
        while hits < len(draft) and draft[hits] == output[n + hits]:
            hits += 1
        if draft:
            counts["verifies"] += 1
            counts["draft_tokens"] += len(draft)
            counts["accepted_tokens"] += hits
            for j in range(len(draft)):
                drafted[j] += 1
                accepted[j] += j < hits
        n += hits + 1
    return {**counts, "drafted_per_pos": drafted, "accepted_per_pos": accepted}


def test_ngram_counts_match_an_independent_replay(report, prompts, plain_outputs):
    for row in report["results"]:
        if row["drafter"] != "ngram":
            continue
        expected = [simulate_ngram(p, o, row["k"]) for p, o in zip(prompts, plain_outputs)]
        for name in ("verifies", "draft_tokens", "accepted_tokens"):
            assert row[name] == sum(e[name] for e in expected), (row["k"], name)
        for name in ("drafted_per_pos", "accepted_per_pos"):
            assert row[name] == [sum(col) for col in zip(*(e[name] for e in expected))]


def test_counter_delta_equals_a_fresh_count():
    rng = random.Random(0)

    def verdicts(n: int):
        out = []
        for _ in range(n):
            matches = [rng.random() < 0.7 for _ in range(rng.randrange(1, 6))]
            prefix = next((i for i, m in enumerate(matches) if not m), len(matches))
            out.append((rng.randrange(1, 40), matches, prefix))
        return out

    tel, fresh = SpecTelemetry(), SpecTelemetry()
    for v in verdicts(30):
        tel.record(*v)
    before = spec_counters(tel)
    second = [v for v in verdicts(50) if len(v[1]) <= 3] + [(2, [True] * 4, 4)]
    for v in second:
        tel.record(*v)
        fresh.record(*v)
    delta = counter_delta(before, spec_counters(tel), 5)
    assert delta == counter_delta(spec_counters(SpecTelemetry()), spec_counters(fresh), 5)
    assert delta["verifies"] == len(second)
    assert delta["drafted_per_pos"][4] == 0 and delta["drafted_per_pos"][3] == 1
    assert delta["accepted_tokens"] == sum(v[2] for v in second)


def test_repeating_prompt_gives_high_ngram_acceptance(model_dir):
    prompt = "for i in range(10):\n    total += i\n" * 6
    out = acceptance_report(
        model_dir, [prompt], drafters=("ngram",), ks=(4,), max_tokens=40, device="cpu"
    )
    (row,) = out["results"]
    assert row["acceptance"][0] >= 0.9
    assert row["mean_acceptance_length"] >= 3.0 and row["tokens_per_step"] >= 3.0
    assert out["identical_outputs"] is True and out["prompt_lengths"] == [len(prompt)]


def test_model_without_mtp_weights_skips_mtp(model_dir, prompts, report, tmp_path):
    bare = tmp_path / "no-mtp"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("mtp.safetensors"))
    out = acceptance_report(bare, prompts, ks=(1, 3), max_tokens=MAX_TOKENS, device="cpu")
    assert "no MTP weights" in out["skipped"]["mtp"]
    assert [(r["drafter"], r["k"]) for r in out["results"]] == [("ngram", 1), ("ngram", 3)]
    assert "mtp      skipped" in format_report(out)
    # the same target: the same n-gram counts as on the full checkpoint
    full = {r["k"]: r for r in report["results"] if r["drafter"] == "ngram"}
    for row in out["results"]:
        for name in ("verifies", "accepted_tokens", "accepted_per_pos", "matched_per_pos"):
            assert row[name] == full[row["k"]][name]


def test_run_acceptance_reads_a_namespace(model_dir, corpus):
    args = SimpleNamespace(
        model=str(model_dir),
        heldout=str(corpus),
        num_prompts=2,
        prompt_tokens=32,
        max_tokens=12,
        device="cpu",
        dtype="float32",
        ks="1,2",
        drafters="ngram",
    )
    out = run_acceptance(args)
    assert out["model"] == str(model_dir) and out["heldout"] == str(corpus)
    assert out["prompt_lengths"] == [32, 32] and out["max_tokens"] == 12
    assert [(r["drafter"], r["k"]) for r in out["results"]] == [("ngram", 1), ("ngram", 2)]
    assert out["identical_outputs"] is True


def test_matches_count_past_the_first_miss_and_acceptance_by_width():
    """ARCHITECTURE: per-position matches are recorded at every position, even past the first
    miss, and acceptance by the step's verify width. Drafts [1, 2, 3] against the target's
    picks [1, 9, 3, x] match at positions 0 and 2 and accept 1; the verdicts say so, and the
    counters take every match while accepting the prefix alone."""
    from metrale.engine.sequence import ScheduledSeq, Sequence
    from metrale.engine.step_output import greedy_verdicts, parse_verdicts
    from metrale.telemetry import SpecTelemetry, width_bucket

    seq = Sequence(0, "r", [4, 5], SamplingParams(temperature=0.0), 0, (), 0)
    seq.num_computed_tokens = 1
    entry = ScheduledSeq(seq, 4, [1, 2, 3])
    (greedy,) = greedy_verdicts([entry], [1, 9, 3, 7])
    # the sampled path's table: (match, emitted) per row, the last row's match unused
    (sampled,) = parse_verdicts([entry], [[1, 1], [0, 9], [1, 3], [0, 7]], 0)
    for v in (greedy, sampled):
        assert v.matches == [True, False, True] and v.num_accepted == 1
        assert [t.token_id for t in v.tokens] == [1, 9]
    tel = SpecTelemetry()
    tel.record_verifies(10, [(greedy.matches, greedy.num_accepted), ([False, True], 0)])
    tel.record_verifies(1, [([True], 1)])
    assert tel.drafted_per_pos == [3, 2, 1]
    assert tel.matched_per_pos == [2, 1, 1]  # every match, past the first miss too
    assert tel.accepted_per_pos == [2, 0, 0]
    assert tel.by_width[width_bucket(10)] == [2, 5, 1]  # verifies, drafts, accepted
    assert tel.by_width[width_bucket(1)] == [1, 1, 1]
    assert width_bucket(10) != width_bucket(1)

"""The shipped default model: it is the trained one (held-out code is predictable to it), it fits
the size budget, transformers loads it, metrale loads it with its MTP head, and speculative
greedy output equals plain greedy output."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.default_model import SHIPPED_MODEL_DIR, default_model_dir

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Stack:\n    def push(self,"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", spec={"method": "mtp", "num_drafts": 3})


def test_default_model_is_the_shipped_checkpoint_within_budget():
    assert default_model_dir() == SHIPPED_MODEL_DIR
    total = sum(p.stat().st_size for p in SHIPPED_MODEL_DIR.iterdir())
    assert total <= 30 * 2**20, total
    card = (SHIPPED_MODEL_DIR / "MODEL_CARD.md").read_text()
    summary = json.loads((SHIPPED_MODEL_DIR / "train_summary.json").read_text())
    # The card quotes the run it describes.
    assert f"{summary['heldout']['loss']:.3f}" in card
    assert f"{summary['parameters']:,}" in card
    # its DFlash drafter: at most 15 MB more, and the card quotes its run too
    dflash = SHIPPED_MODEL_DIR / "dflash"
    assert sum(p.stat().st_size for p in dflash.iterdir()) <= 15 * 2**20
    run = json.loads((dflash / "dflash_train_summary.json").read_text())
    assert f"{run['heldout']['agree_row1']:.3f}" in card
    assert f"{run['parameters']:,}" in card


def test_held_out_code_is_predictable_to_it():
    """Cross-entropy on a stdlib module (not in the site-packages training corpus, and half prose
    docstrings), computed by transformers' own Qwen3 class: 3.05 nats per token when shipped,
    where a model that knows nothing scores ln(4096) = 8.3."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        SHIPPED_MODEL_DIR, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = torch.tensor([tok(text)["input_ids"][:512]])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.0, loss


def test_writes_python(llm):
    out = llm.generate(
        ["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=48, speculative=False)
    )
    text = out[0].outputs[0].text
    # An indented body line: what a reader recognises as the start of a function.
    assert re.search(r"\n {4}\S", text), text


def test_mtp_greedy_equals_plain_greedy(llm):
    plain = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative=False)
    )
    spec_tel = llm.engine.telemetry.spec
    before = spec_tel.num_accepted_tokens
    spec = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    # The trained head is right often enough to matter (the random one never is).
    assert spec_tel.num_accepted_tokens - before > 40

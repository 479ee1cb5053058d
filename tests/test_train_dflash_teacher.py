"""`metrale train dflash --teacher`: what the block rows learn. Against a target whose picks have
nothing to do with the corpus (untrained), a drafter taught by the target agrees with it and one
taught by the corpus does not: the teacher is the target, not the data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from metrale.train import train_dflash, train_target
from tests.test_train import OPTS, SHAPE, corpus, tok_dir  # noqa: F401


@pytest.fixture(scope="module")
def untrained(corpus, tok_dir, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("untrained")
    train_target(tok_dir, out, corpus, SHAPE, replace(OPTS, steps=1, lr=1e-12, eval_every=0))
    return out


@pytest.mark.parametrize("teacher", ["target", "greedy"])
def test_the_target_as_teacher_agrees_with_the_target(corpus, untrained, tmp_path, teacher):  # noqa: F811
    opts = replace(OPTS, steps=60, lr=5e-3, eval_every=60, eval_batches=8)
    heldout = {
        t: train_dflash(untrained, corpus, opts, block_size=4, out_dir=tmp_path / t, teacher=t)[
            "heldout"
        ]
        for t in ("data", teacher)
    }
    assert heldout[teacher]["agree_row1"] > heldout["data"]["agree_row1"] + 0.3


def test_an_unknown_teacher_is_refused(corpus, untrained, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="teacher"):
        train_dflash(untrained, corpus, OPTS, out_dir=tmp_path, teacher="oracle")

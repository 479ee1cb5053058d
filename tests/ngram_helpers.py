"""Helpers of the n-gram drafter's tests: a stand-in for the fields of a sequence it reads, and
a plain engine's output beside an n-gram engine to compare with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale import LLM, SamplingParams


@dataclass
class Seq:
    """The fields of `engine.sequence.Sequence` the drafter reads."""

    seq_id: int
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    inflight: object = None  # a token in flight: `output_token_ids` ends with its placeholder
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_settled_tokens(self) -> int:
        """Its tokens but the one in flight (the placeholders here are one token each)."""
        return self.num_tokens - (self.inflight is not None)

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:stop]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def plain_and_ngram(model_dir, prompts, *, max_tokens, max_num_seqs, dcut, async_scheduling):
    """Greedy plain decoding's tokens for `prompts`, and an n-gram engine (K = 3) of the same
    model and sizes, with the sampling parameters both use."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_num_seqs=max_num_seqs, max_model_len=200)
    reference = LLM(model_dir, **kw, async_scheduling=False)  # the synchronous engine
    plain = token_ids(reference.generate(prompts, params, use_tqdm=False))
    llm = LLM(
        model_dir,
        **kw,
        spec={"method": "ngram", "num_drafts": 3, "dcut": dcut},
        async_scheduling=async_scheduling,
    )
    return plain, llm, params

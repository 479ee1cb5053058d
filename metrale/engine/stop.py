"""Stop conditions of one sequence after it emits a token, and the text it may release.

Stop strings can straddle tokens, so while a sequence has stop strings the last `len(longest) - 1`
characters of its text are held back: a streamed delta never has to be retracted when a stop
string completes one token later. Token-based stops (stop token ids, EOS, `max_tokens`, the model
length) take effect only once `min_tokens` tokens were emitted (the sampler bans stop tokens
until then, so one can come at token `min_tokens + 1` at the earliest); a stop string counts
where a token after the first `min_tokens` completes it, as in vLLM's detokenizer. A structured
output ends when its grammar is complete.
"""

from __future__ import annotations

from metrale.engine.sequence import Sequence


def token_stop(seq: Sequence, max_model_len: int) -> tuple[str, int | None] | None:
    """The token-based stop (or None) after `seq` emitted its last token: needs no text."""
    params = seq.params
    if seq.error is not None:
        return "error", None
    if seq.grammar is not None and seq.grammar.finished:
        # The grammar can take nothing more (a complete JSON value, the last choice): the text
        # is done, whatever min_tokens or ignore_eos say, as it could only go on with EOS.
        return "stop", None
    token = seq.output_token_ids[-1]
    n_out = len(seq.output_token_ids)
    if n_out >= params.min_tokens:
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop", None
    if reaches_length(seq, n_out, seq.num_tokens, max_model_len):
        return "length", None
    return None


def reaches_length(seq: Sequence, n_out: int, num_tokens: int, max_model_len: int) -> bool:
    """Whether `seq` with `n_out` output tokens, `num_tokens` in all, is at its length: its
    `max_tokens`, or the model length (`token_stop`'s "length", whatever the tokens are)."""
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and n_out >= max_tokens) or num_tokens >= max_model_len


def find_stop_string(seq: Sequence, text: str, new_from: int) -> tuple[int, str] | None:
    """Earliest stop-string occurrence in `text` that ends past `new_from` (in the new text):
    one that ended earlier ended within the first `min_tokens` tokens, where stop strings do
    not count (vLLM's detokenizer searches the new characters alone too). Found from where
    the longest stop began, a shorter one held back whole before `min_tokens` ended the output
    when a longer stop string sat beside it (found in review). (Of two that end in one
    token's text, the earliest; vLLM takes the first listed.)"""
    best = None
    for stop in seq.params.stop:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def check_stop(
    seq: Sequence, new_text: str, max_model_len: int
) -> tuple[str | None, int | str | None, str]:
    """After `seq` emitted a token whose text is `new_text`: (finish reason or None, stop reason,
    text to release now). Updates `seq.pending_text` (the held-back tail)."""
    reason = token_stop(seq, max_model_len)
    if reason is not None:
        new_text += seq.detokenizer.flush()
    text = seq.pending_text + new_text
    stops = seq.params.stop
    if stops and len(seq.output_token_ids) > seq.params.min_tokens:
        found = find_stop_string(seq, text, len(seq.pending_text))
        if found is not None:
            idx, stop = found
            end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
            seq.pending_text = ""
            return "stop", stop, text[:end]
    if reason is not None:
        seq.pending_text = ""
        return reason[0], reason[1], text
    hold = max(map(len, stops)) - 1 if stops else 0
    cut = max(0, len(text) - hold)
    seq.pending_text = text[cut:]
    return None, None, text[:cut]

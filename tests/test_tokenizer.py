"""Tokenizer, incremental detokenizer, knobs and the random default model (CPU, fast)."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import threading
from pathlib import Path

import pytest
import tokenizers

from metrale.config import ModelConfig
from metrale.default_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    RANDOM_MODEL_NAME,
    _build_atomically,
    build_random_qwen3,
    random_model_dir,
)
from metrale.knobs import Knobs, knobs
from metrale.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["hello world", "héllo", "中文字符", "emoji 😀👍🏽 mix", "tabs\tand\nnewlines  ", ""]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Wie geht's? 中文 😀"},
        {"role": "assistant", "content": "Gut."},
        {"role": "user", "content": "und jetzt?"},
    ],
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_HOME", str(tmp_path / "home"))
    knobs.cache_clear()
    yield tmp_path / "home"
    knobs.cache_clear()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_qwen3(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _variant(model_dir: Path, tmp_path: Path, **config_changes) -> Path:
    """A copy of the tokenizer files with tokenizer_config.json fields changed (None deletes)."""
    out = tmp_path / "variant"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text()) | config_changes
    cfg = {k: v for k, v in cfg.items() if k not in config_changes or v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


# --- knobs -------------------------------------------------------------------------------------


def test_knobs_read_env_once_and_describe(home, monkeypatch):
    assert knobs().home == home.absolute()
    monkeypatch.setenv("METRALE_HOME", "/elsewhere")
    assert knobs().home == home.absolute()  # cached until cache_clear
    knobs.cache_clear()
    assert knobs().home == Path("/elsewhere")
    assert "METRALE_HOME=/elsewhere" in knobs().describe()


def test_knobs_default_and_unrecognised():
    k = Knobs.from_env({"METRALE_HOME": "", "METRALE_HOEM": "x", "OTHER": "y"})
    assert k.home == Path("~/.cache/metrale").expanduser().absolute()
    assert k.unrecognised == ("METRALE_HOEM",)
    assert "METRALE_HOEM" in k.describe()


# --- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no BOS
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 259
    assert tok.eos_token_ids == (IM_END_ID, ENDOFTEXT_ID)
    assert tok.bos_token_id is None
    assert tok.all_special_ids == (ENDOFTEXT_ID, IM_START_ID, IM_END_ID)
    assert tok.id_to_token(IM_END_ID) == "<|im_end|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START_ID and ids[-1] == IM_END_ID
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert len(tok.encode("😀")) == 4


def test_bos_and_eos_from_config(model_dir, tmp_path):
    bos = {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"}
    t = Tokenizer.from_dir(_variant(model_dir, tmp_path, bos_token=bos, add_bos_token=True))
    assert t.bos_token_id == ENDOFTEXT_ID
    assert t.encode("a") == [ENDOFTEXT_ID, ord("a")]
    assert t.encode("a", add_special_tokens=False) == [ord("a")]
    (tmp_path / "variant" / "generation_config.json").write_text('{"eos_token_id": 257}')
    assert Tokenizer.from_dir(tmp_path / "variant").eos_token_ids == (IM_START_ID, IM_END_ID)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# --- incremental detokenization ----------------------------------------------------------------


ALPHABET = "abc xyz,.é中文字😀👍🏽\n"


def _segments(rng: random.Random, data: bytes) -> list[bytes]:
    """`data` cut into random 1-4 byte pieces, ignoring character boundaries."""
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, 4)
        out.append(data[i : i + n])
        i += n
    return out


@pytest.fixture(scope="module")
def pieces(model_dir) -> tuple[Tokenizer, dict[bytes, int], list[list[int]]]:
    """The default tokenizer plus multi-byte tokens that cut characters anywhere, as real BPE
    vocabularies' do, and valid UTF-8 streams (lists of ids) written with them."""
    rng = random.Random(7)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(60)]
    cuts = [_segments(rng, t.encode("utf-8")) for t in texts]
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    symbol_of = {byte: sym for sym, byte in vocab.items()}  # byte tokens have id == byte
    ids = {bytes([b]): b for b in range(256)}
    for piece in sorted({p for c in cuts for p in c if len(p) > 1}):
        ids[piece] = vocab["".join(symbol_of[b] for b in piece)] = len(ids)
    # `tokenizers` numbers added tokens after the model's vocabulary, so move the specials up.
    for i, added in enumerate(spec["added_tokens"]):
        added["id"] = len(ids) + i
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    assert backend.token_to_id("<|endoftext|>") == len(ids)
    streams = [[ids[p] for p in c] for c in cuts]
    return Tokenizer(backend), ids, streams


def _random_stream(rng: random.Random, pieces, valid: bool) -> list[int]:
    tok, vocab, streams = pieces
    if valid:
        ids = list(rng.choice(streams))
        for _ in range(rng.randint(0, 3)):  # specials, only where a character ends
            at = rng.randint(0, len(ids))
            if not tok.decode(ids[:at]).endswith("\ufffd"):
                ids.insert(at, rng.choice(tok.all_special_ids))
        return ids
    # Garbage, sometimes with no ASCII at all so long runs end in U+FFFD at every step.
    pool = [*vocab.values(), *tok.all_special_ids]
    if rng.random() < 0.5:
        pool = [i for p, i in vocab.items() if all(b >= 0x80 for b in p)]
    return [rng.choice(pool) for _ in range(rng.randint(0, 80))]


def _push_in_chunks(det: IncrementalDetokenizer, rng: random.Random, ids: list[int]) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])  # speculative decoding pushes several at once
        deltas.append(det.push(ids[i : i + n]))
        i += n
    return deltas


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("valid", [True, False])
def test_detokenizer_matches_decode_at_every_prefix(pieces, skip, valid):
    tok = pieces[0]
    rng = random.Random(1234 + 2 * skip + valid)
    for _ in range(40):
        ids = _random_stream(rng, pieces, valid)
        for cut in range(len(ids) + 1):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            deltas = _push_in_chunks(det, rng, ids[:cut])
            full = tok.decode(ids[:cut], skip_special_tokens=skip)
            assert "".join(deltas) == det.text
            assert full.startswith(det.text)
            if valid:
                assert "\ufffd" not in det.text
                assert det.text == full.removesuffix("\ufffd")
            assert det.text + det.flush() == full
            assert det.text == full
            assert det.token_ids == ids[:cut]


def test_detokenizer_single_ids_and_prompt_context(tok):
    prompt = tok.encode("Say 中文: ")
    out = tok.encode("好的 😀 done") + [IM_END_ID]
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = [det.push(t) for t in out]
    assert "".join(deltas) + det.flush() == "好的 😀 done"
    # A 4-byte emoji comes out whole, on the token that completes it.
    emoji_at = len(tok.encode("好的 "))
    assert deltas[emoji_at : emoji_at + 4] == ["", "", "", "😀"]


def _byte_fallback_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """A SentencePiece-style tokenizer: byte-fallback ids <0x00>..<0xFF>, a Metaspace piece."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581a": 257}
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    )
    d = tokenizers.decoders
    backend.decoder = d.Sequence(
        [d.Replace("\u2581", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)]
    )
    return Tokenizer(backend), vocab


def test_byte_fallback_detokenizer_streams_every_character_whole():
    """A byte-fallback decoder renders each byte of an unfinished character as its own U+FFFD,
    and a character's first byte turns the context bytes before it into U+FFFD too: holding
    back one U+FFFD streamed '中' as '\ufffd' and 'éé' as 'é\ufffd' (found in review). Every
    character now comes out whole, on the id that completes it, and the text is decode's."""
    sp, vocab = _byte_fallback_tokenizer()
    rng = random.Random(3)
    alphabet = ["a", " ", "\n", "é", "ì", "中", "文", "😀", "🚀", "\u0301"]
    for trial in range(300):
        ids = []  # characters' bytes, and now and then a Metaspace piece between characters
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.2:
                ids.append(vocab["\u2581a"])
            ids += [vocab[f"<0x{b:02X}>"] for b in rng.choice(alphabet).encode()]
        text = sp.decode(ids)
        want = text
        det = IncrementalDetokenizer(sp)
        deltas = [det.push(t) for t in ids]
        assert "\ufffd" not in "".join(deltas), (trial, text, deltas)
        assert "".join(deltas) + det.flush() == want, (trial, text, deltas)
        det = IncrementalDetokenizer(sp)
        assert det.push_each(ids) + det.flush() == want
    # A run of garbage bytes is streamed as it passes `MAX_PENDING` and never lost: holding every
    # U+FFFD back, a second forced slide dropped those of the first (found in review).
    for n in (16, 17, 34, 40, 100):
        ids = [vocab["\u2581a"]] + [vocab["<0x80>"]] * n + [vocab["\u2581a"]]
        det = IncrementalDetokenizer(sp)
        deltas = [det.push(t) for t in ids]
        assert "".join(deltas) + det.flush() == sp.decode(ids), n
        assert sum(1 for d in deltas if d) >= 2 + n // (IncrementalDetokenizer.MAX_PENDING + 1)


def test_push_each_makes_the_text_of_one_push_an_id(tok):
    """`push_each` (the deferred text of a step's tokens) gives what one push an id gives: in
    one push on a byte-level decoder, id by id on a byte-fallback one, where a newline byte
    pushed with the lead byte of a character decodes to two U+FFFD, not one."""
    sp, vocab = _byte_fallback_tokenizer()
    assert tok.byte_level and not sp.byte_level
    byte = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    chunks = [[vocab["\u2581a"]], [byte[0x0A], byte[0xC3]], [byte[0xAC]]]  # " a\nì"
    each, one = IncrementalDetokenizer(sp), IncrementalDetokenizer(sp)
    got = "".join(each.push_each(c) for c in chunks)
    assert got == "".join(one.push(t) for c in chunks for t in c) == "a\nì"
    assert got + each.flush() == sp.decode([t for c in chunks for t in c])
    rng = random.Random(7)
    ids = tok.encode("def f(x):\n    return x  # 中文 😀\n") * 3
    each, one = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    i, texts = 0, []
    while i < len(ids):
        n = rng.choice([1, 2, 3, 4])
        texts.append((each.push_each(ids[i : i + n]), "".join(one.push(t) for t in ids[i : i + n])))
        i += n
    assert all(a == b for a, b in texts) and each.text == one.text == tok.decode(ids)


def test_detokenizer_text_does_not_depend_on_how_ids_are_grouped(tok):
    """Speculation pushes a step's 1-4 ids at once, plain decoding one at a time: the text at
    every step, and in the end, is the same, after a prompt that ends inside a character,
    through garbage bytes, specials and runs of ids past the vocabulary (a random model's
    padding), where the window is slid by force (it once cut inside a character at another id
    and gave an extra U+FFFD)."""
    past = tok.id_limit
    kinds = [[0x80], [0xBF], [0xE4], [0xF0], [0x41], [past, past + 7], list(range(0x80, 0x100))]
    kinds.append(list(tok.all_special_ids))
    for trial in range(700):
        rng = random.Random(trial)
        prompt = [rng.choice([0x41, 0xE4, 0xF0, 0x80, 0xC3]) for _ in range(rng.randint(1, 6))]
        ids: list[int] = []
        while len(ids) < rng.randint(10, 50):
            ids += [rng.choice(rng.choice(kinds))] * rng.randint(1, 20)
        skip = rng.random() < 0.5
        each, one = (
            IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
            for _ in range(2)
        )
        i = 0
        while i < len(ids):
            n = rng.choice([1, 2, 3, 4, 5])
            chunk = ids[i : i + n]
            assert each.push_each(chunk) == "".join(one.push(t) for t in chunk), (trial, i)
            i += n
        assert each.text + each.flush() == one.text + one.flush()


def test_detokenizer_work_per_token_is_bounded(tok, monkeypatch):
    lengths: list[int] = []
    decode = tok.decode

    def spy(ids, skip_special_tokens=True):
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    ids = tok.encode("中文 😀 text " * 200) + [IM_END_ID] * 100
    rng = random.Random(0)
    # Invalid bytes must not grow it either, even when every step ends in U+FFFD.
    ids += [rng.randrange(256) for _ in range(500)] + [0x80] * 300 + [0xE4] * 300
    det = IncrementalDetokenizer(tok, prompt_token_ids=ids[:50])
    for t in ids:
        det.push(t)
    det.flush()
    assert max(lengths) <= 2 * IncrementalDetokenizer.MAX_PENDING + 2
    assert len(lengths) <= 4 * len(ids)
    assert det.text == tok.decode(ids)


# --- chat templates ----------------------------------------------------------------------------


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(model_dir, tok, messages, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert tok.encode(got) == hf.encode(got)


FANCY_TEMPLATE = """\
{%- if messages[0]['role'] == 'bogus' %}{{ raise_exception('bogus role') }}{% endif %}
{{ bos_token }}
{%- if tools %}
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}
    {%- if m['role'] == 'skip' %}{% continue %}{% endif %}
{% generation %}[{{ m['role'] }}] {{ m['content'] }}{% endgeneration %}
    {%- if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}[assistant]{% if think is defined %} think={{ think }}{% endif %}
{% endif %}"""


def test_jinja_features_match_transformers(model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = _variant(model_dir, tmp_path, bos_token="<|endoftext|>", chat_template="unused")
    (out / "chat_template.jinja").write_text(FANCY_TEMPLATE)
    ours = Tokenizer.from_dir(out)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]
    messages = [{"role": "skip", "content": "x"}] + MESSAGES[1]
    for kwargs in ({}, {"tools": tools}, {"think": False}):
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours.apply_chat_template(messages, **kwargs) == expected
        assert "unused" not in expected
    with pytest.raises(ValueError, match="bogus role"):
        ours.apply_chat_template([{"role": "bogus", "content": ""}])


def test_named_templates_and_strftime(model_dir, tmp_path):
    named = [
        {"name": "default", "template": "D{{ strftime_now('%Y') | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    t = Tokenizer.from_dir(_variant(model_dir, tmp_path, chat_template=named))
    assert t.apply_chat_template(MESSAGES[0]) == "D4"
    assert t.apply_chat_template(MESSAGES[0], tools=[{}, {}]) == "T2"


def test_missing_chat_template(model_dir, tmp_path):
    t = Tokenizer.from_dir(_variant(model_dir, tmp_path, chat_template=None))
    assert not t.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template(MESSAGES[0])


# --- the random test model ------------------------------------------------------------------------


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_random_model_is_deterministic(home, tmp_path, monkeypatch):
    first = random_model_dir()
    assert first == home.absolute() / "models" / RANDOM_MODEL_NAME
    assert random_model_dir() == first  # second call reuses it
    monkeypatch.setenv("METRALE_HOME", str(tmp_path / "other"))
    knobs.cache_clear()
    second = random_model_dir()
    assert second != first
    assert _digests(first) == _digests(second)
    assert set(_digests(first)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "mtp.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert _digests(build_random_qwen3(tmp_path / "seed1", seed=1)) != _digests(first)


def test_concurrent_builds_leave_one_valid_dir(home):
    errors: list[BaseException] = []

    def build():
        try:
            random_model_dir()
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    models = home / "models"
    assert [p.name for p in models.iterdir()] == [RANDOM_MODEL_NAME]  # no temp dirs left
    Tokenizer.from_dir(models / RANDOM_MODEL_NAME)


def test_losing_the_race_keeps_the_winner(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "winner").write_text("1")
    _build_atomically(target, lambda p: (p / "loser").write_text("2"))
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert [p.name for p in target.iterdir()] == ["winner"]


def test_model_config_reads_default_model(model_dir):
    cfg = ModelConfig.from_hf(model_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (512, 128, 384)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 4, 2)
    assert cfg.head_dim == 32 and cfg.tie_word_embeddings and cfg.rope.theta == 1e6
    assert cfg.max_position_embeddings == 4096 and cfg.rms_norm_eps == 1e-6
    assert str(cfg.dtype) == "torch.bfloat16"
    assert cfg.eos_token_ids == (IM_END_ID,) and cfg.bos_token_id == ENDOFTEXT_ID


def test_overrides(tmp_path):
    path = build_random_qwen3(tmp_path / "m", {"num_hidden_layers": 1, "vocab_size": 300})
    cfg = ModelConfig.from_hf(path)
    assert cfg.num_hidden_layers == 1 and cfg.vocab_size == 300
    with pytest.raises(ValueError, match="vocab_size"):
        build_random_qwen3(tmp_path / "small", {"vocab_size": 100})


def test_transformers_loads_default_model(model_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    for text in TEXTS:
        assert hf_tok.encode(text) == ours.encode(text)
        assert hf_tok.decode(ours.encode(text)) == text
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == 512
    with torch.no_grad():
        logits = model(torch.tensor([ours.encode("hello")])).logits
    assert logits.shape == (1, 5, 512) and torch.isfinite(logits).all()


def test_token_bytes_are_the_bytes_each_token_stands_for(tok):
    """OpenAI's logprobs `bytes`: a token's own bytes, though a piece of a character decodes
    alone to U+FFFD (found in review: they were the UTF-8 of that U+FFFD)."""
    text = "日本語🎉 def f(x):\n\treturn 'é'"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.eos_token_ids[0]) == tok.id_to_token(tok.eos_token_ids[0]).encode()
    sp, vocab = _byte_fallback_tokenizer()
    assert sp.token_bytes(vocab["<0xE6>"]) == b"\xe6"
    assert sp.token_bytes(vocab["\u2581a"]) == b" a"
    ids = sp.encode("a é", add_special_tokens=False)
    assert b"".join(sp.token_bytes(i) for i in ids) == "a é".encode()

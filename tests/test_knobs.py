"""Parsing rules of the speculative `METRALE_*` knobs (seeds 004, 000) and what they gate."""

from __future__ import annotations

import pytest
import torch

from metrale.knobs import (
    Knobs,
    hidden_fingerprint,
    knobs,
    mtp_catchup_enabled,
    mtp_multi_seq_mode,
    mtp_refeed_accepted_enabled,
)
from metrale.speculative.ep import EP_CMD_MTP_PROPOSE, EP_CMD_VERIFY_K4


def read(name: str, value: str | None, field: str):
    env = {} if value is None else {name: value}
    return getattr(Knobs.from_env(env), field)


@pytest.fixture
def clean_knobs():
    knobs.cache_clear()
    yield
    knobs.cache_clear()


# --- integers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        ("", 0),
        ("0", 0),
        ("3", 3),
        ("+3", 3),
        ("8", 8),
        ("9", 8),
        ("1000", 8),
        (str(2**64 - 1), 8),
        (str(2**64), 0),  # past usize: unparseable, not capped
        ("-1", 0),
        ("-0", 0),  # no sign but `+` on an unsigned parse
        ("abc", 0),
        ("3.0", 0),
        (" 3", 0),
        ("3 ", 0),
        ("1_0", 0),
        ("٣", 0),  # a non-ASCII digit
        ("+", 0),
    ],
)
def test_shadow_topk(value, expected):
    assert read("METRALE_MTP_SHADOW_TOPK", value, "mtp_shadow_topk") == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 0),
        ("", 0),
        ("1", 1),
        ("+2", 2),
        ("-3", -3),
        ("4", 4),
        ("5", 4),
        ("-5", -4),
        ("-1000", -4),
        (str(2**63 - 1), 4),
        (str(2**63), 0),  # past isize: unparseable, not clamped
        (str(-(2**63)), -4),
        (str(-(2**63) - 1), 0),
        ("x", 0),
        ("--1", 0),
        ("1e1", 0),
    ],
)
def test_refeed_shift(value, expected):
    assert read("METRALE_MTP_REFEED_SHIFT", value, "mtp_refeed_shift") == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("0", 0),
        ("12", 12),
        ("+4", 4),
        ("-1", None),
        ("wide", None),
        (str(2**64), None),
    ],
)
def test_canonical_key_min_width(value, expected):
    name = "METRALE_CANONICAL_KEY_MIN_WIDTH"
    assert read(name, value, "canonical_key_min_width") == expected


# --- flags -------------------------------------------------------------------------------------

EXACTLY_ONE = [(None, False), ("", False), ("1", True), ("0", False), ("true", False)]
EXACTLY_ONE += [("01", False), (" 1", False), ("1 ", False), ("+1", False), ("yes", False)]


@pytest.mark.parametrize(("value", "expected"), EXACTLY_ONE)
@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("METRALE_MTP_CATCHUP", "mtp_catchup"),
        ("METRALE_MTP_REFEED_ACCEPTED", "mtp_refeed_accepted"),
        ("METRALE_MTP_REFEED_DEBUG", "mtp_refeed_debug"),
        ("METRALE_NO_MTP_EP_PROPOSE", "no_mtp_ep_propose"),
    ],
)
def test_exactly_one_flags(name, field, value, expected):
    assert read(name, value, field) is expected


@pytest.mark.parametrize(("value", "expected"), EXACTLY_ONE)
def test_ep_propose_enabled_unless_exactly_one(value, expected):
    env = {} if value is None else {"METRALE_NO_MTP_EP_PROPOSE": value}
    assert Knobs.from_env(env).mtp_ep_propose_enabled is (not expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), ("", True), ("0", True), ("1", True), ("false", True), ("no", True)],
)
@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("METRALE_MTP_ACCEPT_DEBUG", "mtp_accept_debug"),
        ("METRALE_NO_CANONICAL_VERIFY_KEY", "no_canonical_verify_key"),
    ],
)
def test_presence_flags(name, field, value, expected):
    assert read(name, value, field) is expected


def test_canonical_verify_key_enabled_is_absence():
    assert Knobs.from_env({}).canonical_verify_key_enabled
    assert not Knobs.from_env({"METRALE_NO_CANONICAL_VERIFY_KEY": "0"}).canonical_verify_key_enabled


def test_defaults_and_describe():
    k = Knobs.from_env({})
    assert (k.mtp_shadow_topk, k.mtp_refeed_shift, k.canonical_key_min_width) == (0, 0, None)
    assert not (k.mtp_accept_debug or k.mtp_catchup or k.mtp_refeed_accepted)
    assert not (k.mtp_refeed_debug or k.no_mtp_ep_propose or k.no_canonical_verify_key)
    line = Knobs.from_env({"METRALE_MTP_SHADOW_TOPK": "20", "METRALE_MTP_CATCHP": "1"}).describe()
    assert "METRALE_MTP_SHADOW_TOPK=8" in line
    assert "METRALE_NO_CANONICAL_VERIFY_KEY=False" in line
    assert "unrecognised, ignored: METRALE_MTP_CATCHP" in line


def test_knobs_are_read_once(clean_knobs, monkeypatch):
    monkeypatch.setenv("METRALE_MTP_SHADOW_TOPK", "2")
    monkeypatch.delenv("METRALE_NO_CANONICAL_VERIFY_KEY", raising=False)
    assert knobs().mtp_shadow_topk == 2
    assert knobs().canonical_verify_key_enabled
    monkeypatch.setenv("METRALE_MTP_SHADOW_TOPK", "5")
    monkeypatch.setenv("METRALE_NO_CANONICAL_VERIFY_KEY", "")
    assert knobs().mtp_shadow_topk == 2
    assert knobs().canonical_verify_key_enabled
    knobs.cache_clear()
    assert knobs().mtp_shadow_topk == 5
    assert not knobs().canonical_verify_key_enabled


# --- multi-sequence gating ---------------------------------------------------------------------


def test_multi_seq_mode():
    assert not mtp_multi_seq_mode(1)
    assert mtp_multi_seq_mode(2)
    assert mtp_multi_seq_mode(64)


@pytest.mark.parametrize("gate", [mtp_catchup_enabled, mtp_refeed_accepted_enabled])
def test_catchup_and_refeed_need_the_knob_and_one_sequence(gate):
    name = {
        mtp_catchup_enabled: "METRALE_MTP_CATCHUP",
        mtp_refeed_accepted_enabled: "METRALE_MTP_REFEED_ACCEPTED",
    }[gate]
    on, off = Knobs.from_env({name: "1"}), Knobs.from_env({name: "true"})
    assert gate(1, on)
    assert not gate(2, on)
    assert not gate(1, off)
    assert not gate(2, off)
    # Each gate reads its own knob only.
    other = Knobs.from_env({"METRALE_MTP_CATCHUP": "1", "METRALE_MTP_REFEED_ACCEPTED": "1"})
    assert gate(1, other)


def test_gates_default_to_process_knobs(clean_knobs, monkeypatch):
    monkeypatch.setenv("METRALE_MTP_CATCHUP", "1")
    monkeypatch.delenv("METRALE_MTP_REFEED_ACCEPTED", raising=False)
    assert mtp_catchup_enabled(1)
    assert not mtp_refeed_accepted_enabled(1)


# --- fingerprint and command words -------------------------------------------------------------


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return h


def test_reference_fnv_matches_published_vectors():
    assert fnv1a64(b"") == 0xCBF29CE484222325
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a64(b"foobar") == 0x85944171F73967E8


def test_hidden_fingerprint_hashes_bf16_little_endian_bytes():
    # bf16 bit patterns: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00.
    h = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    assert hidden_fingerprint(h) == fnv1a64(bytes([0x80, 0x3F, 0x00, 0xC0, 0x00, 0x3F]))


def test_hidden_fingerprint_converts_to_bf16_first():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, generator=g)
    as_bf16 = h.to(torch.bfloat16)
    assert hidden_fingerprint(h) == hidden_fingerprint(as_bf16)
    data = b"".join(int(v).to_bytes(2, "little", signed=True) for v in as_bf16.view(torch.int16))
    assert len(data) == 2 * 64
    assert hidden_fingerprint(h) == fnv1a64(data)
    assert hidden_fingerprint(h.reshape(8, 8)) == hidden_fingerprint(h)
    assert hidden_fingerprint(h) != hidden_fingerprint(h.flip(0))


def test_hidden_fingerprint_is_zero_when_the_copy_fails():
    assert hidden_fingerprint(torch.empty(16, device="meta")) == 0


def test_ep_command_words():
    assert EP_CMD_VERIFY_K4 == 0xFFFFFFF4
    assert EP_CMD_MTP_PROPOSE == 0xFFFFFFF5


def test_nothing_but_knobs_reads_the_environment():
    """ARCHITECTURE: every `METRALE_*` variable is read in `knobs.py` alone. Elsewhere the
    environment is only written (`setdefault`), handed to a child process whole (`dict`), or
    read for Triton's own switch, `TRITON_INTERPRET`, which Triton itself reads the same way."""
    import ast
    from pathlib import Path

    import metrale

    allowed = {"TRITON_INTERPRET"}
    root = Path(metrale.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "knobs.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # os.environ.get(X) / os.getenv(X) / os.environ[X]
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
                key = node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                if not isinstance(node.ctx, ast.Load):
                    continue
                key = node.slice
            else:
                continue
            name = key.value if isinstance(key, ast.Constant) else ast.unparse(key)
            if name not in allowed:
                found.append(f"{path.relative_to(root)}:{node.lineno} reads {name}")
    assert not found, found

"""Seed 001: RowTable text form, ordering, construction from a dispatch, and the sizing tables."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.speculative.row_table import RowTable, Run, sizing_tables


@st.composite
def runs(draw):
    k = draw(st.integers(1, 64))
    count = draw(st.integers(1, 64))
    # A one-sequence run is never batched.
    batched = count > 1 and draw(st.booleans())
    return Run(k, count, batched)


tables = st.lists(runs(), min_size=1, max_size=8).map(lambda rs: RowTable(tuple(rs)))


# --- text form ---------------------------------------------------------------------------------


@given(tables)
def test_round_trip(table):
    text = str(table)
    assert RowTable.parse(text) == table
    assert str(RowTable.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "runs"),
    [
        ("2x4", [(2, 4, True)]),
        ("3x1! 2x4", [(3, 1, False), (2, 4, True)]),
        ("4x3! 1x2", [(4, 3, False), (1, 2, True)]),
        ("3x1! 2x1!", [(3, 1, False), (2, 1, False)]),
        ("2x2 2x2", [(2, 2, True), (2, 2, True)]),
    ],
)
def test_parse_examples(text, runs):
    table = RowTable.parse(text)
    assert table.runs == tuple(runs)
    assert str(table) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        (" ", "exactly one space"),
        ("2x4  3x1!", "exactly one space"),
        (" 2x4", "exactly one space"),
        ("2x4 ", "exactly one space"),
        ("0x4", "at least 1"),
        ("2x0", "at least 1"),
        ("2x0!", "at least 1"),
        ("3x1", "never batched"),
        ("2x4 3x1", "never batched"),
        ("02x4", "leading zero"),
        ("2x04", "leading zero"),
        ("2X4", "not a run"),
        ("2x4!!", "not a run"),
        ("x4", "not a run"),
        ("2x", "not a run"),
        ("2*4", "not a run"),
        ("-2x4", "not a run"),
        ("2x4,3x1!", "not a run"),
        ("2x4\t3x1!", "not a run"),
        ("２x4", "not a run"),  # a full-width digit
        ("hello", "not a run"),
    ],
)
def test_parse_errors_quote_the_text(text, why):
    with pytest.raises(ValueError, match=why) as err:
        RowTable.parse(text)
    assert repr(text) in str(err.value)


def test_constructor_validates():
    with pytest.raises(ValueError, match="at least one run"):
        RowTable(())
    with pytest.raises(ValueError, match="never batched"):
        RowTable((Run(3, 1, True),))
    with pytest.raises(ValueError, match="at least 1"):
        RowTable((Run(0, 2, True),))
    with pytest.raises(ValueError, match="at least 1"):
        RowTable((Run(2, 0, False),))
    # Plain tuples are normalised, so they build the same key.
    assert RowTable(((2, 4, True),)) == RowTable.parse("2x4")
    assert hash(RowTable(((2, 4, True),))) == hash(RowTable.parse("2x4"))


# --- key behaviour -----------------------------------------------------------------------------


@given(tables, tables)
def test_equality_hash_and_total_order(a, b):
    assert (a == b) == (str(a) == str(b))
    if a == b:
        assert hash(a) == hash(b)
    assert sum([a < b, a == b, a > b]) == 1


@given(st.lists(tables, max_size=12))
def test_sortable_and_usable_as_keys(ts):
    ordered = sorted(ts)
    assert all(x <= y for x, y in zip(ordered, ordered[1:]))
    cache = {t: str(t) for t in ts}
    assert all(cache[RowTable.parse(str(t))] == str(t) for t in ts)


def test_batched_flag_distinguishes_tables():
    assert RowTable.parse("2x4") != RowTable.parse("2x4!")
    assert len({RowTable.parse("2x4"), RowTable.parse("2x4!")}) == 2


@given(tables)
def test_rows_and_num_seqs(table):
    assert table.rows() == sum(r.k * r.count for r in table.runs)
    assert table.num_seqs == sum(r.count for r in table.runs)


def test_rows_example():
    table = RowTable.parse("3x1! 2x4 1x2!")
    assert table.rows() == 3 + 8 + 2
    assert table.num_seqs == 7


# --- from a dispatch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "depths", "text"),
    [
        ([0], [4], "4x1!"),
        ([3, 4, 5, 6], [2, 2, 2, 2], "2x4"),
        ([3, 4, 6, 7], [2, 2, 2, 2], "2x4!"),
        ([4, 3], [2, 2], "2x2!"),  # descending slots are not consecutive
        ([5, 5], [2, 2], "2x2!"),
        ([0, 1, 2, 3, 4], [3, 2, 2, 2, 1], "3x1! 2x3 1x1!"),
        ([0, 1, 2, 9, 3], [3, 3, 2, 2, 2], "3x2 2x3!"),
        ([0, 1, 2], [2, 3, 2], "2x1! 3x1! 2x1!"),
    ],
)
def test_from_dispatch(slots, depths, text):
    assert str(RowTable.from_dispatch(slots, depths)) == text


@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=20),
)
def test_from_dispatch_properties(pairs):
    slots = [s for s, _ in pairs]
    depths = [d for _, d in pairs]
    table = RowTable.from_dispatch(slots, depths)
    assert table.rows() == sum(depths)
    assert table.num_seqs == len(depths)
    expanded = [run.k for run in table.runs for _ in range(run.count)]
    assert expanded == depths
    assert all(a.k != b.k for a, b in zip(table.runs, table.runs[1:]))
    start = 0
    for run in table.runs:
        run_slots = slots[start : start + run.count]
        consecutive = run_slots == list(range(run_slots[0], run_slots[0] + run.count))
        assert run.batched == (run.count > 1 and consecutive)
        start += run.count


def test_from_dispatch_errors():
    with pytest.raises(ValueError, match="2 slots but 1 depths"):
        RowTable.from_dispatch([0, 1], [2])
    with pytest.raises(ValueError, match="empty"):
        RowTable.from_dispatch([], [])
    with pytest.raises(ValueError, match="at least 1"):
        RowTable.from_dispatch([0, 1], [0, 0])


# --- sizing tables -----------------------------------------------------------------------------


def test_sizing_tables_small():
    assert [str(t) for t in sizing_tables(9)] == [
        "2x2",
        "3x1! 2x1!",
        "2x3",
        "3x1! 2x2",
        "2x4",
        "3x1! 2x3",
    ]
    assert sizing_tables(3) == []


@pytest.mark.parametrize("max_rows", range(4, 41))
def test_sizing_tables(max_rows):
    found = sizing_tables(max_rows)
    assert found
    assert [t.rows() for t in found] == list(range(4, max_rows + 1))
    for r, table in zip(range(4, max_rows + 1), found):
        if r % 2 == 0:
            expected = f"2x{r // 2}"
        else:
            tail = (r - 3) // 2
            expected = f"3x1! 2x{tail}" + ("!" if tail == 1 else "")
        assert str(table) == expected
        assert RowTable.parse(expected) == table


def test_telemetry_counts_runs_on_consecutive_slots():
    """The engine records, per verify, its runs of several equal-depth sequences and how many of
    them sit on consecutive slots (`RowTable`'s batched mark)."""
    from metrale.telemetry import SpecTelemetry

    tel = SpecTelemetry()
    tel.record_key((0,), RowTable.from_dispatch([0, 1, 2, 7, 5], [3, 3, 3, 2, 2]))
    tel.record_key((1,), RowTable.from_dispatch([4], [2]))
    assert (tel.multi_seq_runs, tel.contiguous_runs, tel.verify_steps) == (2, 1, 2)

"""The shapes of captured programs, and how a step is padded to one.

Row-table programs (hybrid targets, and dense ones without the paged kernel): each depth's group
of sequences is padded to `decode_bucket` sequences, so a shrinking or growing batch meets a few
tables; `max_padded_rows` bounds the rows that takes.

Ragged programs: one captured program per (row bucket, sequence bucket) for dense targets,
whatever the mix of depths.

The paged attention kernel reads each sequence's rows and keys from device memory (query start
offsets, lengths, block tables), and every other layer of a dense target works row by row, so a
program need not know how many rows each sequence has, only how many rows and sequences there
are and the most rows one sequence may have (1 + K: the kernel's row block). Keying programs by
the row table instead meets a new table at almost every step of a mixed-depth batch (dozens of
captures inside a run at batch 8 and 64 on the H200), each costing more than many steps.

Shapes: S sequences of R rows in all are padded to a power of two of sequences, plus a few
padding sequences that take the padding rows, and R to a multiple of half the sequence bucket;
every padding row belongs to a padding sequence of at most `max_q` rows on the dummy page, so it
sees a key (no 0 / 0) and never a real sequence's page. A hybrid target's decode programs have
width 1 and its verify programs 1 + K: its recurrent-state kernels view the rows as [sequences,
max_q].

Prefill programs (dense targets): steps with prefill chunks of at most `graph_prefill_rows` rows
in all. The kernel tiles any number of rows per sequence, so a program is keyed by its row bucket
(`dense_prefill_row_bucket`: powers of two up to 128, quarter octaves past that) and its sequence
bucket alone, plus one spare sequence that takes all the padding rows; it computes logits only
for `samples` gathered rows (each sampling sequence's last token and drafts), not for every
prompt row.

Hybrid prefill programs (`GDNPrefillShape`): the GDN layers' [sequences, width] view makes the
width (the longest sequence's rows, bucketed by `gdn_prefill_widths`) part of the key, beside the
row and sequence buckets, and the padding rows go to padding sequences of at most that width on
the dummy page and the dummy state entry; how many is a function of the key alone.
"""

from __future__ import annotations

from dataclasses import dataclass


def decode_bucket(num_seqs: int) -> int:
    """The padded count of sequences of one depth in a graphed step: 1, 2, 4, 8, then multiples
    of 8, so that a shrinking or growing batch reuses a handful of programs instead of one per
    size (decode), and a verify of mixed depths one per combination of bucketed counts."""
    if num_seqs <= 8:
        return 1 << (num_seqs - 1).bit_length()
    return -(-num_seqs // 8) * 8


def max_padded_rows(max_seqs: int, max_rows_per_seq: int) -> int:
    """The `max_rows` a `ProgramCache` needs to admit every graphed step of at most `max_seqs`
    sequences of 1 .. `max_rows_per_seq` (q) rows each, once every depth's group is padded to
    `decode_bucket`. A group of n pads at most 7 sequences (n <= 8: to the next power of two;
    beyond: to a multiple of 8), so a padded step has at most max_seqs x q + 7 q (q + 1) / 2 rows
    and max_seqs + 7 q sequences; the workspace, sized over `sizing_tables` (runs of two rows),
    holds max_rows / 2 sequences, hence the second bound."""
    q = max_rows_per_seq
    return max(max_seqs * q + 7 * q * (q + 1) // 2, 2 * (max_seqs + 7 * q))


@dataclass(frozen=True, order=True)
class RaggedShape:
    """A program's shape: `rows` rows over `num_seqs` sequences of at most `max_q` rows each."""

    rows_: int
    num_seqs: int
    max_q: int

    def rows(self) -> int:
        return self.rows_

    def layout(self) -> list[int]:
        """Capture-time rows per sequence: full sequences of max_q rows, then the rest."""
        out, left = [], self.rows_
        for _ in range(self.num_seqs):
            out.append(min(self.max_q, left))
            left -= out[-1]
        return out

    def __str__(self) -> str:
        return f"ragged {self.rows_} rows / {self.num_seqs} seqs (q <= {self.max_q})"


def ragged_shape(num_seqs: int, num_rows: int, max_q: int) -> RaggedShape:
    """The padded shape of a step of `num_seqs` sequences and `num_rows` rows."""
    if not 1 <= num_seqs <= num_rows <= num_seqs * max_q:
        raise ValueError(f"{num_seqs} sequences of 1..{max_q} rows cannot hold {num_rows} rows")
    # Powers of two: padding sequences hold no row unless they take padding rows, and a
    # program with no row for them costs nothing more, so the buckets can be coarse.
    seqs = 1 << (num_seqs - 1).bit_length()
    if max_q == 1:
        return RaggedShape(seqs, seqs, 1)
    grain = max(seqs // 2, 1)
    rows = -(-num_rows // grain) * grain
    # padding sequences for the padding rows that the bucket's spare sequences cannot take
    extra = -(-(grain - 1) // max_q)
    return RaggedShape(rows, seqs + extra, max_q)


def max_ragged_seqs(max_seqs: int, max_q: int) -> int:
    """The most sequences a ragged program of up to `max_seqs` real sequences has."""
    return ragged_shape(max_seqs, max_seqs, max_q).num_seqs


def padding_rows(shape: RaggedShape, num_seqs: int, num_rows: int) -> list[int]:
    """Rows of each padding sequence after `num_seqs` real ones holding `num_rows` rows."""
    left, out = shape.rows_ - num_rows, []
    for _ in range(shape.num_seqs - num_seqs):
        out.append(min(shape.max_q, left))
        left -= out[-1]
    if left:
        raise ValueError(f"{shape}: {left} padding rows have no sequence")
    return out


def all_ragged_shapes(max_seqs: int, max_q: int) -> list[RaggedShape]:
    """Every shape a step of up to `max_seqs` sequences of 1..max_q rows pads to (captured at
    start-up, so no capture lands in a running step). Per power-of-two sequence bucket, the rows
    run over multiples of its grain from the fewest (one row per sequence) to the most."""
    shapes = set()
    bucket = 1
    while True:
        lo, hi = bucket // 2 + 1, min(bucket, max_seqs)  # sequence counts in this bucket
        first, last = ragged_shape(lo, lo, max_q), ragged_shape(hi, hi * max_q, max_q)
        grain = 1 if max_q == 1 else max(bucket // 2, 1)
        for rows in range(first.rows(), last.rows() + 1, grain):
            shapes.add(RaggedShape(rows, first.num_seqs, max_q))
        if bucket >= max_seqs:
            return sorted(shapes)
        bucket *= 2


def max_ragged_rows(max_seqs: int, max_q: int) -> int:
    """The most rows a ragged program of up to `max_seqs` sequences has."""
    return ragged_shape(max_seqs, max_seqs * max_q, max_q).rows()


def default_max_rows(max_seqs: int, max_q: int, ragged: bool) -> int:
    """The graph workspace's rows by default: every step of up to `max_seqs` sequences of
    1..max_q rows fits, padded as row-table programs pad or, when `ragged`, as ragged ones."""
    rows = max_padded_rows(max_seqs, max_q)
    return max(rows, max_ragged_rows(max_seqs, max_q)) if ragged else rows


def capture_layout(rows_per_seq: list[int]) -> tuple[list[int], list[int]]:
    """Capture-time inputs for sequences of these row counts, each alone on the dummy page with
    its rows at positions 0..k-1 (the capture's warm-up really runs, so every row must see a
    key): (query start offsets [S + 1], positions [rows]); the lengths are the row counts."""
    starts, positions = [0], []
    for k in rows_per_seq:
        starts.append(starts[-1] + k)
        positions.extend(range(k))
    return starts, positions


# Rows of the smallest prefill program: shorter steps pad to it.
PREFILL_MIN_ROWS = 16


@dataclass(frozen=True, order=True)
class PrefillShape:
    """A prefill program's shape: `rows_` rows over `num_seqs` sequences of any length (the
    last real sequence is followed by padding sequences, the first of which takes every padding
    row), with logits for `samples` gathered rows."""

    rows_: int
    num_seqs: int
    samples: int

    def rows(self) -> int:
        return self.rows_

    @property
    def max_q(self) -> int:
        return self.rows_

    def layout(self) -> list[int]:
        """Capture-time rows per sequence: one sequence holds them all."""
        return [self.rows_] + [0] * (self.num_seqs - 1)

    def __str__(self) -> str:
        return f"prefill {self.rows_} rows / {self.num_seqs} seqs ({self.samples} sampled)"


def prefill_program_rows(limit: int) -> int:
    """The widest prefill program for a limit of `limit` rows: its largest power of two, or 0
    (steps with prompt chunks run eagerly) below PREFILL_MIN_ROWS."""
    return 1 << (limit.bit_length() - 1) if limit >= PREFILL_MIN_ROWS else 0


def prefill_row_bucket(num_rows: int) -> int:
    """The rows a step of `num_rows` prompt-chunk rows is padded to: a power of two, at least
    PREFILL_MIN_ROWS."""
    return max(PREFILL_MIN_ROWS, 1 << (num_rows - 1).bit_length())


# Dense prefill programs' row buckets are powers of two up to here, quarter octaves past it. A
# step of a few hundred rows of a large model is bound by its arithmetic, not by reading its
# weights, so padding it to the next power of two nearly doubled its cost: on an H100 (qwen3-8b
# shape), 64 sequences verifying 4 rows each beside a 16-row prompt (268 rows) replayed in
# 12.0 ms padded to 512 rows and in 9.8 ms padded to 320, against 8.3 ms for the verify alone.
PREFILL_FINE_ROWS = 128


def dense_prefill_row_bucket(num_rows: int) -> int:
    """The rows a dense step of `num_rows` rows with prompt chunks is padded to: a power of two
    (16 at least) up to PREFILL_FINE_ROWS, then a multiple of a quarter of the power of two
    below it (160, 192, 224, 256, 320, ...), so past there a bucket pads 25% at most. Every
    power of two is a bucket, so `prefill_program_rows` is the widest one."""
    if num_rows <= PREFILL_FINE_ROWS:
        return prefill_row_bucket(num_rows)
    step = 1 << ((num_rows - 1).bit_length() - 3)
    return -(-num_rows // step) * step


def prefill_shape(num_seqs: int, num_rows: int, sample_rows_per_seq: int) -> PrefillShape:
    """The padded shape of a step of `num_seqs` sequences and `num_rows` rows whose sampling
    sequences sample at most `sample_rows_per_seq` rows each (1 + K)."""
    if not 1 <= num_seqs <= num_rows:
        raise ValueError(f"{num_seqs} sequences cannot hold {num_rows} rows")
    seqs = 1 << (num_seqs - 1).bit_length()
    rows = dense_prefill_row_bucket(num_rows)
    return PrefillShape(rows, seqs + 1, min(rows, seqs * sample_rows_per_seq))


def all_prefill_shapes(max_seqs: int, max_rows: int, sample_rows_per_seq: int) -> list:
    """Every prefill shape of up to `max_seqs` sequences and `max_rows` rows (a power of two;
    captured at start-up): each row bucket up to `max_rows` with each sequence bucket it holds,
    that is whose fewest sequences it holds (row buckets between powers of two: 160 rows hold
    129 sequences, the 256 bucket's fewest, not its 256; found in review)."""
    shapes = set()
    for num_seqs in {min((1 << b) // 2 + 1, max_seqs) for b in range(max_seqs.bit_length() + 1)}:
        rows = PREFILL_MIN_ROWS
        while rows <= max_rows:
            if rows >= num_seqs:
                shapes.add(prefill_shape(num_seqs, rows, sample_rows_per_seq))
            rows = dense_prefill_row_bucket(rows + 1)
    return sorted(shapes)


@dataclass(frozen=True, order=True)
class GDNPrefillShape:
    """A hybrid target's prefill program: `rows_` rows over `num_seqs` sequences of at most
    `width` rows each, with logits for `samples` gathered rows (one per sampling sequence).

    Its Gated-DeltaNet layers view the rows as a padded [num_seqs, width] block, so unlike a
    dense prefill program it is keyed by the width too, and its padding rows are spread over
    padding sequences of at most `width` rows (on the dummy page and the dummy state entry)."""

    rows_: int
    num_seqs: int
    width: int
    samples: int

    def rows(self) -> int:
        return self.rows_

    @property
    def max_q(self) -> int:
        return self.width

    def layout(self) -> list[int]:
        """Capture-time rows per sequence: full sequences of `width` rows, then the rest."""
        return fill_rows(self.rows_, self.num_seqs, self.width)

    def __str__(self) -> str:
        return (
            f"GDN prefill {self.rows_} rows / {self.num_seqs} seqs of <= {self.width} rows "
            f"({self.samples} sampled)"
        )


@dataclass(frozen=True, order=True)
class GDNMixedShape:
    """A hybrid target's program for a step that verifies beside prompt chunks
    (`gdn_state.SplitState`): the chunks laid out as a prefill program's `head` (its state
    advanced in place), then the verify's sequences as a ragged program's `tail` (in the verify's
    state mode). Logits for the head's sampling rows and every tail row."""

    head: GDNPrefillShape
    tail: RaggedShape

    def rows(self) -> int:
        return self.head.rows() + self.tail.rows()

    @property
    def num_seqs(self) -> int:
        return self.head.num_seqs + self.tail.num_seqs

    @property
    def max_q(self) -> int:
        return max(self.head.width, self.tail.max_q)

    @property
    def samples(self) -> int:
        return self.head.samples + self.tail.rows()

    def layout(self) -> list[int]:
        return self.head.layout() + self.tail.layout()

    def __str__(self) -> str:
        return f"GDN mixed: {self.head} + {self.tail}"


# The most prompt chunks (a sequence bucket) a mixed program takes beside a verify; more run as
# two programs. On an H100 (`qwen3-next-a3b-64e`, 64 slots, steady state) steps admitted 5-12
# requests at once.
MIXED_HEAD_SEQS = 16


def gdn_mixed_shape(
    head: list[int], tail_seqs: int, tail_rows: int, widths: list[int], max_q: int
) -> GDNMixedShape | None:
    """The mixed program of prompt chunks of `head` rows each beside a verify of `tail_seqs`
    sequences and `tail_rows` rows, or None where none takes them (too many chunks, or one
    wider than every prefill program)."""
    if len(head) > MIXED_HEAD_SEQS or max(head) > widths[-1]:
        return None
    return GDNMixedShape(
        gdn_prefill_shape(len(head), sum(head), max(head), widths),
        ragged_shape(tail_seqs, tail_rows, max_q),
    )


def fill_rows(rows: int, seqs: int, width: int) -> list[int]:
    """`rows` rows over `seqs` sequences of at most `width` rows each, filling each in turn."""
    out, left = [], rows
    for _ in range(seqs):
        out.append(min(width, left))
        left -= out[-1]
    if left:
        raise ValueError(f"{rows} rows do not fit {seqs} sequences of {width} rows")
    return out


# Rows per sequence of the narrowest hybrid prefill program: narrower steps pad to it. Padding a
# sequence's rows costs only delta-rule and conv steps over rows that change nothing; narrower
# buckets would add a fifth more programs to capture (124 -> 148 at 64 sequences, 512 rows).
GDN_PREFILL_MIN_WIDTH = 8


def gdn_prefill_widths(max_rows: int, chunk_min_rows: int) -> list[int]:
    """The widths (rows per sequence) of a hybrid's prefill programs: powers of two from
    GDN_PREFILL_MIN_WIDTH up to `max_rows`, plus `chunk_min_rows` itself when in range. The
    delta rule picks its chunked form when a forward's width passes `chunk_min_rows`; with that
    number a bucket boundary, a program picks the form an eager forward of the same step picks
    (in deterministic mode, where it is past any width, always the recurrent one)."""
    widths = {
        1 << b for b in range(max_rows.bit_length()) if GDN_PREFILL_MIN_WIDTH <= 1 << b <= max_rows
    }
    if 1 <= chunk_min_rows <= max_rows:
        widths.add(chunk_min_rows)
    return sorted(widths)


def _row_floor(rows: int) -> int:
    """The fewest real rows a step padded to a `rows` row bucket has."""
    return rows // 2 + 1 if rows > PREFILL_MIN_ROWS else 1


def _gdn_shape(seqs: int, rows: int, width: int) -> GDNPrefillShape:
    # Enough padding sequences of `width` rows for the most padding rows the row bucket leaves
    # (the sequence bucket's spare sequences may hold none: it may be full): a function of the
    # key alone, so one program serves every step of the bucket.
    extra = -(-(rows - _row_floor(rows)) // width)
    return GDNPrefillShape(rows, seqs + extra, width, min(rows, seqs))


def gdn_prefill_shape(
    num_seqs: int, num_rows: int, longest: int, widths: list[int]
) -> GDNPrefillShape:
    """The padded shape of a hybrid step of `num_seqs` sequences, `num_rows` rows and at most
    `longest` rows in one sequence (no drafts: a prefill program runs WRITE mode)."""
    if not 1 <= longest <= num_rows or not num_seqs <= num_rows <= num_seqs * longest:
        raise ValueError(f"{num_seqs} sequences of 1..{longest} rows cannot hold {num_rows} rows")
    width = next((w for w in widths if w >= longest), None)
    if width is None:
        raise ValueError(f"a sequence of {longest} rows is past the widest program ({widths})")
    seqs = 1 << (num_seqs - 1).bit_length()
    return _gdn_shape(seqs, prefill_row_bucket(num_rows), width)


def all_gdn_prefill_shapes(max_seqs: int, max_rows: int, widths: list[int]) -> list:
    """Every hybrid prefill shape of up to `max_seqs` sequences and `max_rows` rows (a power of
    two) that some step can pad to (captured at start-up): per (sequence, width, row) bucket,
    whether real steps of that many sequences, longest sequence and rows exist."""
    shapes = set()
    seqs = 1
    while True:
        n_lo, n_hi = seqs // 2 + 1, min(seqs, max_seqs)  # sequence counts in this bucket
        for i, width in enumerate(widths):
            longest_lo = widths[i - 1] + 1 if i else 1
            rows = PREFILL_MIN_ROWS
            while rows <= max_rows:
                lo = max(_row_floor(rows), n_lo - 1 + longest_lo)
                if width <= rows and lo <= min(rows, n_hi * width):
                    shapes.add(_gdn_shape(seqs, rows, width))
                rows *= 2
        if seqs >= max_seqs:
            return sorted(shapes)
        seqs *= 2

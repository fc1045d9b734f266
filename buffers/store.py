"""Immutable Arrow storage of a buffer's rows: producer batches kept as chunks, zero-copy.

A producer sends its rows as Arrow record batches; the store keeps each batch as one chunk
without copying a token buffer. Rows are addressed by absolute row ids (never renumbered);
two numpy arrays map a row id to its chunk and its position inside the chunk, so finding the
rows of a sample is two fancy-indexing operations. Memory comes back three ways: a chunk whose
rows are all retired is freed; a chunk that is mostly retired is rewritten with its live
rows; and once many small chunks pile up they are coalesced into one, which drops the
per-batch padding, dictionaries and message headers each small chunk carries. Each of those
copies a row at most a few times over its life, so the copy cost is amortised.

The store knows nothing about rewards or units: `buffers/replay.py` decides which rows live.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# A chunk with more retired rows than this fraction is rewritten with its live rows. At 1/2 a
# row is copied about once more over its life while resident bytes stay under twice the live
# bytes; lower values trade copies for memory.
REWRITE_DEAD_FRACTION = 0.5


@dataclass(frozen=True)
class StoreConfig:
    """When small chunks are coalesced (the per-chunk overhead of tiny producer batches)."""

    small_chunk_rows: int = 256  # a chunk with fewer rows than this counts as small
    coalesce_after: int = 64  # this many small chunks are merged into one (one extra copy each)


class _Chunk:
    __slots__ = ("batch", "rows", "live", "nbytes")

    def __init__(self, batch: pa.RecordBatch, rows: np.ndarray, nbytes: int) -> None:
        self.batch = batch
        self.rows = rows  # int64 [batch.num_rows]: absolute row id of each position, ascending
        self.live = len(rows)  # positions not yet retired
        self.nbytes = nbytes  # bytes this chunk keeps alive (a received message counts whole)


class ChunkStore:
    """Row id -> (chunk, position) over immutable record batches of one schema."""

    def __init__(self, schema: pa.Schema, cfg: StoreConfig = StoreConfig()) -> None:
        self.schema = schema
        self.cfg = cfg
        self._chunks: dict[int, _Chunk] = {}  # chunk id -> chunk; ids only grow
        self._next_chunk = 0
        self._base = 0  # row id at slot 0 of the arrays below
        self._chunk_of = np.full(256, -1, np.int64)  # slot -> chunk id; -1 = retired / unknown
        self._position = np.zeros(256, np.int32)  # slot -> position inside its chunk
        self._small: list[int] = []  # ids of small chunks not yet coalesced, oldest first
        self._sparse: set[int] = set()  # ids of big chunks mostly retired: rewritten by compact()
        self._positions = np.arange(256, dtype=np.int32)  # 0..255, the positions of a new chunk

    # ----------------------------------------------------------------- rows in
    def append(self, batch: pa.RecordBatch, first_row: int, nbytes: int = 0) -> None:
        """Keep `batch` (no copy) as rows first_row .. first_row + num_rows - 1.

        `batch` must be in the store's schema (the buffer builds it). `nbytes` is what the
        batch keeps alive when it is part of a received message (its buffers are slices of
        one allocation, counted whole); 0: the batch's own buffers.
        """
        n = batch.num_rows
        if n == 0:
            return
        self._ensure(first_row + n, first_row)
        cid, self._next_chunk = self._next_chunk, self._next_chunk + 1
        self._chunks[cid] = _Chunk(batch, np.arange(first_row, first_row + n, dtype=np.int64),
                                   nbytes or batch.get_total_buffer_size())
        lo = first_row - self._base
        self._chunk_of[lo:lo + n] = cid
        self._position[lo:lo + n] = self._positions[:n] if n <= len(self._positions) else np.arange(n)
        if self.cfg.coalesce_after and n < self.cfg.small_chunk_rows:
            self._small.append(cid)

    def retire(self, rows: np.ndarray) -> None:
        """Forget `rows` (trained or dropped); frees or marks their chunks for rewriting."""
        if len(rows) == 0:
            return
        slots = rows - self._base
        cids = self._chunk_of[slots]
        self._chunk_of[slots] = -1
        ids, counts = np.unique(cids, return_counts=True)
        big = self.cfg.small_chunk_rows
        for cid, count in zip(ids.tolist(), counts.tolist()):
            chunk = self._chunks[cid]
            chunk.live -= count
            if chunk.live == 0:
                del self._chunks[cid]
            elif len(chunk.rows) >= big and chunk.live < (1 - REWRITE_DEAD_FRACTION) * len(chunk.rows):
                # small chunks are left to empty out or to be coalesced: rewriting a few rows
                # at a time would cost a copy call per producer batch on the serial path
                self._sparse.add(cid)

    # ----------------------------------------------------------------- rows out
    def take(self, rows: np.ndarray) -> pa.RecordBatch:
        """One record batch holding `rows` in the given order: a single copy of their bytes.

        Rows come in runs of consecutive positions of one chunk (a unit's rows arrive in one
        producer batch), so each run is a zero-copy slice and one concatenate copies them all.
        """
        if len(rows) == 0:
            return pa.RecordBatch.from_pylist([], schema=self.schema)
        slots = rows - self._base
        cids, positions = self._chunk_of[slots], self._position[slots]
        if cids.min() < 0:
            raise KeyError("take() asked for a retired row")
        breaks = np.flatnonzero((np.diff(cids) != 0) | (np.diff(positions) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [len(rows)])))
        chunks = self._chunks
        pieces = [chunks[c].batch.slice(p, k) for c, p, k in
                  zip(cids[starts].tolist(), positions[starts].tolist(), lengths.tolist())]
        return pa.concat_batches(pieces)

    def find(self, column: str, value) -> np.ndarray:
        """Live row ids whose `column` equals `value` (a vectorised scan of every chunk)."""
        found = []
        for cid, chunk in self._chunks.items():
            hits = pc.equal(chunk.batch.column(column), value).to_numpy(zero_copy_only=False)
            rows = chunk.rows[np.flatnonzero(hits)]
            rows = rows[rows >= self._base]
            found.append(rows[self._chunk_of[rows - self._base] == cid])
        return np.sort(np.concatenate(found)) if found else np.zeros(0, np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes held by the chunks plus the row maps."""
        return sum(c.nbytes + c.rows.nbytes for c in self._chunks.values()) + \
            self._chunk_of.nbytes + self._position.nbytes

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    # ----------------------------------------------------------------- memory
    def compact(self) -> None:
        """Rewrite mostly-retired chunks and coalesce small ones (each a single copy)."""
        for cid in self._sparse:
            chunk = self._chunks.pop(cid, None)
            if chunk is not None:
                live = self._live_positions(cid, chunk)
                self._place(_Chunk(chunk.batch.take(pa.array(live)), chunk.rows[live], 0))
        self._sparse.clear()
        if self.cfg.coalesce_after and len(self._small) >= self.cfg.coalesce_after:
            self._small = [c for c in self._small if c in self._chunks]
            if len(self._small) >= self.cfg.coalesce_after:
                self._coalesce(self._small)
                self._small = []

    def _coalesce(self, cids: list[int]) -> None:
        pieces, rows = [], []
        for cid in cids:
            chunk = self._chunks.pop(cid)
            live = self._live_positions(cid, chunk)
            whole = len(live) == len(chunk.rows)
            pieces.append(chunk.batch if whole else chunk.batch.take(pa.array(live)))
            rows.append(chunk.rows[live])
        self._place(_Chunk(pa.concat_batches(pieces), np.concatenate(rows), 0))

    def _live_positions(self, cid: int, chunk: _Chunk) -> np.ndarray:
        held = chunk.rows >= self._base
        live = np.zeros(len(chunk.rows), bool)
        live[held] = self._chunk_of[chunk.rows[held] - self._base] == cid
        return np.flatnonzero(live)

    def _place(self, chunk: _Chunk) -> None:
        """Register a chunk under a new id and point its rows at it."""
        if chunk.nbytes == 0:
            chunk.nbytes = chunk.batch.get_total_buffer_size()
        cid, self._next_chunk = self._next_chunk, self._next_chunk + 1
        self._chunks[cid] = chunk
        self._ensure(int(chunk.rows[-1]) + 1, int(chunk.rows[0]))
        slots = chunk.rows - self._base
        self._chunk_of[slots] = cid
        self._position[slots] = np.arange(len(slots))

    def _ensure(self, end_row: int, first_row: int) -> None:
        """Room for slots `first_row..end_row`: drop the retired prefix, grow by doubling."""
        if end_row - self._base <= len(self._chunk_of):
            return
        held = np.flatnonzero(self._chunk_of >= 0)
        shift = int(held[0]) if len(held) else len(self._chunk_of)
        # never past the rows being placed (an empty store given more rows than it has slots)
        shift = min(shift, first_row - self._base)
        size = len(self._chunk_of)
        while end_row - self._base - shift > size:
            size *= 2
        used = len(self._chunk_of) - shift
        chunk_of, position = np.full(size, -1, np.int64), np.zeros(size, np.int32)
        chunk_of[:used], position[:used] = self._chunk_of[shift:], self._position[shift:]
        self._chunk_of, self._position, self._base = chunk_of, position, self._base + shift

"""TSDB blocks written straight from the generated arrays, without the OpenMetrics text round trip.

promtool turns OpenMetrics text into blocks at a few microseconds a sample, parsing every file twice,
and formatting the text costs as much again: on a two-week fleet of 64 nodes that is most of a
benchmark run. This module writes what promtool would write (one block per 2-hour window, one XOR
chunk per series and window, the same samples) in Prometheus's on-disk format
(prometheus/tsdb/docs/format: index v2, chunks v1, meta.json v1), with the samples encoded by
numpy a batch at a time. Series whose values are identical share their encoded chunks (an idle
link's state, a zero counter), which the index allows: a chunk reference is only an offset.

``tests/evaluation/test_blocks.py`` holds it to promtool: both write the same families and
``promtool tsdb dump`` must read back the same samples from either.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from crc32c import crc32c

from gpuhealth.evaluation.openmetrics import BLOCK_SECONDS, Thinning
from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline

CHUNKS_HEADER = (0x85BD40DD).to_bytes(4, "big") + b"\x01\x00\x00\x00"  # magic, version 1, padding
INDEX_HEADER = (0xBAAAD700).to_bytes(4, "big") + b"\x02"  # magic, index format v2
TOMBSTONES = (0x0130BA30).to_bytes(4, "big") + b"\x01" + crc32c(b"").to_bytes(4, "big")  # none
XOR = b"\x01"  # the chunk encoding of float samples
BATCH_SAMPLES = 1 << 17  # samples encoded at once: the bit-level arrays take ~50 bytes a bit
_ULID_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")

Labels = tuple[tuple[str, str], ...]


def uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varint(n: int) -> bytes:
    return uvarint(2 * n if n >= 0 else -2 * n - 1)


def _string(text: str) -> bytes:
    raw = text.encode()
    return uvarint(len(raw)) + raw


def _section(content: bytes) -> bytes:
    """A length-prefixed, checksummed index section (``len <4b>``, content, ``CRC32C <4b>``)."""
    return len(content).to_bytes(4, "big") + content + crc32c(content).to_bytes(4, "big")


def _pad(buffer: bytearray, align: int) -> None:
    buffer.extend(b"\x00" * (-len(buffer) % align))


def parse_labels(name: str, text: str) -> Labels:
    """The label set of a series written as OpenMetrics label text, ``__name__`` included, sorted. A label
    with an empty value is no label in Prometheus (``netdev=""`` of an InfiniBand port), so it is left out."""
    pairs = {k: _UNESCAPE.sub(lambda m: "\n" if m[1] == "n" else m[1], v)
             for k, v in _LABEL.findall(text) if v}
    pairs["__name__"] = name
    return tuple(sorted(pairs.items(), key=lambda kv: kv[0].encode()))


def ulid(millis: int) -> str:
    value = (millis << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_ULID_ALPHABET[(value >> (5 * (25 - i))) & 31] for i in range(26))


# ---- XOR chunk encoding, vectorised ---------------------------------------------------------------


def _bit_length(u: np.ndarray) -> np.ndarray:
    x = u.copy()
    for shift in (1, 2, 4, 8, 16, 32):
        x |= x >> np.uint64(shift)
    return np.bitwise_count(x).astype(np.int64)


def _uvarint_fields(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each uvarint encoding of ``u`` as one big-endian bit field: (value, width in bits)."""
    count = np.maximum(1, (_bit_length(u) + 6) // 7)
    if (count > 8).any():
        raise ValueError("a timestamp beyond 2**56 ms cannot be encoded")
    out = np.zeros(u.size, np.uint64)
    for k in range(8):
        byte = ((u >> np.uint64(7 * k)) & np.uint64(0x7F)) | np.where(k < count - 1, 0x80, 0).astype(
            np.uint64
        )
        out = np.where(k < count, (out << np.uint64(8)) | byte, out)
    return out, 8 * count


def _pack(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Bit fields (each at most 64 bits wide) back to back, most significant bit first.

    A field lands in the 64-bit word where it starts and may spill into the next; fields are
    disjoint, so each word is the OR of the fields that start in it and the one spilling into it.
    """
    ends = np.cumsum(widths)
    begin = ends - widths
    word, offset = begin // 64, (begin % 64).astype(np.uint64)
    aligned = values << (64 - widths).astype(np.uint64)  # the field at the top of a word
    words = np.zeros(int(ends[-1] + 63) // 64, np.uint64)
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[starts]] = np.bitwise_or.reduceat(aligned >> offset, starts)
    spill = np.flatnonzero(offset.astype(np.int64) + widths > 64)
    words[word[spill] + 1] |= aligned[spill] << (np.uint64(64) - offset[spill])
    return words.astype(">u8").tobytes()


def encode_chunks(t: np.ndarray, v: np.ndarray, first: np.ndarray) -> tuple[bytes, np.ndarray]:
    """XOR-encode chunks as Prometheus's ``chunkenc.XORChunk`` does, all at once.

    ``t`` (int64 ms) and ``v`` hold the samples of consecutive chunks, ``first`` marks each chunk's
    first sample. Every sample is a row of bit fields (chunk header, timestamp control and payload,
    value control and payload, padding to a byte); values always carry their own leading/trailing
    zero counts (a choice the format leaves to the writer), so no field depends on an earlier one's
    choice. Returns the chunks' bytes, back to back, and the offset of each chunk's start and end.
    """
    n = t.size
    begin = np.flatnonzero(first)
    chunk = np.cumsum(first) - 1
    pos = np.arange(n) - begin[chunk]
    last = np.append(begin[1:], n) - 1
    values = np.zeros((n, 6), np.uint64)
    widths = np.zeros((n, 6), np.int64)
    values[begin, 0], widths[begin, 0] = np.diff(np.append(begin, n)), 16  # sample count, big-endian

    delta = np.zeros(n, np.int64)
    delta[1:] = t[1:] - t[:-1]
    dod = np.zeros(n, np.int64)
    dod[1:] = delta[1:] - delta[:-1]
    zero, one, more = pos == 0, pos == 1, pos >= 2
    zigzag = np.where(t >= 0, 2 * t, -2 * t - 1).astype(np.uint64)
    values[zero, 1], widths[zero, 1] = _uvarint_fields(zigzag[zero])  # first timestamp: varint
    values[one, 1], widths[one, 1] = _uvarint_fields(delta[one].astype(np.uint64))  # then a uvarint delta
    d = dod[more]  # then deltas of deltas in 0, 14, 17, 20 or 64 bits
    size = np.select(
        [
            d == 0,
            (d >= -(2**13 - 1)) & (d <= 2**13),
            (d >= -(2**16 - 1)) & (d <= 2**16),
            (d >= -(2**19 - 1)) & (d <= 2**19),
        ],
        [0, 14, 17, 20],
        64,
    )
    values[more, 1] = np.select(
        [size == 0, size == 14, size == 17, size == 20], [0b0, 0b10, 0b110, 0b1110], 0b1111
    )
    widths[more, 1] = np.select([size == 0, size == 14, size == 17], [1, 2, 3], 4)
    mask = np.where(size == 64, np.uint64(2**64 - 1), (np.uint64(1) << size.astype(np.uint64)) - np.uint64(1))
    values[more, 2], widths[more, 2] = d.astype(np.uint64) & mask, size

    bits = np.ascontiguousarray(v, dtype=np.float64).view(np.uint64)
    values[zero, 3], widths[zero, 3] = bits[zero], 64  # first value: its 64 bits
    xor = np.zeros(n, np.uint64)
    xor[1:] = bits[1:] ^ bits[:-1]
    x = xor[~zero]
    moved = x != 0
    lead = np.minimum(64 - _bit_length(x), 31)
    trail = np.maximum(_bit_length(x & (~x + np.uint64(1))) - 1, 0)
    meaningful = 64 - lead - trail
    control = (0b11 << 11) | (lead << 6) | (meaningful & 63)  # changed, new window, leading, length
    values[~zero, 3] = np.where(moved, control, 0).astype(np.uint64)
    widths[~zero, 3] = np.where(moved, 13, 1)
    values[~zero, 4] = np.where(moved, x >> trail.astype(np.uint64), np.uint64(0))
    widths[~zero, 4] = np.where(moved, meaningful, 0)

    chunk_bits = np.bincount(chunk, weights=widths.sum(axis=1), minlength=begin.size).astype(np.int64)
    widths[last, 5] = -chunk_bits % 8
    used = widths.ravel() > 0
    stream = _pack(values.ravel()[used], widths.ravel()[used])
    offsets = np.concatenate(([0], np.cumsum((chunk_bits + widths[last, 5]) // 8)))
    return stream, offsets


# ---- blocks ---------------------------------------------------------------------------------------


@dataclass
class _Window:
    """One block being written: its chunk file, and one chunk per distinct series content."""

    directory: Path
    handle: BinaryIO
    size: int
    content: list[int] = field(default_factory=list)  # per chunk: the content id it encodes
    ref: list[int] = field(default_factory=list)  # its offset in the chunk file
    mint: list[int] = field(default_factory=list)
    maxt: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)


@dataclass
class _Catalogue:
    """What every block's index shares: the symbols, the label pairs and each series' label entry."""

    symbols: bytes  # the symbol table section
    symbol: dict[str, int]
    pairs: list[tuple[str, str]]  # every label pair, in the postings' order
    labels: list[bytes]  # per series (sorted): its label count and symbol references
    content: np.ndarray  # per series: its content id
    flat_pairs: np.ndarray  # every series' label pairs, series after series
    flat_series: np.ndarray  # the series each of those belongs to

    @classmethod
    def of(cls, series: list[tuple[Labels, int]]) -> _Catalogue:
        symbols = sorted({text for labels, _ in series for pair in labels for text in pair}, key=str.encode)
        symbol = {text: i for i, text in enumerate(symbols)}
        pairs = sorted(
            {pair for labels, _ in series for pair in labels}, key=lambda p: (p[0].encode(), p[1].encode())
        )
        pair_id = {pair: i for i, pair in enumerate(pairs)}
        return cls(
            _section(len(symbols).to_bytes(4, "big") + b"".join(_string(s) for s in symbols)),
            symbol,
            pairs,
            [
                uvarint(len(labels)) + b"".join(uvarint(symbol[k]) + uvarint(symbol[v]) for k, v in labels)
                for labels, _ in series
            ],
            np.array([content for _, content in series], dtype=np.int64),
            np.array([pair_id[p] for labels, _ in series for p in labels], dtype=np.int64),
            np.repeat(np.arange(len(series)), [len(labels) for labels, _ in series]),
        )


def _uvarints(u: np.ndarray) -> list[bytes]:
    fields, widths = _uvarint_fields(u.astype(np.uint64))
    return [f.to_bytes(w // 8, "big") for f, w in zip(fields.tolist(), widths.tolist(), strict=True)]


class BlockWriter:
    """TSDB blocks of one timeline's families, one per 2-hour window, written family by family.

    Same interface as ``openmetrics.BlockFiles``: ``write`` each family with its thinning, then
    ``close`` returns the block directories (to move into a Prometheus data directory).
    """

    def __init__(self, directory: Path, timeline: Timeline) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeline = timeline
        self.windows: dict[int, _Window] = {}
        self.series: list[tuple[Labels, int]] = []  # label set, content id
        self.contents: dict[tuple[Thinning, tuple[float, float, int], bytes], int] = {}
        self.samples = 0
        self._queue: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # content, t, window, v
        self._queued = 0
        self._sizes: dict[int, int] = {}  # content id -> samples kept
        self._grids: dict[tuple[float, float, int], tuple[np.ndarray, np.ndarray]] = {}

    def _grid(self, timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
        """The timeline's instants in ms (whole seconds, as the text path wrote them) and windows."""
        key = (timeline.start, timeline.step, timeline.count)
        if key not in self._grids:
            unix = timeline.unix
            self._grids[key] = (unix.astype(np.int64) * 1000, (unix // BLOCK_SECONDS).astype(np.int64))
        return self._grids[key]

    def write(self, family: Family, thinning: Thinning, timeline: Timeline | None = None) -> None:
        """Add the family's series, sampled on ``timeline`` (the writer's by default); series with the
        same samples share their chunks. Blocks written already get the series at the next ``close``."""
        timeline = timeline or self.timeline
        millis, window = self._grid(timeline)
        grid = (timeline.start, timeline.step, timeline.count)
        for labels, values in family.series:
            values = np.ascontiguousarray(values, dtype=np.float64)
            key = (thinning, grid, hashlib.blake2b(values.data, digest_size=16).digest())
            content = self.contents.get(key)
            if content is None:
                content = self.contents[key] = len(self.contents)
                kept = np.flatnonzero(thinning.keep(values, timeline.step))
                # -0.0 reads back as 0, as it did from text
                self._queue.append((content, millis[kept], window[kept], values[kept] + 0.0))
                self._sizes[content] = kept.size
                self._queued += kept.size
                if self._queued >= BATCH_SAMPLES:
                    self._flush()
            self.series.append((parse_labels(family.name, labels), content))
            self.samples += self._sizes[content]

    def _open(self, window: int) -> _Window:
        """The window's block, its chunk file open for appending."""
        if window not in self.windows:
            directory = self.directory / ulid(window * BLOCK_SECONDS * 1000)
            (directory / "chunks").mkdir(parents=True)
            handle = (directory / "chunks" / "000001").open("wb")
            handle.write(CHUNKS_HEADER)
            self.windows[window] = _Window(directory, handle, len(CHUNKS_HEADER))
        target = self.windows[window]
        if target.handle.closed:
            target.handle = (target.directory / "chunks" / "000001").open("ab")
        return target

    def _flush(self) -> None:
        """Encode the queued contents and append their chunks to each window's chunk file."""
        queue = [item for item in self._queue if item[1].size]
        self._queue, self._queued = [], 0
        if not queue:
            return
        t, window, values = (np.concatenate([item[k] for item in queue]) for k in (1, 2, 3))
        owner = np.repeat(np.arange(len(queue)), [item[1].size for item in queue])
        first = np.ones(t.size, dtype=bool)
        first[1:] = (owner[1:] != owner[:-1]) | (window[1:] != window[:-1])
        data, offsets = encode_chunks(t, values, first)
        begin = np.flatnonzero(first)
        end = np.append(begin[1:], t.size) - 1
        lengths = _uvarints(np.diff(offsets))
        chunks = zip(
            offsets[:-1].tolist(), offsets[1:].tolist(), begin.tolist(), end.tolist(), lengths, strict=True
        )
        for a, b, first_sample, last_sample, length in chunks:
            target = self._open(int(window[first_sample]))
            body = XOR + data[a:b]
            target.content.append(queue[owner[first_sample]][0])
            target.ref.append(target.size)
            target.mint.append(int(t[first_sample]))
            target.maxt.append(int(t[last_sample]))
            target.samples.append(last_sample - first_sample + 1)
            framed = length + body + crc32c(body).to_bytes(4, "big")
            target.handle.write(framed)
            target.size += len(framed)

    def close(self) -> list[Path]:
        """Write (or write again, with the series added since) every block's index, meta.json and
        tombstones; return the block directories. Prometheus must not have them open meanwhile."""
        self._flush()
        for target in self.windows.values():
            target.handle.close()
        self.series.sort(key=lambda s: s[0])
        for (labels, _), (following, _) in itertools.pairwise(self.series):
            if labels == following:
                raise ValueError(f"series written twice: {dict(labels)}")
        catalogue = _Catalogue.of(self.series)
        return [self._finish(self.windows[window], catalogue) for window in sorted(self.windows)]

    def _finish(self, target: _Window, catalogue: _Catalogue) -> Path:
        """One block's index (format v2: symbols, series, label indices, postings, their tables, TOC)."""
        where = np.full(len(self.contents), -1, dtype=np.int64)
        where[target.content] = np.arange(len(target.content))
        chunk = where[catalogue.content]
        present = np.flatnonzero(chunk >= 0)
        chunk = chunk[present]
        mint, maxt, ref, samples = (
            np.array(x, dtype=np.int64)[chunk] for x in (target.mint, target.maxt, target.ref, target.samples)
        )
        metas = zip(
            _uvarints(np.where(mint >= 0, 2 * mint, -2 * mint - 1)),
            _uvarints(maxt - mint),
            _uvarints(ref),
            strict=True,
        )
        out = bytearray(INDEX_HEADER)
        toc = [len(out)]
        out += catalogue.symbols
        ids = np.full(len(self.series), -1, dtype=np.int64)
        toc.append(len(out) + -len(out) % 16)
        for s, (first, span, at) in zip(present.tolist(), metas, strict=True):
            entry = catalogue.labels[s] + b"\x01" + first + span + at  # one chunk
            out += b"\x00" * (-len(out) % 16)
            ids[s] = len(out) // 16
            out += uvarint(len(entry)) + entry + crc32c(entry).to_bytes(4, "big")
        chosen = ids[catalogue.flat_series] >= 0
        pair_of, series_id = catalogue.flat_pairs[chosen], ids[catalogue.flat_series[chosen]]
        order = np.argsort(pair_of, kind="stable")  # series ids already ascend within each pair
        pair_of, series_id = pair_of[order], series_id[order]
        starts = np.flatnonzero(np.diff(pair_of, prepend=-1))
        used = [catalogue.pairs[p] for p in pair_of[starts].tolist()]
        toc.append(len(out))  # label indices: the values of each name, for readers of format v1
        names: dict[str, list[str]] = {}
        for name, value in used:
            names.setdefault(name, []).append(value)
        label_offsets = []
        for name, values in names.items():
            _pad(out, 4)
            label_offsets.append((name, len(out)))
            refs = np.array([catalogue.symbol[v] for v in values], dtype=">u4").tobytes()
            out += _section((1).to_bytes(4, "big") + len(values).to_bytes(4, "big") + refs)
        toc.append(len(out))  # postings: every series first, then one list per label pair
        postings = []
        lists = [np.sort(ids[ids >= 0]), *np.split(series_id, starts[1:])]
        for pair, members in zip([("", ""), *used], lists, strict=True):
            _pad(out, 4)
            postings.append((pair, len(out)))
            out += _section(len(members).to_bytes(4, "big") + members.astype(">u4").tobytes())
        toc.append(len(out))
        out += _section(
            len(label_offsets).to_bytes(4, "big")
            + b"".join(uvarint(1) + _string(name) + uvarint(offset) for name, offset in label_offsets)
        )
        toc.append(len(out))
        out += _section(
            len(postings).to_bytes(4, "big")
            + b"".join(uvarint(2) + _string(k) + _string(v) + uvarint(offset) for (k, v), offset in postings)
        )
        table = b"".join(offset.to_bytes(8, "big") for offset in [*toc[:3], toc[4], toc[3], toc[5]])
        out += table + crc32c(table).to_bytes(4, "big")
        (target.directory / "index").write_bytes(bytes(out))
        (target.directory / "tombstones").write_bytes(TOMBSTONES)
        name = target.directory.name
        meta = {
            "ulid": name,
            "minTime": int(mint.min()),
            "maxTime": int(maxt.max()) + 1,
            "stats": {
                "numSamples": int(samples.sum()),
                "numSeries": int(present.size),
                "numChunks": int(present.size),
            },
            "compaction": {"level": 1, "sources": [name]},
            "version": 1,
        }
        (target.directory / "meta.json").write_text(json.dumps(meta, indent="\t"))
        return target.directory

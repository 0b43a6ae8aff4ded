"""TSDB blocks written from arrays read back, through Prometheus's own reader, as the samples given,
and the same as promtool's blocks from the OpenMetrics text of the same fleet."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpuhealth.evaluation.blocks import BlockWriter, encode_chunks, parse_labels
from gpuhealth.evaluation.fleet import promtool_blocks
from gpuhealth.evaluation.openmetrics import BlockFiles, Thinning
from gpuhealth.evaluation.rulefiles import load_rules
from gpuhealth.evaluation.scenario import load_scenario
from gpuhealth.evaluation.selection import Selection
from gpuhealth.evaluation.signals import Family, FleetSignals
from gpuhealth.evaluation.workload import Timeline
from gpuhealth.local.prometheus import find_binary

ROOT = Path(__file__).resolve().parents[2]
START, STEP = 1_767_571_200.0, 60.0


def dump(data: Path) -> list[str]:
    """Every sample of the TSDB at ``data`` as ``promtool tsdb dump`` prints it, sorted."""
    (data / "wal").mkdir(exist_ok=True)
    out = subprocess.run(
        [find_binary("promtool"), "tsdb", "dump", str(data)], capture_output=True, text=True, check=True
    )
    return sorted(out.stdout.splitlines())


def test_samples_read_back_exactly(tmp_path: Path) -> None:
    """Values of every kind (negative, signed zero, infinities, tiny, huge, fractional), gaps long
    enough for every timestamp encoding, two block windows, and series sharing one chunk."""
    count = 300  # five hours: three 2-hour windows
    rng = np.random.default_rng(3)
    wild = rng.normal(0, 1e6, count) * 10.0 ** rng.integers(-30, 30, count)
    wild[[5, 6, 7]] = [-0.0, math.inf, -math.inf]
    wild[[10, 11]] = [5e-324, 1.7976931348623157e308]
    wild[40:70] = np.nan  # a 30-minute gap: a delta of delta beyond 20 bits
    wild[150:152] = np.nan
    wild[200] = np.nan
    steps = np.round(np.cumsum(rng.integers(0, 3, count)) * 0.5, 1)  # repeats, small and odd moves
    flags = np.where(np.arange(count) % 97 == 0, 1.0, 0.0)
    family = Family(
        "probe",
        "gauge",
        [
            ('kind="wild"', wild),
            ('kind="steps"', steps),
            ('kind="flag",copy="a"', flags),
            ('kind="flag",copy="b"', flags),
        ],
    )
    writer = BlockWriter(tmp_path / "data", Timeline(START, STEP, count))
    writer.write(family, Thinning(0, 0))
    assert len(writer.close()) == 3
    expected = []
    for labels, values in family.series:
        text = "{" + ", ".join(f'{k}="{v}"' for k, v in parse_labels("probe", labels)) + "}"
        for i in np.flatnonzero(~np.isnan(values)):
            expected.append((text, values[i] + 0.0, int(START + STEP * i) * 1000))
    got = []
    for line in dump(tmp_path / "data"):
        text, value, stamp = line.rsplit(" ", 2)
        got.append((text, float(value), int(stamp)))
    assert sorted(got) == sorted(expected)
    assert writer.samples == len(expected)


def test_chunk_encoding_matches_the_reference_bytes() -> None:
    """The XOR chunk of (1000 ms, 1.5), (2000 ms, 1.5), (3500 ms, 2.25): count, varint timestamp,
    raw first value, uvarint delta, unchanged value bit, delta-of-delta 500 in 14 bits, new window."""
    t = np.array([1000, 2000, 3500], dtype=np.int64)
    v = np.array([1.5, 1.5, 2.25])
    data, offsets = encode_chunks(t, v, np.array([True, False, False]))
    bits = "".join(f"{b:08b}" for b in data[: offsets[1]])
    assert bits[:16] == f"{3:016b}"
    assert bits[16:32] == "11010000" + "00001111"  # varint(1000): zigzag 2000 in two 7-bit groups
    assert bits[32:96] == f"{np.float64(1.5).view(np.uint64):064b}"
    assert bits[96:104] == "11101000" and bits[104:112] == "00000111"  # uvarint(1000)
    assert bits[112] == "0"  # same value
    assert bits[113:129] == "10" + f"{500:014b}"
    xor = int(np.float64(1.5).view(np.uint64) ^ np.float64(2.25).view(np.uint64))
    lead, trail = 64 - xor.bit_length(), (xor & -xor).bit_length() - 1
    meaningful = 64 - lead - trail
    assert bits[129:142] == "11" + f"{lead:05b}" + f"{meaningful:06b}"
    assert bits[142 : 142 + meaningful] == f"{xor >> trail:0{meaningful}b}"
    assert set(bits[142 + meaningful :]) <= {"0"} and len(bits) % 8 == 0


@pytest.mark.timeout(600)
def test_fleet_blocks_equal_promtools(tmp_path: Path) -> None:
    """small.yaml under the shipped rules' write plan: the same samples as promtool's blocks."""
    scenario = load_scenario(ROOT / "bench/scenarios/small.yaml")
    selection = Selection.for_rules(load_rules(ROOT / "rules/generated/gpuhealth"), scenario.step)
    signals = FleetSignals(scenario)
    writer = BlockWriter(tmp_path / "direct", signals.timeline)
    files = BlockFiles(tmp_path / "text", signals.timeline)
    for family in signals.families(selection.family_wanted):
        selection.write(family, writer)
        selection.write(family, files)
    writer.close()
    promtool_blocks(files.close(), tmp_path / "promtool", "test", progress=False, workdir=tmp_path)
    direct = dump(tmp_path / "direct")
    assert len(direct) == writer.samples == files.samples > 100_000
    assert direct == dump(tmp_path / "promtool")


def test_series_added_later_go_into_the_same_blocks(tmp_path: Path) -> None:
    """A second write on another grid (records every 5 minutes) rewrites the indexes of the blocks
    already there: no block overlaps another, which Prometheus would merge while it serves queries."""
    writer = BlockWriter(tmp_path / "data", Timeline(START, STEP, 240))
    writer.write(Family("raw", "gauge", [('node="a"', np.arange(240.0))]), Thinning(0, 0))
    first = writer.close()
    writer.write(
        Family("record", "gauge", [('node="a"', np.full(48, 2.5))]), Thinning(0, 0), Timeline(START, 300, 48)
    )
    assert writer.close() == first and len(first) == 2
    with pytest.raises(ValueError, match="written twice"):
        writer.write(
            Family("record", "gauge", [('node="a"', np.ones(48))]), Thinning(0, 0), Timeline(START, 300, 48)
        )
        writer.close()
    lines = dump(tmp_path / "data")
    assert sum(line.startswith('{__name__="raw"') for line in lines) == 240
    assert sum(line.startswith('{__name__="record"') and " 2.5 " in line for line in lines) == 48

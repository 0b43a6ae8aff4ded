"""`gpuhealth demo`'s arguments: a demo that cannot be played is refused at once, with the reason, before
any daemon starts; `--help` says what `--shards` shows, and the live screen which shard scrapes a node."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhealth.demo.cli import _draw
from gpuhealth.demo.observe import Observer, Snapshot
from gpuhealth.demo.sharded import ShardedStack
from gpuhealth.demo.stack import StackOptions

GPUHEALTH = Path(sys.executable).with_name("gpuhealth")


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUHEALTH, "demo", *args], capture_output=True, text=True, timeout=60, check=False)


def test_help_says_what_the_sharded_demo_shows():
    result = _demo("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for words in ("--shards N", "hashmod", "VictoriaMetrics", "vmalert", "which shard scrapes which node",
                  "GPUHealthLemonNode"):
        assert words in text


@pytest.mark.parametrize(("args", "reason"), [
    (("--shards", "3", "--nodes", "5"), "--shards 3 needs --nodes 6 or more"),
    (("--shards", "2", "--fault", "sbe_burst"), "--fault must be a fault, not the noise 'sbe_burst'"),
    (("--shards", "0"), "--shards must be at least 1"),
    (("--nodes", "1"), "--nodes must be at least 2"),
])
def test_a_demo_that_cannot_be_played_is_refused_before_anything_starts(tmp_path, args, reason):
    result = _demo(*args, "--headless", "--workdir", str(tmp_path / "demo"))
    assert result.returncode == 2
    assert reason in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()


def test_live_screen_shows_the_shard_of_each_node(tmp_path, capsys):
    stack = ShardedStack(StackOptions(nodes=4), workdir=tmp_path / "demo", shards=2)
    stack.shard_of = {"node01": "shard-1", "node02": "shard-0", "node03": "shard-0", "node04": "shard-1"}
    observer = Observer(stack)
    snap = Snapshot(observer.started, node_states={"node02": ("IDLE+DRAIN", "gpuhealth: ...")},
                    alerts={("GPUHealthLemonNode", "node01", "", "replace")})
    _draw(stack, observer, snap)
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.startswith("node")}
    assert rows["node02"][:2] == ["shard-0", "IDLE+DRAIN"]
    assert rows["node01"][0] == "shard-1" and rows["node01"][-1] == "GPUHealthLemonNode"
    assert [rows[n][0] for n in ("node03", "node04")] == ["shard-0", "shard-1"]

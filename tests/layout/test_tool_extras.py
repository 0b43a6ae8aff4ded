"""Without the ``tools`` extra (numpy, psutil, matplotlib) the gpuhealth tool still generates rules
and dashboards, and the subcommands that need the extra say what to install instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

HIDE_TOOLS = ("import sys\n"
              "for name in ('numpy', 'psutil', 'matplotlib'):\n"
              "    sys.modules[name] = None\n"
              "from gpuhealth.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


def gpuhealth(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE_TOOLS, *argv], capture_output=True, text=True,
                          timeout=120)


def test_generators_run_without_the_tools_extra():
    assert gpuhealth("rules", "generate", "--check").returncode == 0
    dashboards = gpuhealth("dashboards", "generate", "--check")
    assert dashboards.returncode == 0, dashboards.stderr


def test_help_lists_what_the_tools_extra_would_enable():
    result = gpuhealth("--help")
    assert result.returncode == 0, result.stderr
    assert "unavailable: 'gpuhealth eval' needs numpy: pip install 'gpuhealth[tools]'" in " ".join(
        result.stdout.split())


def test_a_subcommand_without_its_extra_says_what_to_install():
    for argv in (["eval", "--scenario", "bench/scenarios/small.yaml"], ["eval", "--help"], ["-v", "eval"]):
        result = gpuhealth(*argv)
        assert result.returncode == 2, argv
        assert "pip install 'gpuhealth[tools]'" in result.stderr
        assert "Traceback" not in result.stderr

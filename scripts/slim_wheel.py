"""Drop from a wheel what pdserve never loads, in place: ``python scripts/slim_wheel.py WHEEL``.

For libucx (scripts/gpu-check --wheels): its static libraries, command-line tools and perftest
modules are 24 of its 42 MB, and a device call carries at most 64 MiB. The wheel's RECORD loses
the same rows, so pip installs what is left as usual.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

DROP = re.compile(r"\.l?a$|/bin/|perftest")


def slim(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if DROP.search(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in data.decode().splitlines() if not DROP.search(r.split(",")[0])]
                data = ("\n".join(rows) + "\n").encode()
            out.writestr(info, data)
    tmp.replace(path)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        slim(Path(name))

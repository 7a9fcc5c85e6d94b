"""Print a pip constraints file that pins each dependency of pyproject.toml to its floor.

``mlx-lm>=0.32.0`` becomes ``mlx-lm==0.32.0``; a dependency with no floor, or whose marker
does not hold on this machine, is left to pip. `make check-floors` installs kvchat with
these constraints into a venv of its own and runs the engine and store tests there, so the
floors pyproject.toml declares are ones the code was tested with.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement


def floors(pyproject: Path) -> list[str]:
    """``name==floor`` for each dependency of ``pyproject`` with a ``>=`` floor here."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = []
    for line in project["dependencies"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        floor = [s.version for s in req.specifier if s.operator == ">="]
        if floor:
            pins.append(f"{req.name}=={floor[0]}")
    return pins


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(floors(root / "pyproject.toml")))

"""Check what ``python -m build`` made (usage: check_dist.py DIST_DIR): one wheel and one sdist
named as ``onepass.DISTRIBUTION`` at ``onepass.__version__``; the wheel holds every module of
src/onepass, its py.typed and the LICENSE, the ``onepass`` command, and nothing beside the
package; the sdist holds what the wheel is built from."""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from onepass import DISTRIBUTION, __version__  # noqa: E402  (the source tree's, not an installed one)


def main(dist: Path) -> None:
    stem = f"{DISTRIBUTION.replace('-', '_')}-{__version__}"
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert [w.name for w in wheels] == [f"{stem}-py3-none-any.whl"], wheels
    assert [s.name for s in sdists] == [f"{stem}.tar.gz"], sdists
    modules = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "onepass").rglob("*.py")}
    info = f"{stem}.dist-info"

    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
        metadata = HeaderParser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    missing = modules - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    for name in ("onepass/py.typed", f"{info}/licenses/LICENSE"):
        assert name in names, f"the wheel lacks {name}"
    stray = sorted(n for n in names if not n.startswith(("onepass/", f"{info}/")))
    assert not stray, f"the wheel holds files beside the package: {stray}"
    assert metadata["Name"] == DISTRIBUTION and metadata["Version"] == __version__, (metadata["Name"],
                                                                                     metadata["Version"])
    assert "onepass = onepass.cli:main" in entry_points, entry_points

    with tarfile.open(sdists[0]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    missing = {"LICENSE", "README.md", "pyproject.toml", "src/onepass/py.typed", *(f"src/{m}" for m in modules)} - names
    assert not missing, f"the sdist lacks {sorted(missing)}"
    print(f"{wheels[0].name} ({len(modules)} modules, py.typed, LICENSE) and {sdists[0].name}: ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

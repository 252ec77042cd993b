"""The distributions as a user gets them (issue 32): the library's and the tooling's
wheel and sdist built from this checkout, their metadata checked by ``twine check
--strict``, the MIT licence inside every archive, only the runtime extras in the wheel's
metadata, and the built wheel with one extra installed into a fresh virtualenv (no
system site-packages, no PYTHONPATH), where the adapter imports and constructs.

Needs ``build`` and ``twine`` (the ``test`` dependency group) and a package index for
the fresh venv's dependencies (and for hatchling when it is not installed here: the
build is then isolated).
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds four archives and installs one into a new venv

ROOT = Path(__file__).resolve().parent.parent
LICENSE = (ROOT / "LICENSE").read_text(encoding="utf-8")
# The Pythons CI runs the suite on (.ci/run -> scripts/test.sh with the machine's
# python3): the only versions the classifiers may claim.
CI_PYTHONS = {"3.11"}
GUARD = 900.0  # seconds a build or an install may take before the test fails (a guard)


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=GUARD,
        check=False,
    )
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _build(project: Path, out: Path) -> tuple[Path, Path]:
    """``python -m build`` of ``project`` into ``out``: (wheel, sdist)."""
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-isolation"]
    out.mkdir(parents=True, exist_ok=True)
    _run(sys.executable, "-m", "build", *isolation, "--outdir", out, project, cwd=out)
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    built = sorted(p.name for p in out.iterdir())
    assert len(wheels) == 1, built
    assert len(sdists) == 1, built
    return wheels[0], sdists[0]


def _wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.HeaderParser().parsestr(archive.read(name).decode())


def _wheel_licence(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        return archive.read(name).decode()


def _sdist_licence(sdist: Path) -> str:
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"{top}/LICENSE")
        assert member is not None, f"{sdist.name} has no {top}/LICENSE"
        return member.read().decode()


@pytest.mark.parametrize("project", ["library", "tooling"])
def test_the_archives_pass_twine_and_carry_the_licence(project: str, tmp_path: Path) -> None:
    source = ROOT if project == "library" else ROOT / "tooling"
    wheel, sdist = _build(source, tmp_path)
    checked = _run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, cwd=tmp_path)
    assert checked.count("PASSED") == 2, checked
    assert (source / "LICENSE").read_text(encoding="utf-8") == LICENSE  # one licence text
    assert "MIT License" in LICENSE
    assert _wheel_licence(wheel) == LICENSE
    assert _sdist_licence(sdist) == LICENSE

    meta = _wheel_metadata(wheel)
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    declared = tomllib.loads((source / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(declared["project"].get("optional-dependencies", {}))
    assert set(meta.get_all("Provides-Extra") or []) == extras
    assert not extras & {"test", "bench", "docs", "lint", "testing"}, extras
    pythons = {
        c.rsplit("::", 1)[1].strip()
        for c in meta.get_all("Classifier") or []
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert pythons == CI_PYTHONS, f"classifiers claim {pythons}, CI runs {CI_PYTHONS}"
    # no placeholder author (none is known yet: the field is left out rather than made up)
    for field in ("Author", "Author-email", "Maintainer", "Maintainer-email"):
        assert "developers" not in (meta.get(field) or ""), meta.get(field)


def test_the_wheel_installs_with_one_extra_into_a_fresh_venv(tmp_path: Path) -> None:
    wheel, _ = _build(ROOT, tmp_path / "dist")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)  # no --system-site-packages
    python = venv / "bin" / "python"
    # nothing of this checkout on the path: the import must come from the installed wheel
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run(python, "-m", "pip", "install", "-q", f"{wheel}[langchain]", cwd=tmp_path, env=env)
    shown = _run(
        python,
        "-c",
        "import qwen_embed_plugins\n"
        "from qwen_embed_plugins import QwenPooledEmbeddings\n"
        "e = QwenPooledEmbeddings(base_url='http://127.0.0.1:9/v1')\n"  # opens nothing
        "print(qwen_embed_plugins.__file__)\n"
        "print(type(e).__name__, e.base_url)\n",
        cwd=tmp_path,
        env=env,
    ).splitlines()
    assert Path(shown[0]).is_relative_to(venv), shown
    assert shown[1] == "QwenPooledEmbeddings http://127.0.0.1:9/v1", shown

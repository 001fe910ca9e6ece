"""`pip install` (and `-e`) prints no packaging warnings: the build backend's hooks run on a copy
of the project, with every Python warning an error (pip >= 25 prints a backend's warnings: that is
how a deprecated pyproject.toml, or setuptools' InformationOnly notice on an editable install with a
meta path finder, reached the terminal) and no line of the log a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]
print(build_meta.build_wheel(out))
print(build_meta.build_editable(out))
"""


@pytest.mark.slow
def test_build_backend_prints_no_warning(tmp_path: Path) -> None:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # what pyproject.toml's build-system requires
        pytest.skip(f"setuptools {setuptools.__version__} < 77")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "pyproject.toml", project)
    shutil.copy(ROOT / "README.md", project)
    shutil.copytree(ROOT / "pdserve", project / "pdserve", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, "-W", "error", "-c", _BUILD, str(out)], cwd=project,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout + result.stderr
    # NOTE: "byte-compiling is disabled" is PYTHONDONTWRITEBYTECODE's, not the project's
    warnings = [line for line in text.splitlines()
                if "warning" in line.lower() and "byte-compiling is disabled" not in line]
    assert not warnings, text
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert len(wheels) == 2 and "editable" in wheels[0] and "editable" not in wheels[1], wheels

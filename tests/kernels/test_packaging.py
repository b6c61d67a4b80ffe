"""The wheel installs the repository's kernels/ folder as lazyrag.kernels, never as a top-level
`kernels` package (that name belongs to another project on PyPI)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_kernels_inside_lazyrag(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "cwd"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = wheels.glob("lazyrag-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("kernels/")], "a top-level kernels package"
    assert {f"lazyrag/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")} <= set(names)

    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", "import lazyrag.kernels as k; print(k.__file__)"], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).is_relative_to(target), run.stdout  # the wheel's copy, not the checkout


def test_the_checkout_never_shadows_the_pypi_kernels_package(tmp_path):
    """transformers >= 5.25 imports the PyPI `kernels`; inside the checkout, and also once something puts the
    checkout first on sys.path (Ray does, for its workers), `import kernels` must find that one, not kernels/."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("ORIGIN = 'pypi'\n")
    code = "import sys, lazyrag; sys.path.insert(0, sys.argv[1]); import kernels; print(kernels.ORIGIN)"
    run = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "pypi"

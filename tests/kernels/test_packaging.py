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


def test_the_checkout_never_shadows_the_pypi_kernels_package():
    """transformers >= 5.25 imports the PyPI `kernels`; run inside the checkout, `import kernels` would find
    the repository's folder unless importing lazyrag takes the checkout off sys.path."""
    code = ("import importlib.util, lazyrag; spec = importlib.util.find_spec('kernels'); "
            "print(spec.origin if spec else '')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not run.stdout.strip().startswith(str(ROOT / "kernels")), run.stdout

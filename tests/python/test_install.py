"""The package installed from the checkout into a new virtual environment
imports and runs a call outside the checkout."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build_compiler():
    cache = Path(os.environ.get("BUILD_DIR", ROOT / "build")) / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.startswith("CMAKE_CXX_COMPILER:"):
                return line.split("=", 1)[1]
    return None


@pytest.mark.skipif(os.environ.get("DIMATTN_SKIP_VENV_TEST") == "1", reason="DIMATTN_SKIP_VENV_TEST=1")
def test_fresh_venv_install(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # torch and the build backend from this environment (no second 1 GB
    # download): the new venv sees its site-packages through a .pth file.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    Path(site, "dimattn_test_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DIMATTN_TORCH_OPS", "PYTHONPATH")}
    env.update(CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("DIMATTN_JOBS", "2"), CCACHE_BASEDIR=str(ROOT),
               CCACHE_NOHASHDIR="1")
    # scikit-build-core takes Python's compiler (g++) unless CXX is set; the
    # compiler scripts/build used lets ccache reuse its objects (ccache keys on
    # the compiler's name too), so the wheel build costs seconds, not minutes.
    env.setdefault("CXX", _build_compiler() or "c++")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", str(ROOT)],
                   check=True, env=env, cwd=tmp_path)
    script = (
        "import torch, dimattn as da\n"
        "b, t, f = da.Dim('batch', 2), da.Dim('time', 5), da.Dim('feat', 8)\n"
        "x = da.Tensor(torch.randn(2, 5, 8), [b, t, f])\n"
        "out = da.dot_attention(x, x, x, key_dim=f, axis=t, causal_query_spatial_dim=t)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(x.raw, x.raw, x.raw, is_causal=True)\n"
        "assert (out.raw - ref).abs().max() < 1e-5, out\n"
        "print(dimattn_file := da.__file__)\n")
    result = subprocess.run([str(py), "-c", script], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.stdout.strip().startswith(str(venv)), result.stdout  # the installed copy, not the checkout's

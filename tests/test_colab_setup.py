"""The Colab path, simulated: a notebook's setup cell runs in a fresh Python environment that has torch,
triton and numpy already (as Colab has) but not the course's package, which the cell installs from a git
URL at the course's release tag, here a local repository made from this checkout."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import notebooks  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git, as pip's git+ URLs do")

PREINSTALLED = ("torch", "triton", "numpy")
REPORT = """
import importlib.metadata as md, importlib.util, json
print(json.dumps({"kernelcourse": importlib.util.find_spec("kernelcourse") is not None,
                  **{d: [md.version(d), str(md.distribution(d).locate_file(""))] for d in %r}}))
""" % (PREINSTALLED,)


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """(python, env, folder) of a fresh virtual environment that sees this one's libraries but no kernelcourse."""
    where = tmp_path_factory.mktemp("colab")
    # Without ensurepip (which some Linux distributions leave out): pip comes from this environment too.
    venv.EnvBuilder(with_pip=False).create(where / "env")
    python = str(where / "env" / "bin" / "python")
    purelib = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      text=True).strip()
    # Colab's preinstalled torch, triton, numpy and pip are this environment's: its site-packages joins the
    # path as a plain folder, so its .pth files (an editable install of the course among them) are not read.
    Path(purelib, "preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM", "KC_GRADE_IN_PROCESS")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if _has_setuptools_for_the_build():
        # Offline, as on a GPU machine without network: pip builds the package with this environment's
        # setuptools instead of fetching one into an isolated build environment. (pip reads the value of
        # PIP_NO_BUILD_ISOLATION inverted: "0" turns build isolation off.) Colab's pip isolates the build;
        # nothing else differs.
        env.update(PIP_NO_BUILD_ISOLATION="0", PIP_NO_INDEX="1")
    return python, env, where


def _has_setuptools_for_the_build() -> bool:
    import importlib.metadata as md
    import re

    try:
        version = md.version("setuptools")
    except md.PackageNotFoundError:
        return False
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2]) >= (64, 0)  # pyproject.toml's build requirement


def _report(python, env) -> dict:
    return json.loads(subprocess.check_output([python, "-c", REPORT], env=env, text=True))


def _setup_cell(url: str) -> str:
    """The setup cell of a lesson as committed, pointed at ``url`` instead of the course's address."""
    nb = nbformat.read(ROOT / "notebooks" / "01_vector_add.ipynb", as_version=4)
    cell = next(c for c in nb.cells if notebooks.is_bootstrap(c)).source
    configured = f"git+{notebooks.config()['repository']['url']}@{notebooks.release_ref()}"
    assert configured in cell, "the lesson's setup cell is not the one tools/notebooks.py writes"
    return cell.replace(configured, url)


def _local_release(where: Path) -> Path:
    """A git repository holding this checkout's package, tagged as the course's release."""
    repo = where / "course"
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    git = ["git", "-C", str(repo), "-c", "user.name=course", "-c", "user.email=course@localhost",
           "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "release"], check=True)
    subprocess.run([*git, "tag", notebooks.release_ref()], check=True)
    return repo


def test_setup_cell_says_in_one_sentence_what_to_do_when_the_install_fails(colab):
    python, env, where = colab
    assert not _report(python, env)["kernelcourse"]
    url = f"git+{(where / 'not-published').as_uri()}@{notebooks.release_ref()}"
    run = subprocess.run([python, "-c", _setup_cell(url)], env=env, cwd=where, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("Could not install the course's helper package") and "pip install -e" in lines[0]
    assert "Traceback" not in run.stderr and "CalledProcessError" not in run.stderr


def test_setup_cell_installs_the_release_and_leaves_torch_triton_numpy_alone(colab):
    python, env, where = colab
    before = _report(python, env)
    assert not before["kernelcourse"], "the fresh environment already sees kernelcourse"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    listed = set(os.listdir(site))
    url = f"git+{_local_release(where).as_uri()}@{notebooks.release_ref()}"
    run = subprocess.run([python, "-c", _setup_cell(url)], env=env, cwd=where, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "torch" in run.stdout and "numpy" in run.stdout, run.stdout  # kc.setup()'s banner
    after = _report(python, env)
    assert after["kernelcourse"]
    assert {d: after[d] for d in PREINSTALLED} == {d: before[d] for d in PREINSTALLED}  # same versions, same place
    added = set(os.listdir(site)) - listed
    assert added and all(name.startswith("kernelcourse") for name in added), added

"""Installed, k3rl is one namespace: ``k3rl.model``, ``k3rl.rl``, ... and nothing at the top of site-packages.

The folders stay at the repository's top level; pyproject.toml maps them (``package-dir``) and lists every
package, so a folder with an ``__init__.py`` missing from the list would be missing from a wheel. A user's own
``model.py`` (or ``rl.py``, ``envs.py``) in the working directory must not shadow k3rl's modules, and
``kernels`` stays free for Hugging Face's kernel-hub package that transformers probes for.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("util", "kernels", "model", "envs", "rollout", "rl")


def test_pyproject_lists_every_package_under_the_namespace():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {f"k3rl.{f}": f for f in FOLDERS}
    on_disk = {".".join(("k3rl", *p.parent.relative_to(ROOT).parts))
               for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")}
    assert set(tool["packages"]) == on_disk, (sorted(on_disk - set(tool["packages"])), sorted(set(tool["packages"]) - on_disk))


def test_only_the_namespace_is_importable_and_a_users_model_py_does_not_shadow_it(tmp_path):
    # not kernels.py: transformers itself imports a `kernels` it finds (Hugging Face's kernel hub), k3rl or not
    for name in set(FOLDERS) - {"kernels"}:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    probe = (
        "import importlib, sys\n"
        "sys.path = [p for p in sys.path if p not in ('', '.')]\n"  # the bare names must not come from anywhere else
        f"for name in {FOLDERS!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'a top-level {name!r} is installed')\n"
        "sys.path.insert(0, '')\n"  # now the user's files are first on the path, as for `python script.py`
        "import k3rl.model, k3rl.rl.commands.cli, k3rl.envs, k3rl.kernels.kda, k3rl.rollout.agent_loop, k3rl.util\n"
        "from k3rl.model import K3ForCausalLM\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    # the CLI from that directory: the user's model.py and envs.py stay unimported
    cli = subprocess.run([str(Path(sys.executable).with_name("k3rl")), "envs"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0 and "needle" in cli.stdout, cli.stderr[-2000:]

"""MkDocs hooks for the site ``make docs`` builds.

* The API reference reads the package from a staged tree, ``build/docs-src/shardprop``: links to every entry of
  ``shardprop/`` plus ``mesh`` and ``ops``, which install as ``shardprop.mesh`` / ``shardprop.ops`` (setuptools
  ``package-dir``) and so are invisible to mkdocstrings' static analysis of the folders as they lie. Static
  analysis keeps the build fast (torch is never imported) and the signatures as written.
* The images benchmarks write under ``bench/`` (``bench/scale.png``) join the site as ``bench/NAME``: a page
  shows the file the benchmark wrote, never a copy that could fall behind.
"""
import os
import pathlib

from mkdocs.structure.files import File

_ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGE = _ROOT / "build" / "docs-src"


def _stage_package():
    pkg = STAGE / "shardprop"
    pkg.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (_ROOT / "shardprop").iterdir() if p.name != "__pycache__"}
    wanted.update(mesh=_ROOT / "mesh", ops=_ROOT / "ops")
    for link in pkg.iterdir():  # entries removed from the tree since the last build
        if link.name not in wanted:
            link.unlink()
    for name, target in wanted.items():
        link = pkg / name
        if not (link.is_symlink() and os.readlink(link) == str(target)):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target)


# At import, before any plugin asks for the package: mkdocs loads hooks while it reads the config.
_stage_package()


def on_files(files, config):
    for png in sorted((_ROOT / "bench").glob("*.png")):
        files.append(File(f"bench/{png.name}", str(_ROOT), config["site_dir"], config["use_directory_urls"]))
    return files

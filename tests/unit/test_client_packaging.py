"""The client distribution's metadata stays in step with the server distribution's."""

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def test_client_and_server_share_version_and_dependency_bounds():
    server = _project(ROOT / "pyproject.toml")
    client = _project(ROOT / "packaging" / "client" / "pyproject.toml")
    assert client["version"] == server["version"]
    server_deps = {Requirement(r).name: Requirement(r).specifier for r in server["dependencies"]}
    for requirement in map(Requirement, client["dependencies"]):
        assert server_deps[requirement.name] == requirement.specifier, requirement.name


def test_client_sources_map_onto_the_servers_packages():
    server = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    client = tomllib.loads((ROOT / "packaging" / "client" / "pyproject.toml").read_text())["tool"]["setuptools"]
    client_root = ROOT / "packaging" / "client"
    for package, directory in client["package-dir"].items():
        assert (client_root / directory).resolve() == (ROOT / server[package]).resolve(), package

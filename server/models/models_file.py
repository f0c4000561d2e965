"""The models file (`--config models.toml`, env ENCODERD_CONFIG): one table per served model.

    [models.mini]                      # the served name
    source = "/models/all-MiniLM-L6-v2"  # a local directory or a hub id
    engine = "onnx"
    dtype = "int8"
    device = ["cpu"]                   # or "cuda:0,cuda:1"
    prompts = { query = "query: " }

    [models.rr]
    source = "BAAI/bge-reranker-base"
    revision = "main"
    dtype = "float32"

Every other key is a per-model flag's name (server/models/model_options.py MODEL_OPTIONS), checked by the
same parser as the flag. YAML (`.yaml` / `.yml`, with PyYAML installed) takes the same shape. Every
error names the file and the line of the offending key.
"""

from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from ...workers.contract.model_files import revision_misplaced
from ..base.config import ModelConfig
from .model_options import MODEL_OPTIONS

FILE_ONLY_KEYS = ("source", "prompts")
KEYS = (*FILE_ONLY_KEYS, *MODEL_OPTIONS)


class ModelsFileError(ValueError):
    """A models file that cannot be read or says something we cannot serve; its message names file:line."""


@dataclass(frozen=True)
class ModelsFile:
    path: str
    models: tuple[ModelConfig, ...]
    lines: dict[tuple, int]  # key path ("models", NAME, KEY) -> its line (1-based)

    def where(self, *keys: str) -> str:
        """`path:line` of a key path, else of its nearest enclosing table that has a line."""
        path = ("models", *keys)
        while path and path not in self.lines:
            path = path[:-1]
        return f"{self.path}:{self.lines[path]}" if path else self.path


def load_models_file(path: str) -> ModelsFile:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelsFileError(f"cannot read the models file {path}: {exc.strerror or exc}") from None
    yaml = path.endswith((".yaml", ".yml"))
    data, lines = _parse_yaml(path, text) if yaml else _parse_toml(path, text)
    return ModelsFile(path, tuple(_models(data, ModelsFile(path, (), lines))), lines)


# ------------------------------------------------------------------ formats
def _parse_toml(path: str, text: str) -> tuple[dict, dict[tuple, int]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ModelsFileError(f"{path}: a TOML models file needs Python 3.11 or newer (tomllib)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        where = f"{path}:{found.group(1)}" if found else path
        raise ModelsFileError(f"{where}: not valid TOML: {str(exc).split(' (at ')[0]}") from None
    return data, _toml_lines(text)


def _toml_lines(text: str) -> dict[tuple, int]:
    """The line of each table header and key, by a line scan that lets tomllib parse each header or
    key on its own (so quoting and dotted keys read as TOML reads them). Multi-line values are not
    followed: a line inside one is only ever a later, unused, candidate."""
    import tomllib

    lines: dict[tuple, int] = {}
    table: tuple = ()
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("["):
            header = _key_path(stripped, tomllib)
            if header is not None:
                table = header
                lines.setdefault(table, number)
        elif "=" in stripped and not stripped.startswith("#"):
            key = _key_path(stripped.partition("=")[0] + "= 0", tomllib)
            if key is not None:
                lines.setdefault(table + key, number)
    return lines


def _key_path(snippet: str, tomllib) -> tuple | None:
    try:
        node = tomllib.loads(snippet)
    except tomllib.TOMLDecodeError:
        return None
    path: tuple = ()
    while isinstance(node, (dict, list)) and node:
        if isinstance(node, list):
            node = node[-1]
            continue
        key = next(iter(node))
        path, node = (*path, key), node[key]
    return path


def _parse_yaml(path: str, text: str) -> tuple[dict, dict[tuple, int]]:
    try:
        import yaml
    except ModuleNotFoundError:
        raise ModelsFileError(
            f"{path}: a YAML models file needs PyYAML (pip install pyyaml); or write it as TOML (models.toml)"
        ) from None
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ModelsFileError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    lines: dict[tuple, int] = {}

    def walk(node, prefix: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                where = (*prefix, key.value)
                if where in lines:  # PyYAML keeps the last silently; TOML refuses a repeated key, and so do we
                    raise ModelsFileError(_repeated_key(path, where, key.start_mark.line + 1, lines[where]))
                lines[where] = key.start_mark.line + 1
                walk(value, where)

    walk(root, ())
    return data if data is not None else {}, lines


def _repeated_key(path: str, where: tuple, line: int, first: int) -> str:
    if len(where) == 2 and where[0] == "models":
        what = f"model {where[1]!r} is defined twice"
    else:
        what = f"key {'.'.join(map(str, where))!r} is given twice"
    return f"{path}:{line}: {what} (first at line {first}); one entry would silently replace the other"


# ------------------------------------------------------------------ contents
def _models(data, file: ModelsFile) -> list[ModelConfig]:
    if not isinstance(data, dict):
        raise ModelsFileError(f"{file.path}: expected a `models` table, one entry per served model")
    for key in data:
        if key != "models":
            raise ModelsFileError(
                f"{_top(file, key)}: unknown top-level key "
                f"{key!r}: the file holds `models` only (server-wide settings are flags)"
            )
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise ModelsFileError(
            f"{file.where()}: `models` must hold one table per served model, "
            'e.g. [models.NAME] with source = "PATH_OR_HUB_ID"'
        )
    return [_model(str(name), table, file) for name, table in models.items()]


def _top(file: ModelsFile, key: str) -> str:
    return f"{file.path}:{file.lines[(key,)]}" if (key,) in file.lines else file.path


# What `--FLAG NAME=VALUE`, `--model NAME=PATH@DEVICES` and ENCODERD_MODEL split on: not in a name.
NAME_SEPARATORS = "=@;,"


def _model(name: str, table, file: ModelsFile) -> ModelConfig:
    if not name:
        raise ModelsFileError(f"{file.where(name)}: a model's name is empty")
    if held := [c for c in NAME_SEPARATORS if c in name]:
        raise ModelsFileError(
            f"{file.where(name)}: model name {name!r} holds {' '.join(held)}, which the NAME=VALUE flags and "
            "ENCODERD_MODEL split on: choose a name without it"
        )
    if not isinstance(table, dict):
        raise ModelsFileError(
            f"{file.where(name)}: model {name!r} must be a table of settings, "
            f'e.g. [models.{name}] with source = "PATH_OR_HUB_ID"'
        )
    for key in table:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(KEYS)}"
            raise ModelsFileError(f"{file.where(name, key)}: model {name!r}: unknown key {key!r}{hint}")
    source = table.get("source")
    if not isinstance(source, str) or not source:
        raise ModelsFileError(
            f'{file.where(name, "source")}: model {name!r} needs source = "PATH_OR_HUB_ID" '
            "(a local directory or a hub id)"
        )
    values = {
        option.field: _value(name, key, table[key], option, file)
        for key, option in MODEL_OPTIONS.items()
        if key in table
    }
    if misplaced := revision_misplaced(source, values.get("revision")):
        raise ModelsFileError(f"{file.where(name, 'revision')}: model {name!r}: {misplaced}")
    return ModelConfig(name=name, source=source, prompts=_prompts(name, table.get("prompts", {}), file), **values)


def _value(name: str, key: str, value, option, file: ModelsFile):
    """A file value through the flag's own parser (as the text the flag would carry)."""
    if key == "device" and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    # bool is an int in Python: `max-length = true` is as wrong as `max-length = "64"`.
    if not isinstance(value, option.file_type) or (option.file_type is int and isinstance(value, bool)):
        want = {int: "a whole number", bool: "true or false", str: "a string"}[option.file_type]
        raise ModelsFileError(f"{file.where(name, key)}: model {name!r}: {key} must be {want}, not {value!r}")
    try:
        return option.parse(str(value).lower() if isinstance(value, bool) else str(value))
    except argparse.ArgumentTypeError as exc:
        raise ModelsFileError(f"{file.where(name, key)}: model {name!r}: bad {key}: {exc}") from None


def _prompts(name: str, prompts, file: ModelsFile) -> tuple[tuple[str, str], ...]:
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelsFileError(
            f"{file.where(name, 'prompts')}: model {name!r}: prompts must be a table of "
            'NAME = "TEXT", e.g. prompts = { query = "query: " }'
        )
    return tuple((str(k), v) for k, v in prompts.items())

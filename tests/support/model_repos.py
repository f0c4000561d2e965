"""Model repositories built offline from the bundled MiniLM: one that ships its own
model code (config.json auto_map), and a Hugging Face hub cache holding revisions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from encoderd.workers.contract.model_files import default_model_path

# The repository code: MiniLM whose hidden states pass through ReLU. Its own config class
# (model_type "relu_bert") keeps transformers' registration of it from replacing BertModel
# in the test process, which loads stock BERT models too.
REMOTE_CODE = """\
import torch
from transformers import BertConfig, BertModel


class ReluBertConfig(BertConfig):
    model_type = "relu_bert"


class ReluBertModel(BertModel):
    config_class = ReluBertConfig

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                              **kwargs)
        out.last_hidden_state = torch.relu(out.last_hidden_state)
        return out
"""


def build_remote_code_model(out: Path) -> Path:
    """The bundled MiniLM with its model class in `relu_bert.py`, named by config.json's auto_map."""
    shutil.copytree(default_model_path(), out)
    (out / "relu_bert.py").write_text(REMOTE_CODE)
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="relu_bert",
        architectures=["ReluBertModel"],
        auto_map={"AutoConfig": "relu_bert.ReluBertConfig", "AutoModel": "relu_bert.ReluBertModel"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build_hub_cache(cache: Path, repo_id: str, refs: dict[str, str], snapshots: dict[str, Path | None]) -> Path:
    """A Hugging Face hub cache (the layout huggingface_hub writes) holding `repo_id`: `refs` maps
    branch / tag names to commit hashes, `snapshots` each commit hash to a model directory whose
    files it links (None: an empty snapshot)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
    for commit, source in snapshots.items():
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        if source is not None:
            for path in Path(source).iterdir():
                (snapshot / path.name).symlink_to(path.resolve(), target_is_directory=path.is_dir())
    return cache

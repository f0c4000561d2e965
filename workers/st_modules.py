"""The sentence-transformers modules that follow pooling: Dense layers (and a Normalize between
them), run once in the worker for every engine, in float32 on the CPU.

A Dense module is activation(x @ W.T + b), plus `x` (or `x @ R.T`) with use_residual, exactly as
sentence-transformers computes it; the weights come from the module's own directory. A Normalize
after the last Dense stays the frontend's (server/models/postprocess.py), where a request may turn it off.
Torch is imported only for models with Dense modules: the activations are torch.nn's own classes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .contract.model_spec import DenseModule, ModelKind, ModelLoadError, ModelSpec, pooling_modes
from .contract.protocol import Ragged


class SentenceModules:
    """Pooled (n, d) float32 -> the model's sentence embedding before its final Normalize."""

    def __init__(self, spec: ModelSpec):
        self.applies = spec.kind == ModelKind.EMBEDDING
        self.spec = spec
        self.layers = [_load_dense(module) for module in spec.dense] if self.applies else []

    def __call__(self, pooled: np.ndarray | Ragged) -> np.ndarray | Ragged:
        if not self.layers or isinstance(pooled, Ragged):  # token states: the encoder's own output, before any module
            return pooled
        import torch

        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(pooled, dtype=np.float32))
            for layer in self.layers:
                x = layer(x)
            return x.numpy()

    def output_dim(self, backend_dim: int) -> int:
        """What the worker sends: the last Dense's width, else the backend's per-mode width x modes."""
        if not self.applies:
            return backend_dim
        if self.spec.dense:
            return self.spec.dense[-1].out_features
        return backend_dim * len(pooling_modes(self.spec.pooling))


def _load_dense(module: DenseModule):
    import torch

    weights = _read_weights(Path(module.path))
    linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias)
    residual = None
    if module.residual and module.in_features != module.out_features:
        residual = torch.nn.Linear(module.in_features, module.out_features, bias=False)
    expected = {f"linear.{name}" for name, _ in linear.named_parameters()}
    if residual is not None:
        expected.add("residual.weight")
    if set(weights) != expected:
        raise ModelLoadError(f"{module.path}: Dense weights hold {sorted(weights)}, expected {sorted(expected)}")
    try:
        linear.load_state_dict(
            {k.removeprefix("linear."): v.float() for k, v in weights.items() if k.startswith("linear.")}
        )
        if residual is not None:
            residual.load_state_dict({"weight": weights["residual.weight"].float()})
    except RuntimeError as exc:  # shapes that disagree with config.json
        raise ModelLoadError(f"{module.path}: Dense weights do not match its config.json: {exc}") from exc
    activation = getattr(torch.nn, module.activation)()
    return _DenseLayer(linear.eval(), activation, module.residual, residual, module.normalize_input)


class _DenseLayer:
    def __init__(self, linear, activation, use_residual: bool, residual, normalize_input: bool):
        import torch.nn.functional as F

        self.linear, self.activation = linear, activation
        self.use_residual, self.residual = use_residual, residual
        self.normalize = (lambda x: F.normalize(x, p=2, dim=-1)) if normalize_input else None

    def __call__(self, x):
        if self.normalize is not None:
            x = self.normalize(x)
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


def _read_weights(directory: Path) -> dict:
    import torch

    if (directory / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").exists():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{directory}: no Dense weights (model.safetensors or pytorch_model.bin)")

"""Which served model a request means: the one it names, else the one served model of a
kind its call can serve. Every API (gRPC, EmbedStream, Compat/REST) resolves through
`resolve`, so a name means the same model, and a missing one the same error, everywhere.
"""

from __future__ import annotations

import contextvars
from collections.abc import Collection, Mapping, Sequence

from ...workers.contract.model_spec import ModelKind, indefinite_article
from ..base.errors import InvalidInput, ModelNotFound, Unavailable, WrongModelKind, echo
from .served import ServedModel

# What Infinity's client sends as `model` when its caller names none: no name.
INFINITY_NO_MODEL = "default/not-specified"
UNKNOWN_MODEL = "(unknown)"  # the metrics label of calls naming a model not served here

# The model this call resolved to: its metrics label (service._Observed reads it at the end).
RESOLVED: contextvars.ContextVar[str] = contextvars.ContextVar("resolved_model", default="")


def resolve(
    models: Mapping[str, ServedModel],
    loading: Collection[str],
    name: str,
    kinds: Sequence[ModelKind] | None = None,
    prefer: Sequence[ModelKind] = (),
    call: str = "this call",
) -> ServedModel:
    """The model `name` names, else (no name) the one served model of `prefer`, else of
    `kinds` (None: any kind). A model of another kind is refused, naming what `call` needs."""
    name = "" if name == INFINITY_NO_MODEL else name
    model = _named(models, loading, name) if name else _default(models, loading, kinds, prefer, call)
    RESOLVED.set(model.spec.name)
    if kinds is not None and model.spec.kind not in kinds:
        raise WrongModelKind(
            f"model {model.spec.name!r} is {model.spec.kind.a_model}; {call} needs {_kinds(kinds)} model"
        )
    return model


def metrics_label(models: Mapping[str, ServedModel], name: str) -> str:
    """A call's `model` label: the model it resolved to, else its name when served; never free client text."""
    resolved = RESOLVED.get()
    if resolved or name in models:
        return resolved or name
    return UNKNOWN_MODEL if name and name != INFINITY_NO_MODEL else ""


def _named(models: Mapping[str, ServedModel], loading: Collection[str], name: str) -> ServedModel:
    if name in models:
        return models[name]
    if name in loading:
        raise Unavailable(f"model {echo(name)} is loading; retry shortly")
    raise ModelNotFound(f"model {echo(name)} is not served here; served models: {', '.join(sorted(models))}")


def _default(
    models: Mapping[str, ServedModel],
    loading: Collection[str],
    kinds: Sequence[ModelKind] | None,
    prefer: Sequence[ModelKind],
    call: str,
) -> ServedModel:
    fitting = [m for m in models.values() if kinds is None or m.spec.kind in kinds]
    preferred = [m for m in fitting if m.spec.kind in prefer]
    candidates = preferred or fitting
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise InvalidInput(
            f"the request names no model and several fit: set `model` to one of "
            f"{', '.join(sorted(m.spec.name for m in candidates))}"
        )
    if loading:
        raise Unavailable(f"model {sorted(loading)[0]!r} is loading; retry shortly")
    served = ", ".join(f"{m.spec.name} ({m.spec.kind.value})" for m in models.values()) or "none"
    raise WrongModelKind(f"{call} needs {_kinds(kinds or ())} model, and none is served here (served: {served})")


def _kinds(kinds: Sequence[ModelKind]) -> str:
    names = " or ".join(k.value for k in kinds)
    return f"{indefinite_article(names)} {names}"

"""TEI's request options (server/api/tei.py's routes): read from the top level (TEI's API) or nested
under `parameters` (huggingface_hub's InferenceClient), the nested ones winning, and checked once:
an embedding route's EmbedOptions, /predict's ClassifyOptions with its function_to_apply and top_k.
"""

from __future__ import annotations

from ..base.errors import InvalidInput, echo
from ..models import postprocess
from ..models.request_options import ClassifyOptions, EmbedOptions

SIDES = {"": "right", "right": "right", "left": "left"}
# huggingface_hub's function_to_apply for /predict, over a row of logits ("": the model's default).
ACTIVATIONS = {
    "": None,
    "none": lambda row: row,
    "sigmoid": postprocess.sigmoid,
    "softmax": lambda row: postprocess.softmax(row[None, :])[0],
}


def side(value: str) -> str:
    """TEI's truncation_direction ("right" / "left", any case) as the tokenizer's side."""
    if value.lower() not in SIDES:
        raise InvalidInput(f'`truncation_direction` must be "right" or "left", not {echo(value)}')
    return SIDES[value.lower()]


def _parse(request) -> tuple[EmbedOptions, str, int]:
    """The request's TEI options, `parameters` (huggingface_hub's nesting) over the top level:
    as EmbedOptions (normalize None and dimensions 0 when not given, the API key's priority),
    and /predict's own two, function_to_apply ("" when not given) and top_k (0 when not given)."""
    params = request.parameters if request.HasField("parameters") else None

    def pick(field: str, default):
        for source in (params, request):
            if source is None or field not in source.DESCRIPTOR.fields_by_name:
                continue
            if source.DESCRIPTOR.fields_by_name[field].has_presence:
                if source.HasField(field):
                    return getattr(source, field)
            elif getattr(source, field):
                return getattr(source, field)
        return default

    positive = {field: pick(field, None) for field in ("dimensions", "top_k")}
    for field, value in positive.items():
        if value is not None and value < 1:
            raise InvalidInput(f"`{field}` must be a positive integer, not {value}")
    function = pick("function_to_apply", "").lower()
    if function not in ACTIVATIONS:
        raise InvalidInput(f"`function_to_apply` must be softmax, sigmoid or none, not {echo(function)}")
    options = EmbedOptions.for_call(
        truncate=pick("truncate", True),
        side=side(pick("truncation_direction", "")),
        prompt_name=pick("prompt_name", ""),
        normalize=pick("normalize", None),
        dimensions=positive["dimensions"] or 0,
    )
    return options, function, positive["top_k"] or 0


def embed_options(request, route: str, *, embedding_options: bool = True) -> EmbedOptions:
    """An embedding route's options; /predict's are refused, and so are `normalize` and
    `dimensions` on a route whose output they do not shape (embedding_options=False)."""
    options, function, top_k = _parse(request)
    if not embedding_options and (options.normalize is not None or options.dimensions):
        raise InvalidInput(f"`normalize` and `dimensions` apply to /embed, not {route}")
    if function or top_k:
        raise InvalidInput(f"`function_to_apply` and `top_k` apply to /predict, not {route}")
    return options


def predict_options(request) -> tuple[ClassifyOptions, str, int]:
    """/predict's options: ClassifyOptions (raw scores when an activation replaces the model's),
    the function_to_apply ("" for the model's own) and top_k (0: every label)."""
    options, function, top_k = _parse(request)
    if options.normalize is not None or options.dimensions:
        raise InvalidInput("`normalize` and `dimensions` apply to /embed, not /predict")
    if options.prompt_name:
        raise InvalidInput("`prompt_name` does not apply to /predict")
    if request.raw_scores and function:
        raise InvalidInput("set `raw_scores` or `function_to_apply`, not both")
    raw_scores = request.raw_scores or bool(ACTIVATIONS[function])
    classify = ClassifyOptions(
        truncate=options.truncate, side=options.side, priority=options.priority, raw_scores=raw_scores
    )
    return classify, function, top_k

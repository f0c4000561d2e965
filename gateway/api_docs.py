"""A readable page of the REST API (`GET /docs`), rendered from the same OpenAPI document as
`GET /openapi.json` (server/api/openapi.py) when Envoy's config is rendered, and served by Envoy as
a direct response: plain HTML and CSS, no script or CDN, nothing hand-kept beside the protos."""

from __future__ import annotations

from html import escape

STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;max-width:62rem;margin:2rem auto;padding:0 1rem;color:#222}"
    "h2{margin-top:2.2rem;border-bottom:1px solid #ddd}section{margin:1.2rem 0}"
    "code{font:13px ui-monospace,monospace}.verb{font-weight:700;color:#fff;border-radius:3px;padding:1px 6px;"
    "margin-right:.5rem;font:700 12px ui-monospace,monospace}.get{background:#2a7}.post{background:#37c}"
    "table{border-collapse:collapse;margin:.4rem 0}td,th{border:1px solid #ddd;padding:2px 8px;"
    "text-align:left;vertical-align:top}th{background:#f4f4f4}nav a{margin-right:.8rem}"
)


def _type(schema: dict) -> str:
    """A schema as a short, linked type name."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f'<a href="#{escape(name)}">{escape(name.rsplit(".", 1)[-1])}</a>'
    if schema.get("type") == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return "one of " + ", ".join(f"<code>{escape(v)}</code>" for v in schema["enum"])
    kind = schema.get("type", "any JSON value")
    return escape(" or ".join(kind) if isinstance(kind, list) else kind)


def _fields(properties: dict) -> str:
    if not properties:
        return "<p>No fields.</p>"
    rows = "".join(
        f"<tr><td><code>{escape(name)}</code></td><td>{_type(schema)}</td></tr>" for name, schema in properties.items()
    )
    return f"<table><tr><th>field</th><th>type</th></tr>{rows}</table>"


def _operation(path: str, verb: str, operation: dict) -> str:
    parts = [
        f'<section><h3><span class="verb {verb}">{verb.upper()}</span><code>{escape(path)}</code></h3>',
        f"<p>{escape(operation['operationId'])}</p>",
    ]
    if "requestBody" in operation:
        parts.append("JSON body: " + _type(operation["requestBody"]["content"]["application/json"]["schema"]))
    params = operation.get("parameters", [])
    if params:
        parts.append(_fields({f"{p['name']} ({p['in']})": p["schema"] for p in params}))
    answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
    parts.append(
        "<p>Answers: "
        + (_type(answer) if answer else "JSON in the shape of the API the route copies")
        + '; errors: <code>{"error": {message, type, param, code}}</code>.</p></section>'
    )
    return "".join(parts)


def render(document: dict) -> str:
    """The HTML page of an OpenAPI document as server/api/openapi.py writes it."""
    info, schemas = document["info"], document["components"]["schemas"]
    prefix = document.get("servers", [{"url": ""}])[0]["url"]  # --url-prefix: the paths as called
    routes = "".join(
        _operation(prefix + path, verb, op) for path, ops in document["paths"].items() for verb, op in ops.items()
    )
    types = "".join(
        f'<section id="{escape(name)}"><h3>{escape(name)}</h3>{_fields(schema.get("properties", {}))}</section>'
        for name, schema in sorted(schemas.items())
        if name != "Error"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(info["title"])}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(info['title'])}</h1>"
        f'<p>{escape(info["description"])} Machine-readable: <a href="openapi.json">openapi.json</a>.</p>'
        f'<nav><a href="#routes">Routes</a><a href="#messages">Messages</a></nav>'
        f'<h2 id="routes">Routes</h2>{routes}<h2 id="messages">Messages</h2>{types}</body></html>'
    )

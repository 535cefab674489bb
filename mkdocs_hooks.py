"""MkDocs hook: docs/reference/http.md's operations rendered from the server's own OpenAPI schema
(kvmemory.server.app.openapi_schema), so the HTTP reference cannot drift from the code."""

from __future__ import annotations

import json

MARK = "<!-- openapi -->"


def _schema_name(ref: dict | None) -> str:
    if not ref:
        return ""
    r = ref.get("$ref") or next((x.get("$ref") for x in ref.get("anyOf", []) if "$ref" in x), "")
    return r.rsplit("/", 1)[-1]


def openapi_markdown() -> str:
    from kvmemory.server.app import openapi_schema
    spec = openapi_schema()
    out = ["| method | path | what it does | request body | response |", "|---|---|---|---|---|"]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {})
            req = ", ".join(f"`{_schema_name(v.get('schema'))}` ({k})" for k, v in body.items() if v.get("schema"))
            ok = op.get("responses", {}).get("200", {}).get("content", {}).get("application/json", {})
            summary = (op.get("description") or op.get("summary") or "").strip().split("\n")[0]
            out.append(f"| {method.upper()} | `{path}` | {summary} | {req} | `{_schema_name(ok.get('schema'))}` |")
    out += ["", "## Schemas", ""]
    for name, sch in spec["components"]["schemas"].items():
        out += [f"### {name}", "", (sch.get("description") or "").strip(), "",
                "```json", json.dumps(sch.get("properties", sch), indent=1)[:4000], "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARK in markdown:
        return markdown.replace(MARK, openapi_markdown())
    return markdown

"""Chat templates rendered with jinja2 exactly as transformers renders them, without importing transformers.

The environment matches `transformers.utils.chat_template_utils` (5.x): a sandboxed, immutable jinja2
environment with trim_blocks / lstrip_blocks, loop controls, the `{% generation %}` tag (the spans it
covers are what an assistant-token mask marks), `raise_exception`, `strftime_now`, and a `tojson`
filter that neither escapes HTML nor sorts keys. tests/test_tokenizer.py checks the output against
transformers' own apply_chat_template.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class _GenerationSpans(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body, recording its character span when tracking."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

    def _span(self, caller):
        text = caller()
        tracked = getattr(self.environment, "_posttrain_track", None)
        if tracked is not None:
            blocks, spans = tracked
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationSpans, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(source: str, messages, *, add_generation_prompt: bool = False, spans: bool = False, tools=None,
           documents=None, **variables):
    """The rendered text; with spans=True, (text, [(start, end) of each {% generation %} block])."""
    template = compile_template(source)
    kw = dict(messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
              **variables)
    if not spans:
        return template.render(**kw)
    blocks: list[str] = []
    found: list[tuple[int, int]] = []
    template.environment._posttrain_track = (blocks, found)  # one render at a time per template (no threads here)
    try:
        for block in template.generate(**kw):
            blocks.append(block)
    finally:
        template.environment._posttrain_track = None
    return "".join(blocks), found

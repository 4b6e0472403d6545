"""A request body as a JSON object the routes can trust: JSON, an object, nested at most :data:`MAX_JSON_DEPTH`
deep, and every string in it (keys too) valid Unicode, each refusal a 400 naming the field.

Invalid UTF-8 bytes are decoded with ``surrogateescape`` (each bad byte becomes a lone surrogate U+DC80-U+DCFF),
so they and JSON's own lone surrogates (``"\\ud800"``) are found by one walk and refused with the field's path
(``prompt``, ``messages[0].content``); a string that reached a tokenizer, a store or a response encoder as a lone
surrogate raised there (a 500, or a stored job no list could encode). The walk is iterative, so a deep body never
recurses in Python; ``json.loads`` itself stops at the interpreter's recursion limit, also a 400 here.
"""

from __future__ import annotations

import codecs
import json

from metainfer_gen.serve.errors import bad_request
from metainfer_gen.serve.request_fields import json_kind

MAX_JSON_DEPTH = 64  # the deepest body a route reads is 4 levels (messages[i].content[j].text)


def parse_json_object(raw: bytes, content_type: str | None) -> dict:
    """The body as a checked JSON object (see the module docstring).

    Raises:
        APIError: 400 for a missing or non-JSON content type, an empty body, malformed JSON, JSON that is not an
            object (``[]``, ``null``, ``123``, ``"s"``), nesting past :data:`MAX_JSON_DEPTH`, or a string with
            invalid UTF-8 or a lone surrogate (``param``: the field).
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if not media:
        raise bad_request("missing Content-Type header: send the body as JSON with "
                          "'Content-Type: application/json'", code="invalid_content_type")
    if media != "application/json" and not media.endswith("+json"):
        raise bad_request(f"Content-Type {media!r} is not JSON: send 'Content-Type: application/json'",
                          code="invalid_content_type")
    if not raw.strip():
        raise bad_request("empty request body: send a JSON object", code="invalid_json")
    text = raw.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")
    try:
        body = json.loads(text)
    except RecursionError:
        raise bad_request(f"the JSON body is nested too deeply: at most {MAX_JSON_DEPTH} levels",
                          code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    except ValueError:  # an integer literal past the interpreter's digit limit (4,300)
        raise bad_request("a number in the request body has thousands of digits: no field takes a number that "
                          "large", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object; got {json_kind(body)}", code="invalid_json")
    check_strings(body)
    return body


def check_strings(body: dict, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk ``body`` (parsed JSON, or a form's fields) without recursion: every string valid Unicode, nesting at
    most ``max_depth`` levels.

    Raises:
        APIError: 400 whose ``param`` is the path of the first bad string or of the level past the bound.
    """
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > max_depth:
            field = where.split("[")[0].split(".")[0]
            raise bad_request(f"{field} is nested too deeply: a body has at most {max_depth} levels", field)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):  # a bad name is shown escaped: the error body must encode
                _check_text(key, f"{where}.{ascii(key)}" if where else ascii(key), "field name")
                path = f"{where}.{key}" if where else key
            else:
                path = f"{where}[{key}]"
            if isinstance(item, str):
                _check_text(item, path)
            elif isinstance(item, (dict, list)):
                stack.append((item, path, depth + 1))


def _check_text(text: str, where: str, what: str = "text") -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{where} is not valid Unicode {what}: character {exc.start} is invalid UTF-8 or a lone "
                          f"surrogate (U+D800-U+DFFF); send UTF-8, and characters beyond U+FFFF as one code point "
                          f"or as a surrogate pair", where, "invalid_text") from None


def check_form_text(fields: dict[str, str], raw: bytes) -> None:
    """The text fields of a ``multipart/form-data`` body, as Starlette decoded them, checked against the raw body.

    Starlette decodes a form field that is not UTF-8 as Latin-1 instead of refusing it, so a field whose text
    is not ASCII and whose UTF-8 encoding is not in ``raw`` was not sent as UTF-8.

    Raises:
        APIError: 400 naming the field.
    """
    check_strings(fields)
    for name, value in fields.items():
        if isinstance(value, str) and not value.isascii() and value.encode("utf-8") not in raw:
            raise bad_request(f"{name} is not valid UTF-8 text: send form fields encoded as UTF-8", name,
                              "invalid_text")

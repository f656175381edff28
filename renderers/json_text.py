"""transformers' ``tojson`` filter, the one copy every renderer and the template environment use.

transformers installs ``json.dumps(value, ensure_ascii=False, indent=..., separators=..., sort_keys=...)``
as the filter (no HTML escaping, unlike Jinja2's own). Most calls take none of the options (a tool
definition, a call's arguments): those go straight to the C encoder ``json.dumps`` would build, built
once here (and checked against ``json.dumps`` on a probe value). Without its circular-reference check,
which costs a dict of ids per call: a circular value exhausts the recursion limit instead, reported as
the ``ValueError`` ``json.dumps`` raises.
"""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring
from typing import Any

_DEFAULT = json.JSONEncoder(ensure_ascii=False)
_PROBE = {"a": [1, 2.5, None, True, float("nan")], "é": {"k": "\"q\"\n🙂"}, 3: -0.0}


def _compact_encoder():
    """The C encoder, or None where this Python has none or builds it otherwise (``c_make_encoder`` is the
    json module's own, undocumented): its output on a probe value must be ``json.dumps``'."""
    if c_make_encoder is None:
        return None
    try:
        # (markers, default, str encoder, indent, key separator, item separator, sort_keys, skipkeys,
        # allow_nan), as JSONEncoder.iterencode passes them for ensure_ascii=False and no options
        encoder = c_make_encoder(None, _DEFAULT.default, encode_basestring, None, ": ", ", ", False, False, True)
        if "".join(encoder(_PROBE, 0)) == json.dumps(_PROBE, ensure_ascii=False):
            return encoder
    except Exception:  # another signature: json.dumps it is
        pass
    return None


_COMPACT = _compact_encoder()


def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    """``json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)``,
    the text transformers' template filter prints."""
    if _COMPACT is not None and not ensure_ascii and indent is None and separators is None and not sort_keys:
        try:
            return "".join(_COMPACT(value, 0))
        except RecursionError:
            raise ValueError("Circular reference detected (or a value nested too deep to print as JSON)") from None
    if isinstance(separators, list):
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

"""The request fields of the logit controls, as ``SamplingParams`` takes them.

``response_format`` (OpenAI's: ``{"type": "text"}``, ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``) and
vLLM's ``structured_outputs`` (the fields of :class:`~tpspec.sampling.params.StructuredOutputsParams`)
become one ``StructuredOutputsParams`` (or None); OpenAI's ``logit_bias`` keys (token ids as
strings) become ints. Every function raises ``ValueError`` naming the field (HTTP 400).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..sampling.params import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs_of(response_format: dict[str, Any] | None,
                          structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """The request's structured-output constraint: from ``response_format`` or from
    ``structured_outputs`` (not both), None when neither constrains the output."""
    from_format = _response_format(response_format)
    from_fields = _structured_outputs(structured_outputs)
    if from_format is not None and from_fields is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    return from_format if from_format is not None else from_fields


def _response_format(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"response_format.type must be one of {RESPONSE_FORMAT_TYPES}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError('response_format type "json_schema" needs json_schema.schema (a JSON schema object)')
    return StructuredOutputsParams(json=spec["schema"])


def _structured_outputs(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s) {unknown}; known: {known}")
    return StructuredOutputsParams(**value)


def logit_bias_of(value: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (``{"token id": bias}``) with int keys; the values are checked by
    ``SamplingParams`` (floats in [-100, 100])."""
    if value is None:
        return None
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            out[int(key)] = bias
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
    return out

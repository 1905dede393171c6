"""Per-conversation settings as the settings dialog edits them, validated exactly as the API does.

Text fields go through `parse_option_value` (as `/set parameter` and Modelfile values do), then
`validate_option` (as request options do), then `Options.merge` for the whole set. An empty field
means "the model's default" and is left out of the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localrt.errors import OptionError
from localrt.runtime.options import BACKEND_NAMES
from localrt.runtime.options import SPECULATIVE_MODES
from localrt.runtime.options import Options
from localrt.runtime.options import parse_option_value
from localrt.runtime.options import validate_option

# (option, label, placeholder) for the free-text fields, in dialog order
TEXT_FIELDS: list[tuple[str, str, str]] = [
    ("temperature", "Temperature", "model default"),
    ("top_p", "Top p", "model default"),
    ("top_k", "Top k", "model default"),
    ("num_ctx", "Context length", "model default"),
    ("num_predict", "Max tokens", "no limit"),
    ("seed", "Seed", "random"),
    ("draft_model", "Draft model", "none (name of an installed model)"),
]
CHOICE_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "backend": ("Backend", BACKEND_NAMES),
    "speculative": ("Speculative", tuple(SPECULATIVE_MODES)),
}
FIELD_NAMES = [name for name, _, _ in TEXT_FIELDS] + list(CHOICE_FIELDS)


def parse_fields(fields: Mapping[str, str | None]) -> tuple[dict[str, Any], dict[str, str]]:
    """Dialog values -> (options, errors by field). Empty or None values are left to the model."""
    options: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name, raw in fields.items():
        if name not in FIELD_NAMES:
            errors[name] = f"unknown option {name!r}"
            continue
        text = (raw or "").strip()
        if not text:
            continue
        try:
            options[name] = validate_option(name, parse_option_value(name, text))
        except OptionError as e:
            errors[name] = str(e)
    if not errors:
        try:
            Options.merge(options)  # the set as a whole, as the runtime will merge it
        except OptionError as e:
            errors["_"] = str(e)
    return options, errors


def field_text(options: Mapping[str, Any], name: str) -> str:
    """An option's value as the dialog shows it ("" when unset)."""
    value = options.get(name)
    return "" if value is None else str(value)


def summary(options: Mapping[str, Any], json_output: bool = False) -> str:
    """A short line for the status bar / header: `temperature=0 · num_ctx=2048 · json`."""
    parts = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(options.items())]
    if json_output:
        parts.append("json")
    return " · ".join(parts)

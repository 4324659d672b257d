"""What a request's output must follow (``structured_outputs``): the parameters alone, free of torch, for the API
and the CLI; :mod:`kdray.spec.grammar` compiles them into token masks."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StructuredOutputsParams:
    """What the output must follow (vLLM's names), exactly one of: ``json``, a JSON schema (a dict or JSON text;
    ``disable_additional_properties`` also forbids the properties a schema leaves open, as OpenAI's ``strict``);
    ``json_object=True``, any JSON object; ``structural_tag``, an xgrammar structural tag as JSON text (forced tool
    calls are one). The output ends where the grammar does (the model's EOS)."""

    json: dict | str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_additional_properties: bool = False

    def __post_init__(self):
        given = [name for name in ("json", "json_object", "structural_tag") if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json (a JSON schema), json_object=True or "
                             f"structural_tag (got {given or 'none'})")
        checks = [(self.json is None or isinstance(self.json, (dict, str)), "json", "a JSON schema (a dict or text)"),
                  (self.json_object in (None, True), "json_object", "True or None"),
                  (self.structural_tag is None or isinstance(self.structural_tag, str), "structural_tag",
                   "JSON text"),
                  (isinstance(self.disable_additional_properties, bool), "disable_additional_properties", "a bool")]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"StructuredOutputsParams.{name} must be {what}")

    @property
    def field(self) -> str:
        """The field that holds the grammar."""
        return "json" if self.json is not None else "json_object" if self.json_object else "structural_tag"

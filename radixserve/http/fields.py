"""Request fields llama-server honors that this server does not implement.

llama-server ignores unknown keys, and so do we; but a field it *honors* must never be dropped
silently here (a client asking for a grammar would get unconstrained text and not know). Each
such field is accepted when its value asks for nothing (null, false, empty, the default) and
otherwise refused with a 400 naming it and the missing feature.
"""

from __future__ import annotations

from typing import Any

from radixserve.errors import invalid_request
from radixserve.http.schemas import GenerationRequest

# field -> (values that ask for nothing, the feature a real value needs)
_UNIMPLEMENTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "grammar_lazy": ((False,), "lazy grammars"),
    "grammar_triggers": (([],), "lazy grammars"),
    "preserved_tokens": (([],), "lazy grammars"),
    # llama-server's internal switch (its chat front-end sets it): chat requests with `tools`
    # are parsed anyway, and raw /completion text is never parsed into tool calls here
    "parse_tool_calls": ((False,), "tool-call parsing set by the client"),
    "lora": (([],), "LoRA adapters"),
    "chat_format": ((), "chat output parsers"),
    "chat_parser": ((), "chat output parsers"),
    "generation_prompt": (("",), "chat output parsers"),
    "reasoning_control": ((False,), "reasoning control"),
    "reasoning_budget_tokens": ((-1,), "reasoning budgets"),
    "reasoning_budget_start_tag": ((), "reasoning budgets"),
    "reasoning_budget_end_tags": (([],), "reasoning budgets"),
    "reasoning_budget_end_tag": (("",), "reasoning budgets"),
    "reasoning_budget_message": (("",), "reasoning budgets"),
    "echo": ((False,), "echoing the prompt"),
    "image_data": (([],), "multimodal input"),
    "multimodal_data": (([],), "multimodal input"),
}


def reject_unimplemented(req: GenerationRequest) -> None:
    """400 for the first field that asks for something this server cannot do."""
    for name, (harmless, feature) in _UNIMPLEMENTED.items():
        value = getattr(req, name)
        if value is None or any(value == h and type(value) is type(h) for h in harmless):
            continue
        raise invalid_request(f"Field '{name}': {feature} is not supported by this server")

"""Bodies of the informational routes: GET /props and GET /models (/v1/models).

Shapes follow llama-server's /props and /v1/models bodies; the
model name reported everywhere is `--alias`, else the GGUF file name.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from radixserve.config import RequestDefaults, ServerConfig
from radixserve.http.responses import BUILD_INFO, params_json
from radixserve.memory.host_tier import backend_name
from radixserve.memory.pool import kv_types
from radixserve.model.device import device_name
from radixserve.model.kernels import variant_name
from radixserve.model.loader import Model
from radixserve.text.chat_caps import template_caps

log = logging.getLogger(__name__)

# gguf `general.file_type` values (llama_ftype) -> llama-server's ftype names.
_FTYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def model_alias(model: Model, cfg: ServerConfig) -> str:
    return cfg.alias or model.name


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """Figures about the model file that cost a pass over weights or metadata: computed once."""

    n_params: int
    ftype: str  # "Q4_1", or "" if the GGUF does not say
    size: int  # file bytes


def ftype_name(file_type: int | None) -> str:
    """`general.file_type` as llama.cpp names it ("Q4_1"), "" when unknown."""
    return _FTYPES.get(file_type, "") if file_type is not None else ""


def model_facts(model: Model) -> ModelFacts:
    try:
        size = os.path.getsize(model.path)
    except OSError:
        size = 0
    return ModelFacts(count_params(model), ftype_name(model.hp.file_type), size)


def default_params_json(d: RequestDefaults) -> dict[str, Any]:
    """The generation settings a request gets when it sets nothing."""
    return params_json(replace(d.sampling, seed=d.seed), d.n_predict, spec=d.spec)


def props_json(
    model: Model,
    facts: ModelFacts,
    cfg: ServerConfig,
    n_ctx_slot: int,
    n_slots: int,
    cache_stats: dict[str, float],
    defaults: RequestDefaults | None = None,
) -> dict[str, Any]:
    """GET /props (props.json), plus `prompt_cache`: the host cache figures (ours).
    `defaults`: the request defaults (None: built from `cfg`)."""
    defaults = defaults or RequestDefaults.from_config(cfg)
    tmpl = model.chat_template
    caps = template_caps(tmpl)
    layout = model.layout  # what its memory can do (shifts), as its family declares it
    return {
        "default_generation_settings": {"params": default_params_json(defaults),
                                        "n_ctx": n_ctx_slot},
        "total_slots": n_slots,
        "model_alias": model_alias(model, cfg),
        "model_ftype": facts.ftype,
        "model_path": model.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",  # llama.cpp's default; no media input here
        "endpoint_slots": cfg.slots_endpoint,
        "endpoint_props": cfg.props_endpoint,
        "endpoint_metrics": cfg.metrics,
        "ui": cfg.webui,
        "ui_settings": cfg.ui_settings,
        "chat_template": tmpl.source,
        "chat_template_caps": {
            "supports_string_content": True,
            "supports_system_role": caps.supports_system_role,
            "supports_tool_calls": caps.supports_tool_calls,
            "supports_tools": caps.supports_tools,
            "supports_typed_content": False,
        },
        "bos_token": tmpl.bos_token,
        "eos_token": tmpl.eos_token,
        "build_info": BUILD_INFO,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
        # ours: whether a token's logits depend only on the token sequence (docs/PERFORMANCE.md)
        "deterministic": model.deterministic,
        # ours: where the model and its KV pool run (--device / -ngl): "cpu" or
        # "cuda:N (<GPU name>)"
        "device": device_name(model.device),
        # ours: the variant of radixserve's C kernels the model runs (RADIXSERVE_KERNELS,
        # model/kernels.py), "none" on torch's ops
        "kernels": variant_name(model.transformer.kern),
        # ours: what runs each layer matrix, {matrix: {route: layers}} (model/kernel_routes.py)
        "kernel_routes": model.transformer.w.routes(),
        # ours: the KV cache types every tier stores (-ctk / -ctv)
        "cache_type_k": kv_types.resolve(cfg.cache_type_k, "", model.dtype)[0].name,
        "cache_type_v": kv_types.resolve("", cfg.cache_type_v, model.dtype)[1].name,
        "prompt_cache": {
            "backend": backend_name(cfg),
            "cache_ram_mib": cfg.cache_ram_mib,
            "cache_idle_slots": cfg.cache_idle_slots and cfg.cache_ram_mib != 0,
            "cache_radix_min_restore_tokens": cfg.cache_radix_min_restore_tokens,
            # chunks shifted by --cache-reuse carry KV computed for other text: not in
            # deterministic mode
            "cache_reuse": 0 if model.deterministic or not layout.can_shift
            else cfg.cache_reuse,
            # a recurrent state exists only where it was computed: never shifted
            "context_shift": cfg.context_shift and layout.can_shift,
            "recurrent_layers": layout.n_state,
            # the disk tier under the radix cache: on, bound, tokens a file
            "cache_disk": bool(cfg.cache_disk),
            "cache_disk_mib": cfg.cache_disk_mib,
            "cache_disk_block": cfg.cache_disk_block,
            **cache_stats,
        },
    }


def count_params(model: Model) -> int:
    """Parameter count as llama.cpp reports it: every GGUF tensor (a tied head counts once)."""
    return model.transformer.w.n_params


def models_json(
    model: Model, facts: ModelFacts, cfg: ServerConfig, n_ctx_slot: int, created: int
) -> dict[str, Any]:
    """GET /models and /v1/models (v1_models.json): an ollama-style list plus OpenAI `data`."""
    name = model_alias(model, cfg)
    ftype = facts.ftype
    hp = model.hp
    vocab_type = {"llama": 1, "gpt2": 2}.get(model.tokenizer.model, 0)  # llama_vocab_type
    ollama = {
        "name": name,
        "model": name,
        "modified_at": "",
        "size": "",
        "digest": "",
        "type": "model",
        "description": "",
        "tags": [""],
        "capabilities": ["completion"],
        "parameters": "",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": "",
            "families": [""],
            "parameter_size": "",
            "quantization_level": ftype,
        },
    }
    meta = {
        "vocab_type": vocab_type,
        "n_vocab": hp.n_vocab,
        "n_ctx": n_ctx_slot,
        "n_ctx_train": hp.n_ctx_train,
        "n_embd": hp.n_embd,
        "n_params": facts.n_params,
        "size": facts.size,
        "ftype": ftype,
    }
    data = {
        "id": name,
        "aliases": cfg.aliases or [name],
        "tags": cfg.tags,
        "object": "model",
        "created": created,
        "owned_by": "llamacpp",
        "meta": meta,
    }
    return {"models": [ollama], "object": "list", "data": [data]}

"""Every setting of radixserve with its default, in one place.

Flag names and defaults mirror llama-server's so users can carry their command lines over;
the CLI builds a `ServerConfig` and everything below it reads from that object only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.sampling.chain import SamplingParams

if TYPE_CHECKING:
    from radixserve.model.kernel_config import KernelConfig

DTYPES = ("auto", "f32", "bf16", "f16")
WEIGHTS = ("auto", "native", "dequant")
DETERMINISTIC = ("auto", "on", "off")
# --pooling: llama.cpp's pooling types this server computes (rank needs a classification head)
POOLINGS = ("none", "mean", "cls", "last")
SPEC_TYPES = ("draft-simple", "ngram-simple", "ngram-mod")  # the --spec-type values served


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding: llama-server's `--spec-*` settings (per request: `speculative.*`).

    `types` lists the drafters in the order they are tried (llama.cpp's --spec-type list; empty:
    off). draft-simple needs a draft model (`draft_model`); the n-gram ones need none.
    """

    types: list[str] = field(default_factory=list)
    draft_model: str | None = None  # -md: a GGUF with the target's vocabulary
    n_max: int = 3  # --spec-draft-n-max: tokens a draft model proposes per step
    n_min: int = 0  # --spec-draft-n-min: shorter drafts are dropped
    p_min: float = 0.0  # --spec-draft-p-min: stop drafting below this draft probability
    ngram_simple_size_n: int = 12  # --spec-ngram-simple-size-n: lookup n-gram
    ngram_simple_size_m: int = 48  # --spec-ngram-simple-size-m: tokens drafted after a match
    ngram_simple_min_hits: int = 1  # --spec-ngram-simple-min-hits
    ngram_mod_n_min: int = 48  # --spec-ngram-mod-n-min: shorter drafts are dropped
    ngram_mod_n_max: int = 64  # --spec-ngram-mod-n-max
    ngram_mod_n_match: int = 24  # --spec-ngram-mod-n-match: hashed lookup length
    cache_type_k: str = ""  # -ctkd: the draft model's K cache type ("": its compute dtype)
    cache_type_v: str = ""  # -ctvd

    @property
    def enabled(self) -> bool:
        return bool(self.types)

    def params_json(self) -> dict[str, object]:
        """The speculative fields of a task's `params` (/props, /slots, responses):
        "speculative.types" is llama.cpp's comma list ("none" when off); while speculation is
        on, n_max/n_min/p_min too, as older llama-servers showed them (off, the object keeps
        exactly today's llama-server keys)."""
        if not self.types:
            return {"speculative.types": "none"}
        return {"speculative.types": ",".join(self.types), "speculative.n_max": self.n_max,
                "speculative.n_min": self.n_min, "speculative.p_min": self.p_min}

    def validate(self) -> None:
        bad = [t for t in self.types if t not in SPEC_TYPES]
        if bad:
            raise ValueError(f"--spec-type: {', '.join(bad)} not supported; this server "
                             f"drafts with {', '.join(SPEC_TYPES)} (or none)")
        if "draft-simple" in self.types and not self.draft_model:
            raise ValueError("--spec-type draft-simple needs a draft model (-md FNAME)")
        if self.draft_model and "draft-simple" not in self.types:
            self.types.insert(0, "draft-simple")  # llama-server: -md alone turns it on
        for name in ("n_max", "n_min", "ngram_simple_size_n", "ngram_simple_size_m",
                     "ngram_simple_min_hits", "ngram_mod_n_min", "ngram_mod_n_max",
                     "ngram_mod_n_match"):
            if getattr(self, name) < 0:
                raise ValueError(f"--spec-{name.replace('_', '-')} must be >= 0")
        if self.ngram_simple_size_n < 1 or self.ngram_mod_n_match < 1:
            raise ValueError("n-gram lookup sizes must be >= 1")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"--spec-draft-p-min must be within [0, 1], got {self.p_min}")


@dataclass(slots=True)
class ServerConfig:
    model: str = "default"
    alias: str | None = None  # the name the API reports: the first of `aliases` (sorted)
    aliases: list[str] = field(default_factory=list)  # -a: every name the model answers to
    tags: list[str] = field(default_factory=list)
    dtype: str = "auto"
    weights: str = "auto"  # auto: native unless f32 compute; native: 4-bit blocks run packed
    load_mode: str = "auto"  # -lm: whether expert tensors are mapped (kernel_routes.maps_experts)
    deterministic: str = "auto"  # auto: on wherever the compute path supports it (bf16 kernels)
    device: str = "auto"  # -dev: auto (CUDA when torch sees one), cpu, cuda:N
    gpu_layers: str = "auto"  # -ngl: 0 keeps the model on the CPU; auto/all: on --device
    # our C kernels (RADIXSERVE_KERNELS and its siblings, environment only): settled by
    # `radixserve serve` at start-up; None settles them from the environment at the load
    kernels: KernelConfig | None = None
    threads: int = -1  # -1: torch's default (all cores)
    seed: int = -1
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: list[str] = field(default_factory=list)
    ctx_size: int = 0  # 0: the model's training context
    n_parallel: int = -1  # -1: auto = 4 slots with unified KV (llama-server)
    kv_unified: bool = False
    kv_unified_per_slot: int = 0  # 0: no cap beyond the pool and the training context
    batch_size: int = 2048
    ubatch_size: int = 512
    slot_prompt_similarity: float = 0.10
    # --sleep-idle-seconds: idle seconds before the model and device KV are released (-1: never)
    sleep_idle_seconds: int = -1
    cache_reuse: int = 0
    cache_prompt: bool = True
    slots_endpoint: bool = True
    # LLAMA_SERVER_SLOTS_DEBUG (llama-server's switch for prompt text in /slots): GET /cache
    # shows the unsalted namespace's prompt text only with it
    slots_debug: bool = False
    metrics: bool = False
    props_endpoint: bool = False  # --props: POST /props allowed
    log_verbosity: int = 3
    log_file: str | None = None
    log_disable: bool = False
    log_jsonl: bool = False
    log_prefix: bool = True
    log_timestamps: bool = True
    # HTTP front (llama-server's server params)
    timeout: int = 3600  # -to: seconds a client may stay silent while sending a request
    sse_ping_interval: int = 30  # seconds of stream silence before a ":" comment, -1 = never
    max_body_mib: int = 32  # requests with larger bodies get 413
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    api_prefix: str = ""
    static_path: str = ""  # --path: a directory served at / instead of the packaged page
    webui: bool = True  # --ui / --no-ui: the page at / (radixserve/webui/)
    ui_settings: dict[str, object] = field(default_factory=dict)  # --ui-config: page defaults
    ssl_key_file: str | None = None
    ssl_cert_file: str | None = None
    reuse_port: bool = False
    # chat and text
    chat_template: str | None = None  # --chat-template(-file): a Jinja template, else the model's
    chat_template_kwargs: dict[str, object] = field(default_factory=dict)
    prefill_assistant: bool = True
    reasoning_format: str = "auto"  # none | auto | deepseek | deepseek-legacy
    skip_chat_parsing: bool = False  # replies stay plain content (no tool calls, no reasoning)
    stop: list[str] = field(default_factory=list)  # -r: default stop strings
    special: bool = False  # -sp: special tokens rendered in the output text
    escape: bool = True  # -e: process escapes (\n, \t...) in -r
    ignore_eos: bool = False
    grammar: str = ""  # --grammar/-j (and their -file forms), compiled for llguidance
    # host tier
    cache_ram_mib: int = 8192  # -1 unlimited, 0 off
    cache_idle_slots: bool = True
    cache_radix_prompt: bool = True
    cache_radix_min_restore_tokens: int = 0
    # `prompt_cache_retention: 24h` pins, radix only; bounded by --cache-ram too
    cache_pin_mib: int = 1024
    # disk tier
    slot_save_path: str | None = None
    # router mode: no -m and one of these -> a router of child servers (router/)
    models_dir: str = ""  # --models-dir: a directory of GGUF files (or one subdirectory each)
    models_preset: str = ""  # --models-preset: an INI file of per-model settings
    models_max: int = 4  # --models-max: children loaded at once (LRU unloading), 0 = no limit
    models_autoload: bool = True  # --no-models-autoload: a request never loads its model
    # disk tier under the radix cache
    cache_disk: str = ""  # --cache-disk DIR ("": off)
    cache_disk_mib: int = 10240  # bound on DIR's block files, -1: none
    cache_disk_block: int = 64  # tokens a block file holds
    cache_disk_key: str = ""  # --cache-disk-key FILE: keys DIR's names and checksums ("": none)
    # default sampling / generation (request fields start from these)
    n_predict: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)  # --temp, --top-k, ...
    n_keep: int = 0  # --keep: prompt tokens a context shift keeps (-1: all)
    context_shift: bool = False  # --context-shift: generation past n_ctx shifts the context
    spm_infill: bool = False  # --spm-infill: /infill lays out Suffix/Prefix/Middle
    # sliding-window models (llama.cpp's defaults)
    swa_full: bool = False  # --swa-full: full-size caches for sliding layers too
    # KV cache types: bf16 f16 f32 q8_0 q4_0; "": the compute dtype
    cache_type_k: str = ""  # -ctk
    cache_type_v: str = ""  # -ctv
    ctx_checkpoints: int = 32  # -ctxcp: context checkpoints per slot, 0 = none
    checkpoint_min_step: int = 8192  # -cms: tokens between two checkpoints of a prompt
    # speculative decoding
    spec: SpecConfig = field(default_factory=SpecConfig)
    # embeddings: /embedding and /v1/embeddings served only with --embeddings
    embeddings: bool = False
    pooling: str = ""  # --pooling none|mean|cls|last ("": the model's, else none)
    embd_normalize: int = 2  # --embd-normalize: -1 none, 0 max abs (int16 range), 2 L2, p>2

    def embedding_pooling(self, model_pooling: str) -> str:
        """--pooling, else the model's (its GGUF's pooling_type), else none (llama.cpp's)."""
        return self.pooling or model_pooling or "none"

    def validate(self) -> None:
        """Reject settings that cannot work, with a message naming the flag."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.deterministic not in DETERMINISTIC:
            raise ValueError(f"--deterministic must be one of {', '.join(DETERMINISTIC)}, "
                             f"got {self.deterministic!r}")
        if self.n_parallel == 0 or self.n_parallel < -1:
            raise ValueError(f"--parallel must be >= 1 (or -1 for auto), got {self.n_parallel}")
        if self.ctx_size < 0:
            raise ValueError(f"--ctx-size must be >= 0, got {self.ctx_size}")
        if self.batch_size < 1 or self.ubatch_size < 1:
            raise ValueError("--batch-size and --ubatch-size must be >= 1")
        if not 0.0 <= self.slot_prompt_similarity <= 1.0:
            raise ValueError("--slot-prompt-similarity must be within [0, 1]")
        if self.cache_reuse < 0:
            raise ValueError("--cache-reuse must be >= 0")
        if self.ctx_checkpoints < 0:
            raise ValueError(f"--ctx-checkpoints must be >= 0, got {self.ctx_checkpoints}")
        if self.checkpoint_min_step < 0:
            raise ValueError("--checkpoint-min-step must be >= 0, got "
                             f"{self.checkpoint_min_step}")
        if self.cache_disk and (self.cache_ram_mib == 0 or not self.cache_radix_prompt):
            raise ValueError("--cache-disk needs the radix host cache (--cache-radix-prompt on "
                             "and --cache-ram other than 0): disk blocks are read into it")
        if self.cache_disk_key and not self.cache_disk:
            raise ValueError("--cache-disk-key keys the disk tier's files: it needs --cache-disk")
        if self.cache_disk_mib == 0 or self.cache_disk_mib < -1:
            raise ValueError(f"--cache-disk-mib must be > 0 (or -1: no limit), got "
                             f"{self.cache_disk_mib}")
        if self.pooling not in ("", *POOLINGS):
            raise ValueError(f"--pooling must be one of {', '.join(POOLINGS)}, got "
                             f"{self.pooling!r}")
        if self.embd_normalize < -1:
            raise ValueError(f"--embd-normalize must be -1, 0 or a p-norm >= 1, got "
                             f"{self.embd_normalize}")
        if not 1 <= self.cache_disk_block <= 8192:
            raise ValueError(f"--cache-disk-block must be within [1, 8192], got "
                             f"{self.cache_disk_block}")
        if self.sleep_idle_seconds == 0 or self.sleep_idle_seconds < -1:
            raise ValueError("--sleep-idle-seconds: invalid value: cannot be 0 or less than -1")
        if self.timeout < 1:
            raise ValueError(f"--timeout must be >= 1 second, got {self.timeout}")
        if self.max_body_mib < 1:
            raise ValueError(f"--max-body-mib must be >= 1, got {self.max_body_mib}")
        if (self.ssl_key_file is None) != (self.ssl_cert_file is None):
            raise ValueError("HTTPS needs both --ssl-key-file and --ssl-cert-file")
        for path in (self.ssl_key_file, self.ssl_cert_file):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"SSL file not found: {path!r}")
        if self.static_path and not os.path.isdir(self.static_path):
            raise ValueError(f"--path: not a directory: {self.static_path!r}")
        tcp_hosts = [h for h in self.host.split(",") if h.strip() and
                     not h.strip().endswith(".sock")]
        if not 0 <= self.port <= 65535 and tcp_hosts:  # 0: a free port (llama-server)
            raise ValueError(f"--port must be within 0..65535, got {self.port}")
        if self.port == 0 and len(tcp_hosts) > 1:
            raise ValueError("--port 0 is not supported with multiple TCP addresses")
        self.spec.validate()
        if self.cache_ram_mib < -1:
            raise ValueError("--cache-ram must be -1 (no limit), 0 (off) or a size in MiB")
        if self.models_max < 0:
            raise ValueError(f"--models-max must be >= 0 (0: no limit), got {self.models_max}")
        if self.cache_pin_mib < 0:
            raise ValueError(f"--cache-pin-mib must be 0 (no pins) or a size in MiB, got "
                             f"{self.cache_pin_mib}")

    @property
    def can_pin(self) -> bool:
        """Whether `prompt_cache_retention` pins can be kept: the radix RAM tier and a budget."""
        return self.cache_radix_prompt and self.cache_ram_mib != 0 and self.cache_pin_mib > 0


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """What a request gets for each field it leaves out: the server's flags (-n, --temp...,
    -s, --keep, -r, --ignore-eos, -sp, --cache-prompt, --grammar, --spec-*, the chat flags),
    gathered once from a `ServerConfig` (`from_config`) and read where a request is parsed
    (http/parse.py) and where /props reports them. The defaults themselves live on
    `ServerConfig` only (no field here has a default of its own); this is the one object that
    carries them to requests."""

    n_predict: int  # --n-predict; also a cap on what requests may ask for
    cache_prompt: bool  # --cache-prompt
    seed: int  # -s: wins over `sampling.seed` unless -1
    sampling: SamplingParams  # --temp, --top-k, ...
    n_keep: int  # --keep
    stop: tuple[str, ...]  # -r: a request's own stop strings replace these
    ignore_eos: bool  # --ignore-eos
    special: bool  # -sp: special tokens appear in the text
    grammar: str | None  # --grammar/--grammar-file/-j/-jf, compiled (llguidance)
    chat_template_kwargs: dict[str, object]
    prefill_assistant: bool  # --no-prefill-assistant: a last assistant turn is complete
    reasoning_format: str  # --reasoning-format: requests may choose their own
    skip_chat_parsing: bool  # --skip-chat-parsing: replies stay plain content
    spec: SpecConfig  # --spec-*: speculative decoding
    can_pin: bool  # `prompt_cache_retention` other than in_memory can be honored
    verbose: bool  # -v (verbosity above 9, as llama-server): answers carry `__verbose`

    @classmethod
    def from_config(cls, cfg: ServerConfig | None = None) -> RequestDefaults:
        """`cfg`'s defaults; without one, those of a server started with no flags."""
        cfg = ServerConfig() if cfg is None else cfg
        return cls(
            n_predict=cfg.n_predict,
            cache_prompt=cfg.cache_prompt,
            seed=cfg.seed,
            sampling=cfg.sampling,
            n_keep=cfg.n_keep,
            stop=tuple(cfg.stop),
            ignore_eos=cfg.ignore_eos,
            special=cfg.special,
            grammar=cfg.grammar or None,
            chat_template_kwargs=cfg.chat_template_kwargs,
            prefill_assistant=cfg.prefill_assistant,
            reasoning_format=cfg.reasoning_format,
            skip_chat_parsing=cfg.skip_chat_parsing,
            spec=cfg.spec,
            can_pin=cfg.can_pin,
            verbose=cfg.log_verbosity > 9,
        )


"""Every setting of radixserve with its default, in one place.

Flag names and defaults mirror llama-server's so users can carry their command lines over;
the CLI builds a `ServerConfig` and everything below it reads from that object only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "f32", "bf16", "f16")
WEIGHTS = ("auto", "native", "dequant")


@dataclass(slots=True)
class ServerConfig:
    model: str = "default"
    alias: str | None = None
    dtype: str = "auto"
    weights: str = "auto"  # auto: native unless f32 compute; native: 4-bit blocks run packed
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
    cache_reuse: int = 0
    cache_prompt: bool = True
    slots_endpoint: bool = True
    metrics: bool = False
    log_verbosity: int = 3
    # host tier (issues 4/5)
    cache_ram_mib: int = 8192  # -1 unlimited, 0 off
    cache_idle_slots: bool = True
    cache_radix_prompt: bool = True
    cache_radix_min_restore_tokens: int = 0
    # disk tier (issue 6)
    slot_save_path: str | None = None
    # default sampling / generation
    n_predict: int = -1

    def validate(self) -> None:
        """Reject settings that cannot work, with a message naming the flag."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
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
        if self.cache_ram_mib < -1:
            raise ValueError("--cache-ram must be -1 (no limit), 0 (off) or a size in MiB")

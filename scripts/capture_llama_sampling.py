"""Capture llama-server's sampler-chain probabilities as test fixtures.

Talks HTTP only, to an already-running llama-server on the default model, e.g.

    llama-server -m <default gguf> --port 8091 -c 2048 -np 1
    python scripts/capture_llama_sampling.py http://127.0.0.1:8091

and writes tests/http/fixtures/llama-server-sampling/cases.json: for each sampler
configuration, the /completion request (a fixed prompt and seed, n_predict 2, n_probs 10) and
the `tokens`, `content` and `completion_probabilities` llama-server answered.
tests/http/test_sampling_llama.py replays the requests against radixserve.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests/http/fixtures/llama-server-sampling/cases.json"
PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat sat on the"
BASE = {"prompt": PROMPT, "n_predict": 2, "n_probs": 10, "seed": 70, "cache_prompt": False,
        "return_tokens": True}
POST = {"post_sampling_probs": True}

# name -> request fields on top of BASE (post-sampling probabilities unless said otherwise)
CASES: dict[str, dict] = {
    "default": {**POST},
    "greedy": {**POST, "temperature": 0},
    "top_k_5_temp_1_5": {**POST, "top_k": 5, "temperature": 1.5},
    "top_p_0_6": {**POST, "top_k": 0, "top_p": 0.6, "min_p": 0, "temperature": 1.0},
    "min_p_0_1": {**POST, "top_k": 0, "top_p": 1.0, "min_p": 0.1, "temperature": 1.0},
    "typical_0_5": {**POST, "top_k": 0, "typical_p": 0.5, "min_p": 0, "temperature": 1.0},
    "top_n_sigma_1": {**POST, "top_k": 0, "top_n_sigma": 1.0, "min_p": 0, "top_p": 1.0},
    "xtc": {**POST, "xtc_probability": 1.0, "xtc_threshold": 0.07, "top_k": 20, "min_p": 0},
    "dynatemp": {**POST, "dynatemp_range": 0.5, "dynatemp_exponent": 1.5, "top_k": 20},
    "mirostat_1": {**POST, "mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    "mirostat_2": {**POST, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
    "penalties": {**POST, "repeat_penalty": 1.3, "frequency_penalty": 0.4,
                  "presence_penalty": 0.3, "repeat_last_n": 32, "top_k": 20},
    "dry": {**POST, "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
            "top_k": 20},
    "dry_breakers": {**POST, "dry_multiplier": 0.8, "dry_sequence_breakers": ["mat", "\n"],
                     "top_k": 20},
    "logit_bias": {**POST, "logit_bias": [[" mat", 3.0], [" cat", False], [260, -2.5]],
                   "top_k": 20},
    "logit_bias_object": {**POST, "logit_bias": {" mat": -4.0, "17": 1.0}, "top_k": 20},
    "order_temp_first": {**POST, "samplers": ["temperature", "top_k", "min_p"],
                         "temperature": 2.0, "top_k": 12, "min_p": 0.2},
    "order_chars_min_keep": {**POST, "samplers": "mkt", "min_p": 0.5, "min_keep": 4,
                             "top_k": 8},
    "adaptive_p": {**POST, "samplers": ["top_k", "temperature", "adaptive_p"],
                   "adaptive_target": 0.3, "adaptive_decay": 0.8, "top_k": 20},
    "ignore_eos": {**POST, "ignore_eos": True, "top_k": 20},
    "raw_default": {},
    "raw_greedy": {"temperature": 0},
    "raw_top_k_3": {"top_k": 3, "n_probs": 5},
}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main(url: str) -> None:
    cases = []
    for name, extra in CASES.items():
        body = {**BASE, **extra}
        r = post(url.rstrip("/"), body)
        cases.append({"name": name, "request": body,
                      "response": {k: r[k] for k in ("content", "tokens",
                                                     "completion_probabilities")}})
        print(name, repr(r["content"]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"prompt": PROMPT, "cases": cases}, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8091")

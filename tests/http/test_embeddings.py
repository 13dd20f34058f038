"""/embedding, /embeddings and /v1/embeddings (--embeddings, --pooling, --embd-normalize) on the
default model, against HF transformers' hidden states on the same GGUF (f32), each pooling.

The engines run in process over models loaded once (a Model is read only): the default model
in f32 on dequantized weights (equal to the reference within f32 rounding) and on its default
path (bf16 activations, packed Q4 weights, deterministic mode: close to the reference, and
batch- and prefix-invariant bit for bit).
"""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import Iterator

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from radixserve.config import ServerConfig
from radixserve.engine.engine import Engine
from radixserve.errors import TaskError
from radixserve.flags import FlagError, parse_serve
from radixserve.http.routes_embeddings import normalize
from radixserve.model.loader import Model, load_model
from tests.http.harness import app_client

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "一个中文句子，用来测试。",
    "def f(x):\n    return x * 2\n",
]
POOLINGS = ["none", "mean", "cls", "last"]


def pooled(h: torch.Tensor, pooling: str) -> torch.Tensor:
    return {"none": h, "mean": h.mean(0, keepdim=True), "cls": h[:1], "last": h[-1:]}[pooling]


@pytest.fixture(scope="module")
def hf_hidden(default_path: str, default_f32_dequant: Model) -> list[torch.Tensor]:
    """HF transformers (f32) output-normed hidden states of every text: `hidden_states[-1]`
    is the final norm's output, the rows llama.cpp's embeddings read (its `t_embd`)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_path), gguf_file=os.path.basename(default_path),
        dtype=torch.float32).eval()
    tok = default_f32_dequant.tokenizer
    out = []
    with torch.no_grad():
        for t in TEXTS:
            ids = tok.encode(t, add_special=True, parse_special=True)
            out.append(hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0])
    return out


@pytest.fixture(scope="module")
def default_bf16(default_path: str) -> Model:
    return load_model(default_path)


def client(model: Model, **kw) -> Iterator[TestClient]:
    cfg = ServerConfig(**{"embeddings": True, **kw})
    return app_client(Engine(model, cfg), cfg)


def embed(c: TestClient, content, **kw) -> list[list[list[float]]]:
    r = c.post("/embedding", json={"content": content, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [e["index"] for e in body] == list(range(len(body)))
    return [e["embedding"] for e in body]


@pytest.mark.parametrize("pooling", POOLINGS)
def test_f32_equals_hf_reference(default_f32_dequant: Model, hf_hidden, pooling: str):
    """f32 on dequantized weights: every pooling within f32 rounding of the reference
    (measured: max 4.6e-5 on values up to 48); raw (embd_normalize -1), then normalized."""
    with client(default_f32_dequant, pooling=pooling) as c:
        raw = embed(c, TEXTS, embd_normalize=-1)
        unit = embed(c, TEXTS)
    for got, norm, ref in zip(raw, unit, hf_hidden):
        want = pooled(ref, pooling)
        got_t = torch.tensor(got)
        assert got_t.shape == want.shape
        assert (got_t - want).abs().max().item() < 2e-4
        if pooling == "none":  # per-token rows are never normalized (llama-server)
            assert norm == got
        else:
            n = torch.tensor(norm[0])
            assert abs(n.norm().item() - 1.0) < 1e-5
            assert (n - want[0] / want[0].norm()).abs().max().item() < 1e-5


@pytest.mark.parametrize("pooling", POOLINGS)
def test_default_path_close_to_hf_reference(default_bf16: Model, hf_hidden, pooling: str):
    """The default path (the tiles' 8-bit activations, as llama-server's): cosine >= 0.995 to
    the reference for every vector (measured min 0.9979 per token; 0.9998 with bf16
    activations), max error within 5% of the largest value (measured 3.5%; 2% with bf16)."""
    with client(default_bf16, pooling=pooling) as c:
        raw = embed(c, TEXTS, embd_normalize=-1)
    for got, ref in zip(raw, hf_hidden):
        want, got_t = pooled(ref, pooling), torch.tensor(got)
        assert got_t.shape == want.shape
        assert torch.nn.functional.cosine_similarity(got_t, want, dim=1).min().item() > 0.995
        assert (got_t - want).abs().max().item() < 0.05 * want.abs().max().item()


@pytest.fixture(scope="module")
def solo(default_bf16: Model) -> dict[str, list[list[list[float]]]]:
    """Each text alone on a fresh engine that caches nothing (--no-cache-prompt), per pooling:
    the reference the batched and prefix-reusing runs must equal bit for bit."""
    out = {}
    for pooling in ("mean", "last"):
        with client(default_bf16, pooling=pooling, cache_prompt=False) as c:
            out[pooling] = [embed(c, t, embd_normalize=-1)[0] for t in TEXTS]
    return out


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_batch_equals_one_at_a_time(default_bf16: Model, solo, pooling: str):
    """Eight inputs in one request run on four slots, batched in the same forwards (and
    chunked by -ub 16 differently from the solo runs): every result equals the text alone."""
    with client(default_bf16, pooling=pooling, ubatch_size=16) as c:
        got = embed(c, TEXTS + TEXTS[::-1], embd_normalize=-1)
    assert got == solo[pooling] + solo[pooling][::-1]


def test_last_pooling_reuses_a_cached_prefix_exactly(default_bf16: Model, solo):
    """`last` reads the final row only, so a longer text whose prefix a slot holds computes
    just the rest (/slots shows how many came from the cache); the donor's result and the
    reusing one's both equal the texts computed alone."""
    base, longer = TEXTS[1], TEXTS[1] + " And then it slept."
    tok = default_bf16.tokenizer
    n_base = len(tok.encode(base, add_special=True, parse_special=True))
    with client(default_bf16, pooling="last", n_parallel=1) as c:
        donor = embed(c, base, embd_normalize=-1)[0]
        reused = embed(c, longer, embd_normalize=-1)[0]
        slot = c.get("/slots").json()[0]
    assert slot["n_prompt_tokens_cache"] == n_base
    assert donor == solo["last"][1]
    with client(default_bf16, pooling="last", cache_prompt=False) as c:
        assert reused == embed(c, longer, embd_normalize=-1)[0]


def test_mean_pooling_recomputes_and_completions_still_run(default_bf16: Model, solo):
    """mean needs every token's row: a repeated text is computed in full (no reuse), equal
    again; completions are served beside embeddings (llama-server serves both)."""
    with client(default_bf16, pooling="mean", n_parallel=1) as c:
        first = embed(c, TEXTS[1], embd_normalize=-1)[0]
        again = embed(c, TEXTS[1], embd_normalize=-1)[0]
        slot = c.get("/slots").json()[0]
        r = c.post("/completion", json={"prompt": "Once upon a time", "n_predict": 4,
                                        "temperature": 0})
    assert first == again == solo["mean"][1]
    assert slot["n_prompt_tokens_cache"] == 0
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 4


def test_openai_sdk_round_trip(default_bf16: Model):
    """The OpenAI SDK's embeddings.create: its default base64 transfer and float give the same
    vectors, in input order, unit length; usage counts the input tokens."""
    tok = default_bf16.tokenizer
    with client(default_bf16, pooling="mean") as c:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c)
        b64 = sdk.embeddings.create(model="m", input=TEXTS[:3])
        flt = sdk.embeddings.create(model="m", input=TEXTS[:3], encoding_format="float")
        one = sdk.embeddings.create(model="m", input=TEXTS[2], encoding_format="float")
        raw = c.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert [d.index for d in flt.data] == [0, 1, 2]
    assert [d.embedding for d in b64.data] == [d.embedding for d in flt.data]
    assert one.data[0].embedding == flt.data[2].embedding
    assert flt.model == "m" and flt.object == "list"
    n = sum(len(tok.encode(t, add_special=True, parse_special=True)) for t in TEXTS[:3])
    assert flt.usage.prompt_tokens == flt.usage.total_tokens == n
    for d in flt.data:
        assert len(d.embedding) == default_bf16.hp.n_embd
        assert abs(sum(x * x for x in d.embedding) - 1.0) < 1e-5
    item = raw.json()["data"][0]
    assert item["encoding_format"] == "base64"
    vec = list(struct.unpack(f"<{default_bf16.hp.n_embd}f", base64.b64decode(item["embedding"])))
    assert vec == [struct.unpack("<f", struct.pack("<f", x))[0] for x in flt.data[0].embedding]


@pytest.mark.parametrize("norm,total", [(-1, 1.0), (0, 4.0 / 32760), (1, 7.5),
                                        (2, 25.25 ** 0.5), (3, 91.125 ** (1 / 3))])
def test_embd_normalize_is_llama_cpp_formula(norm: int, total: float):
    """common_embd_normalize on [3, -4, 0.5, 0]: the divisor per mode, applied in f32."""
    v = [3.0, -4.0, 0.5, 0.0]
    want = (torch.tensor(v) * torch.tensor(1 / total, dtype=torch.float32)).tolist()
    assert normalize(v, norm) == pytest.approx(want, rel=1e-7, abs=0)
    assert normalize([0.0, 0.0], norm) == [0.0, 0.0]  # nothing to scale: zeros, not NaN


def test_token_and_mixed_inputs(default_bf16: Model):
    """Token ids, a mixed list and a list of token lists embed as the same text does."""
    tok = default_bf16.tokenizer
    ids = tok.encode(TEXTS[0], add_special=True, parse_special=True)
    with client(default_bf16, pooling="mean") as c:
        text = embed(c, TEXTS[0])
        assert embed(c, ids) == text
        assert embed(c, [ids, ids]) == text + text
        assert embed(c, [TEXTS[0]]) == text
        r = c.post("/v1/embeddings", json={"content": TEXTS[0]})  # content: the native shape
        assert r.json() == [{"index": 0, "embedding": text[0]}]


def _error(c: TestClient, path: str, body, status: int, message: str, type_: str) -> None:
    r = c.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] == message and err["type"] == type_ and err["code"] == status


def test_bad_inputs_get_llama_server_errors(default_bf16: Model):
    n_ctx = 64
    tok = default_bf16.tokenizer
    long = tok.encode("word " * 200, add_special=True, parse_special=True)
    with client(default_bf16, pooling="mean", ctx_size=n_ctx, n_parallel=1) as c:
        bad = "invalid_request_error"
        _error(c, "/v1/embeddings", {}, 400, '"input" or "content" must be provided', bad)
        _error(c, "/v1/embeddings", {"input": []}, 400, '"input" must not be empty', bad)
        _error(c, "/v1/embeddings", {"input": ""}, 400, "Input content cannot be empty", bad)
        _error(c, "/v1/embeddings", {"input": ["a", ""]}, 400,
               "Input content cannot be empty", bad)
        _error(c, "/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400,
               "The format to return the embeddings in. Can be either float or base64", bad)
        _error(c, "/v1/embeddings", {"input": "a", "dimensions": 64}, 400,
               "dimensions 64 is not supported: this model's embeddings have 576 dimensions "
               "(no reduced ones)", bad)
        _error(c, "/embedding", {"content": "a", "embd_normalize": -2}, 400,
               "embd_normalize must be -1, 0 or a p-norm >= 1, got -2", bad)
        _error(c, "/embedding", {"content": "a", "embd_normalize": "2"}, 400,
               "Field 'embd_normalize': Value must be an integer, but got \"2\"", bad)
        _error(c, "/embedding", {"content": [1, 10**7]}, 400,
               "Prompt contains invalid tokens", bad)
        _error(c, "/embedding", {"content": long[:n_ctx + 1]}, 400,
               f"input ({n_ctx + 1} tokens) is larger than the max context size ({n_ctx} "
               "tokens). skipping", "exceed_context_size_error")
        # exactly n_ctx tokens fit (nothing is generated), and the server is still up
        full = embed(c, long[:n_ctx])
        assert len(full) == 1 and len(full[0][0]) == 576
        assert c.post("/v1/embeddings", json={"input": "a", "dimensions": 576}).status_code == 200


def test_pooling_none_is_not_openai_and_off_without_the_flag(default_bf16: Model):
    with client(default_bf16) as c:  # no --pooling: the model's (none for SmolLM2)
        _error(c, "/v1/embeddings", {"input": "a"}, 400, "Pooling type 'none' is not OAI "
               "compatible. Please use a different pooling type", "invalid_request_error")
        rows = embed(c, "hello world")[0]
        assert len(rows) == 2  # one row a token
    cfg = ServerConfig()
    with app_client(Engine(default_bf16, cfg), cfg) as c:
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            _error(c, path, {"input": "a"}, 501, "This server does not support embeddings. "
                   "Start it with `--embeddings`", "not_supported_error")


def test_pooling_flags():
    cfg = parse_serve(["--embeddings", "--pooling", "cls", "--embd-normalize", "0"], {}).cfg
    assert (cfg.embeddings, cfg.pooling, cfg.embd_normalize) == (True, "cls", 0)
    env = parse_serve([], {"LLAMA_ARG_EMBEDDINGS": "1", "LLAMA_ARG_POOLING": "last"}).cfg
    assert env.embeddings and env.pooling == "last"
    with pytest.raises(FlagError, match="rank pooling needs a reranking model's "
                                        "classification head"):
        parse_serve(["--pooling", "rank"], {})
    with pytest.raises(FlagError, match="expected one of none, mean, cls, last, got 'max'"):
        parse_serve(["--pooling", "max"], {})


def test_gemma3_sliding_window_embeddings_are_chunk_and_batch_invariant():
    """Gemma 3 (sliding-window layers, their cells dropped after each chunk): a 700-token
    text (beyond its 512-position window) pooled in 64-token chunks beside three other texts
    equals the text alone in one chunk, bit for bit; mean pooling is the mean of the
    per-token rows (none) of the same run."""
    from radixserve.model.default_model import gemma3_model_path
    model = load_model(gemma3_model_path())
    tok = model.tokenizer
    long = tok.encode("The river runs through the old town. " * 90, add_special=True,
                      parse_special=True)[:700]
    assert len(long) == 700 and model.hp.n_swa == 512
    batch = [long, TEXTS[0], TEXTS[2], TEXTS[1]]
    with client(model, pooling="mean", ubatch_size=64, ctx_size=4096) as c:
        together = embed(c, batch, embd_normalize=-1)
    alone = []
    for item in batch:
        with client(model, pooling="mean", ctx_size=4096, cache_prompt=False) as c:
            alone += embed(c, item, embd_normalize=-1)
    assert together == alone
    with client(model, pooling="none", ubatch_size=64, ctx_size=4096) as c:
        rows = torch.tensor(embed(c, long)[0])
    assert rows.shape == (700, model.hp.n_embd)
    assert torch.equal(rows.mean(0), torch.tensor(together[0][0]))


def test_embeddings_batched_with_speculative_decoding(default_bf16: Model, solo):
    """Embeddings sent while a completion verifies n-gram drafts (several rows a decode
    step) on another of 3 slots, so their chunks can share its forwards: the completion's text
    equals its run alone, the vectors the texts alone, and drafts were accepted."""
    from concurrent.futures import ThreadPoolExecutor

    from radixserve.config import SpecConfig
    spec = SpecConfig(types=["ngram-simple"], ngram_simple_size_n=4, ngram_simple_size_m=8)
    body = {"prompt": "one two three four five six seven eight one two three four five six "
                      "seven eight one two three four", "n_predict": 48, "temperature": 0}
    with client(default_bf16, pooling="mean", spec=spec, n_parallel=3, ubatch_size=32) as c:
        alone = c.post("/completion", json=body).json()
        with ThreadPoolExecutor(2) as pool:
            done = pool.submit(c.post, "/completion", json=body)
            vecs = [embed(c, TEXTS, embd_normalize=-1) for _ in range(2)]
            together = done.result().json()
    assert together["tokens_predicted"] == 48 and together["content"] == alone["content"]
    assert together["timings"]["draft_n_accepted"] > 0
    assert vecs == [solo["mean"], solo["mean"]]


def test_slots_let_go_of_rows_and_results(default_bf16: Model):
    """An embedding's kept rows and its result leave the slot when the task ends: sent,
    cancelled half-way through its prompt (64-token chunks), or failed."""
    from radixserve.engine.counters import ServerMetrics
    from radixserve.engine.build import build_scheduler
    from radixserve.engine.task import CompletionTask
    tok = default_bf16.tokenizer
    ids = tok.encode(TEXTS[1], add_special=True, parse_special=True)
    cfg = ServerConfig(embeddings=True, pooling="none", ubatch_size=64, n_parallel=1)
    sched = build_scheduler(default_bf16, cfg, ServerMetrics())
    got: list = []
    sent = CompletionTask(prompt_tokens=ids, n_predict=0, cache_prompt=False, stream=False,
                          pooling="none")
    sched.submit(sent, got.append)
    while sched.has_active():
        sched.step()
    slot = sched.slots[0]
    assert got[-1].embedding.shape == (len(ids), 576)
    assert slot.rows == [] and slot.embedding is None
    for end in ("cancel", "fail"):
        task = CompletionTask(prompt_tokens=ids, n_predict=0, cache_prompt=False,
                              stream=False, pooling="none")
        sched.submit(task, got.append)
        sched.step()
        assert len(slot.rows) == 1  # one chunk kept, the prompt not done
        if end == "cancel":
            sched.cancel(task)
        else:
            sched._fail(slot, TaskError(500, "server_error", "test"))
        assert slot.rows == [] and slot.embedding is None and not slot.is_processing
    sched.check()


def test_context_limits_by_pooling(default_bf16: Model):
    """llama-server's limits: an input pooled over every row may fill the context (n_ctx
    tokens); `last` follows the completion rule (n_ctx - 1)."""
    n_ctx = 64
    ids = default_bf16.tokenizer.encode("word " * 100, add_special=True, parse_special=True)
    with client(default_bf16, pooling="last", ctx_size=n_ctx, n_parallel=1) as c:
        _error(c, "/embedding", {"content": ids[:n_ctx]}, 400,
               f"request ({n_ctx} tokens) exceeds the available context size ({n_ctx} "
               "tokens), try increasing it", "exceed_context_size_error")
        assert len(embed(c, ids[:n_ctx - 1])[0]) == 1
    with client(default_bf16, pooling="cls", ctx_size=n_ctx, n_parallel=1) as c:
        assert len(embed(c, ids[:n_ctx])[0]) == 1


def test_unknown_pooling_type_matters_only_with_embeddings(tmp_path):
    """A GGUF whose pooling_type llama.cpp does not know loads and completes; a server with
    --embeddings refuses to start on it unless --pooling says how to pool."""
    from radixserve.engine.counters import ServerMetrics
    from radixserve.engine.build import build_scheduler
    from tests.tiny_gguf import write_tiny_gguf
    path = write_tiny_gguf(str(tmp_path / "odd.gguf"), pooling_type=9)
    odd = load_model(path, "f32")
    assert odd.hp.pooling == "pooling_type 9"
    build_scheduler(odd, ServerConfig(), ServerMetrics())
    with pytest.raises(ValueError, match=r"embedding pooling \(pooling_type 9\) is not "
                                         "computed here"):
        build_scheduler(odd, ServerConfig(embeddings=True), ServerMetrics())
    build_scheduler(odd, ServerConfig(embeddings=True, pooling="mean"), ServerMetrics())
    ranked = load_model(write_tiny_gguf(str(tmp_path / "rank.gguf"), pooling_type=4), "f32")
    with pytest.raises(ValueError, match=r"\(rank\) is not computed here \(rank needs a "
                                         r"reranker's classification head\)"):
        build_scheduler(ranked, ServerConfig(embeddings=True), ServerMetrics())
    with client(load_model(write_tiny_gguf(str(tmp_path / "cls.gguf"), pooling_type=2),
                           "f32")) as c:  # the GGUF's pooling when --pooling is unset
        assert len(embed(c, "hello world")[0]) == 1


def test_embeddings_stay_out_of_the_host_tiers(default_bf16: Model):
    """As llama-server keeps embeddings out of its prompt cache: what an embedding computed is
    never saved to host RAM (so a bulk embedding job cannot wash out chat prefixes), whichever
    way its slot is overwritten; a completion's prompt after it is saved as usual."""
    cfg = ServerConfig(embeddings=True, pooling="last", n_parallel=1)
    engine = Engine(default_bf16, cfg)
    with app_client(engine, cfg) as c:
        for t in TEXTS:
            embed(c, t)
        cache = engine.scheduler.mem.cache
        assert cache.stats()["saves"] == 0
        for t in TEXTS[:2]:
            c.post("/completion", json={"prompt": t, "n_predict": 2, "temperature": 0})
        assert cache.stats()["saves"] >= 1

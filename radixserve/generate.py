"""Single-prompt generation for `radixserve generate`: one sequence, no server, no slots."""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Iterator

from radixserve.engine.batch import BatchSeq, hidden
from radixserve.engine.build import model_pool
from radixserve.engine.task import Timings
from radixserve.model.loader import Model
from radixserve.sampling.chain import Sampler, SamplingParams


def summary(t: Timings) -> str:
    """llama-server's rates (the first generated token is free: it comes with the prompt)."""
    j = t.to_json()
    return (f"prompt: {t.prompt_n} tokens, {j['prompt_per_second']:.1f} tok/s | "
            f"generation: {t.predicted_n} tokens, {j['predicted_per_second']:.1f} tok/s")


def generate(
    model: Model, prompt: str, n_predict: int, params: SamplingParams, chat: bool, stats: Timings
) -> Iterator[str]:
    """Yield text pieces as they are generated (UTF-8 safe), filling `stats`."""
    if chat:
        prompt = model.chat_template.render([{"role": "user", "content": prompt}])
    ids = model.tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    hp = model.hp
    n_ctx = min(hp.n_ctx_train, len(ids) + (n_predict if n_predict >= 0 else hp.n_ctx_train))
    if len(ids) >= n_ctx:
        raise ValueError(f"prompt ({len(ids)} tokens) exceeds the context ({n_ctx} tokens)")
    pool = model_pool(model, n_ctx, 1, True, len(ids))
    sampler = Sampler(params, model.tokenizer.n_vocab, ids)
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    t0 = time.perf_counter()
    tr = model.transformer
    logits = tr.w.head.logits(hidden(tr, pool, [BatchSeq(0, ids, 0)]), [sampler.head_need()])
    t1 = time.perf_counter()
    stats.prompt_n, stats.prompt_ms = len(ids), (t1 - t0) * 1e3
    pos = len(ids)
    while n_predict < 0 or stats.predicted_n < n_predict:
        tok = sampler.sample(logits[-1])
        sampler.accept(tok)
        stats.predicted_n += 1
        if model.tokenizer.is_eog(tok):
            break
        yield utf8.decode(model.tokenizer.token_to_piece(tok, special=False))
        if pos + 1 >= n_ctx:
            break
        logits = tr.w.head.logits(hidden(tr, pool, [BatchSeq(0, [tok], pos)]),
                                  [sampler.head_need()])
        pos += 1
        stats.predicted_ms = (time.perf_counter() - t1) * 1e3
    yield utf8.decode(b"", final=True)


def run_generate(model: Model, prompt: str, n_predict: int, params: SamplingParams,
                 chat: bool) -> Timings:
    stats = Timings()
    for piece in generate(model, prompt, n_predict, params, chat, stats):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary(stats), file=sys.stderr)
    return stats

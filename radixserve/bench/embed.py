"""`radixserve bench embed --url URL [--label NAME] ...`: embeddings throughput of running
servers (radixserve and llama-server started with `--embeddings --pooling P`, same model).

Every server gets the same seeded texts (bench/words.py), `--batch` texts a /v1/embeddings
request, `--concurrency` requests in flight; each repeat is timed whole (texts/s, and input
tokens/s from the servers' own `usage`), the table shows medians. The vectors are compared
with the first server's (cosine, min and median over the texts), so a fast wrong answer shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.words import WORDS


def texts(n: int, n_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."
            for _ in range(n)]


async def run_once(url: str, items: list[str], batch: int, concurrency: int
                   ) -> tuple[float, int, list[list[float]]]:
    """(seconds, input tokens, vectors in input order) for one pass over `items`."""
    chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
    out: list[list[list[float]]] = [[] for _ in chunks]
    n_tokens = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(chunks)):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal n_tokens
        while not queue.empty():
            i = queue.get_nowait()
            r = await client.post(f"{url}/v1/embeddings",
                                  json={"input": chunks[i], "encoding_format": "float"})
            r.raise_for_status()
            body = r.json()
            n_tokens += body["usage"]["prompt_tokens"]
            out[i] = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]

    async with httpx.AsyncClient(timeout=600.0) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    return dt, n_tokens, [v for part in out for v in part]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="radixserve bench embed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", action="append", required=True, help="a server (repeatable)")
    ap.add_argument("--label", action="append", default=None, help="its name, in order")
    ap.add_argument("--texts", type=int, default=128, help="texts a pass (%(default)s)")
    ap.add_argument("--words", type=int, default=60, help="words a text (%(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="texts a request (%(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight "
                    "(%(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (%(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    labels = a.label or []
    labels += [f"server{i}" for i in range(len(labels), len(a.url))]
    items = texts(a.texts, a.words)
    rows: list[dict[str, Any]] = []
    first: list[list[float]] | None = None
    for url, label in zip(a.url, labels):
        asyncio.run(run_once(url, items[: a.batch], a.batch, 1))  # warm-up
        runs = [asyncio.run(run_once(url, items, a.batch, a.concurrency))
                for _ in range(a.repeats)]
        secs = [r[0] for r in runs]
        vecs = runs[-1][2]
        first = vecs if first is None else first
        cos = [cosine(x, y) for x, y in zip(vecs, first)]
        rows.append({"label": label, "url": url, "texts_per_s": len(items) / statistics.median(
            secs), "tokens_per_s": runs[0][1] / statistics.median(secs), "seconds": secs,
                     "input_tokens": runs[0][1], "cos_min": min(cos),
                     "cos_median": statistics.median(cos)})
    print(f"{len(items)} texts of {a.words} words, {a.batch} a request, {a.concurrency} in "
          f"flight, median of {a.repeats}")
    print(f"{'server':<16} {'texts/s':>9} {'tokens/s':>9} {'tokens':>7} {'cos min':>8} "
          f"{'cos med':>8}")
    for r in rows:
        print(f"{r['label']:<16} {r['texts_per_s']:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['input_tokens']:>7} {r['cos_min']:>8.5f} {r['cos_median']:>8.5f}")
    if a.out is not None:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0

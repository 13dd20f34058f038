"""How far a server's next-token distributions are from HF transformers in f32 on the same GGUF:
`python -m radixserve.bench.accuracy MODEL.gguf [--llama-server URL]`.

Both parties read the same weights (transformers dequantizes the GGUF), so what differs is the
arithmetic: activation precision (bf16 rows, 8-bit codes), kernels, sums. Over the first
`--positions` positions of a fixed English text (public-domain passages below, tokenized by the
model's tokenizer with its BOS), each party's distribution of the next token is compared with
the reference's P:
- kl: KL(P || Q) over the whole vocabulary, the mean over positions (radixserve in process:
  the logits of every position in one prefill, as the server computes them);
- kl_top: the same over P's top 32 tokens and the rest as one outcome, what a server that lists
  only its top tokens allows (llama-server's `n_probs`: 100 of its log-probabilities a position,
  from its raw logits; a token of P's top 32 outside that list takes the smallest listed);
- greedy: the share of positions whose most likely token is the reference's.
One JSON line a party. The radixserve party is this checkout with the kernels RADIXSERVE_KERNELS
selects; "before"/"after" figures come from running this file against two checkouts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. "
    "Now we are engaged in a great civil war, testing whether that nation, or any nation so "
    "conceived and so dedicated, can long endure. We are met on a great battle-field of that "
    "war. We have come to dedicate a portion of that field, as a final resting place for those "
    "who here gave their lives that that nation might live. It is altogether fitting and proper "
    "that we should do this. But, in a larger sense, we can not dedicate -- we can not "
    "consecrate -- we can not hallow -- this ground. The brave men, living and dead, who "
    "struggled here, have consecrated it, far above our poor power to add or detract. The world "
    "will little note, nor long remember what we say here, but it can never forget what they "
    "did here. It is for us the living, rather, to be dedicated here to the unfinished work "
    "which they who fought here have thus far so nobly advanced. It is rather for us to be here "
    "dedicated to the great task remaining before us -- that from these honored dead we take "
    "increased devotion to that cause for which they gave the last full measure of devotion -- "
    "that we here highly resolve that these dead shall not have died in vain -- that this "
    "nation, under God, shall have a new birth of freedom -- and that government of the people, "
    "by the people, for the people, shall not perish from the earth.\n\n"
    "When in the Course of human events, it becomes necessary for one people to dissolve the "
    "political bands which have connected them with another, and to assume among the powers of "
    "the earth, the separate and equal station to which the Laws of Nature and of Nature's God "
    "entitle them, a decent respect to the opinions of mankind requires that they should "
    "declare the causes which impel them to the separation. We hold these truths to be "
    "self-evident, that all men are created equal, that they are endowed by their Creator with "
    "certain unalienable Rights, that among these are Life, Liberty and the pursuit of "
    "Happiness. That to secure these rights, Governments are instituted among Men, deriving "
    "their just powers from the consent of the governed, That whenever any Form of Government "
    "becomes destructive of these ends, it is the Right of the People to alter or to abolish "
    "it, and to institute new Government, laying its foundation on such principles and "
    "organizing its powers in such form, as to them shall seem most likely to effect their "
    "Safety and Happiness. Prudence, indeed, will dictate that Governments long established "
    "should not be changed for light and transient causes; and accordingly all experience hath "
    "shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right "
    "themselves by abolishing the forms to which they are accustomed."
)
TOP = 32  # kl_top: P's top tokens, the rest one outcome
LISTED = 100  # log-probabilities asked of llama-server a position


def tokens(model, n: int) -> list[int]:
    """The first n + 1 tokens of TEXT, the model's BOS first."""
    ids = model.tokenizer.encode(TEXT, add_special=True)
    if len(ids) < n + 1:
        raise SystemExit(f"the text has {len(ids)} tokens; --positions at most {len(ids) - 1}")
    return ids[: n + 1]


def reference(path: str, ids: list[int]) -> torch.Tensor:
    """HF transformers' log-probabilities [n, vocab] in f32 (position i: the token after i)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
        dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    return logits.log_softmax(-1)


def ours(model, ids: list[int]) -> torch.Tensor:
    """This checkout's log-probabilities [n, vocab]: the model as the server loads it (bf16,
    native weights), every position's logits from one prefill."""
    from radixserve.engine.batch import BatchSeq, forward
    from radixserve.engine.build import model_pool

    n = len(ids) - 1
    pool = model_pool(model, n + 1, 1, True, n)
    return forward(model.transformer, pool,
                   [BatchSeq(0, ids[:-1], 0, n_logits=n)]).float().log_softmax(-1)


def llama_server(url: str, ids: list[int]) -> list[dict[int, float]]:
    """llama-server's top LISTED log-probabilities after each prefix, {token: logprob}."""
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(1, len(ids)):
            r = c.post("/completion", json={"prompt": ids[:i], "n_predict": 1, "n_probs": LISTED,
                                            "cache_prompt": True, "temperature": 0})
            r.raise_for_status()
            top = r.json()["completion_probabilities"][0]["top_logprobs"]
            out.append({int(t["id"]): float(t["logprob"]) for t in top})
    return out


def kl_top(p: torch.Tensor, q: dict[int, float]) -> float:
    """KL over p's TOP tokens and the rest as one outcome; q: log-probabilities of some tokens
    (one of p's top tokens missing from q takes q's smallest)."""
    lp, idx = p.topk(TOP)
    floor = min(q.values())
    lq = torch.tensor([q.get(int(t), floor) for t in idx], dtype=torch.float64)
    lp = lp.double()
    kl = float((lp.exp() * (lp - lq)).sum())
    rest_p, rest_q = 1 - float(lp.exp().sum()), 1 - float(lq.exp().sum())
    if rest_p > 0:
        kl += rest_p * math.log(rest_p / max(rest_q, 1e-12))
    return kl


def figures(ref: torch.Tensor, q: torch.Tensor | list[dict[int, float]]) -> dict[str, float]:
    n = ref.shape[0]
    listed = q if isinstance(q, list) else [
        dict(zip(*(x.tolist() for x in reversed(row.topk(LISTED))))) for row in q]
    out = {"positions": n,
           "kl_top": sum(kl_top(ref[i], listed[i]) for i in range(n)) / n,
           "greedy": sum(max(listed[i], key=listed[i].get) == int(ref[i].argmax())
                         for i in range(n)) / n}
    if isinstance(q, torch.Tensor):
        out["kl"] = float((ref.exp() * (ref - q)).sum(-1).mean())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the GGUF both parties read")
    ap.add_argument("--positions", type=int, default=300)
    ap.add_argument("--llama-server", help="also measure llama-server at this URL (same GGUF)")
    ap.add_argument("--label", default="radixserve", help="the radixserve party's name")
    args = ap.parse_args(argv)
    from radixserve.model.kernel_config import KernelConfig
    from radixserve.model.kernels import variant_name
    from radixserve.model.loader import load_model

    kernels = KernelConfig.from_env()  # this tool's start-up: RADIXSERVE_KERNELS and siblings
    model = load_model(args.model, "bf16", weights="native", kernels=kernels)
    ids = tokens(model, args.positions)
    ref = reference(args.model, ids)
    rows = [{"party": args.label, "kernels": variant_name(kernels.load()),
             **figures(ref, ours(model, ids))}]
    if args.llama_server:
        rows.append({"party": "llama-server", **figures(ref, llama_server(args.llama_server, ids))})
    for r in rows:
        print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

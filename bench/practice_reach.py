"""How far does a base model read? Greedy first answer token on held-out practice documents by length.

    python bench/practice_reach.py MODEL_DIR --lengths 60 300 700 1400 2800 5600 --docs 30

Each document is envs/longctx/practice.py's `practice_document("needle", 10000 + i, length, questions=1, ask="colour",
distractors=0)`: one record in real Wikipedia passages, then its question and "Answer:" (seeds 10000+ are not the
recipe's practice seeds, which count from 0 per stage). `length` is the byte-estimate budget; the table prints the
mean token count with the model's tokenizer. Chance is 1 in 10 colours. bench/README.md ("Long context the model
uses") has the numbers measured with it.
"""

from __future__ import annotations

import argparse
import re

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--lengths", type=int, nargs="+", default=[60, 300, 700, 1400, 2800, 5600])
    p.add_argument("--docs", type=int, default=30)
    args = p.parse_args()
    from k3rl.envs.longctx.practice import PLAIN_QA, practice_document
    from k3rl.model.formats.load import load_model
    from k3rl.model.tokenizer import load_tokenizer

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model_dir), load_tokenizer(args.model_dir)
    print("| length budget | tokens | first answer token right | mean log p of the answer |\n|---|---|---|---|")
    for length in args.lengths:
        hits, logp, tokens = 0, 0.0, 0
        for i in range(args.docs):
            doc = practice_document("needle", 10_000 + i, length, questions=1, ask="colour", distractors=0,
                                    paraphrase_rate=0.0)
            question, answer = re.search(r"\nQuestion: (.*)\nAnswer: (.*)\n", doc).groups()
            prompt = doc[: doc.index(PLAIN_QA.format(question=question))] + PLAIN_QA.format(question=question)
            ids = tok.encode(prompt, add_special_tokens=False)
            gold = tok.encode(prompt + " " + answer, add_special_tokens=False)[len(ids):]
            lp = model(torch.tensor([ids + gold])).logits[0].log_softmax(-1)
            hits += int(lp[len(ids) - 1].argmax()) == gold[0]
            logp += sum(float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(gold))
            tokens += len(ids)
        print(f"| {length} | {tokens / args.docs:.0f} | {hits}/{args.docs} | {logp / args.docs:.2f} |", flush=True)


if __name__ == "__main__":
    main()

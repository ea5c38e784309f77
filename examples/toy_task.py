"""The offline toy task: sort a digit string. Writes a tokenizer, a tiny random causal LM and datasets in TRL's
standard formats, deterministically and in seconds, so every script runs (and is tested) with no download.

    python examples/toy_task.py --out toy              # toy/model, toy/sft, toy/preference, toy/prompts
    python examples/toy_task.py --eval runs/sft --data toy/prompts/test.jsonl   # greedy exact-match accuracy
    python examples/toy_task.py --mistakes_of runs/sft --data toy/prompts --out runs/pairs  # pairs on its own mistakes

Task: prompt "sort: 31415 ->", completion " 11345" (then EOS). The answer is checkable, so RL scripts can use an
exact-match verifier, and preference pairs are (correct, plausible mistake).
"""

import argparse
import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer():
    """Byte-level BPE with no merges: one token per byte, like Qwen2's tokenizer minus its merges. transformers 5
    reloads a qwen2 folder with Qwen2Tokenizer, which rebuilds the tokenizer from vocab + merges; a byte-level BPE
    survives that round trip with the same ids (a character-level WordLevel tokenizer would not: spaces vanish)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|eos|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_example(rng, min_len=3, max_len=8):
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    return f"sort: {digits} ->", " " + "".join(sorted(digits))


def mistake(rng, answer):
    """A plausible wrong answer: two neighbours swapped, a digit changed, dropped or repeated, or no sorting at all."""
    s = list(answer.strip())
    kind = rng.choice(["swap", "change", "drop", "repeat"])
    i = rng.randrange(len(s))
    if kind == "swap" and len(set(s)) > 1:
        j = rng.choice([j for j in range(len(s) - 1) if s[j] != s[j + 1]])
        s[j], s[j + 1] = s[j + 1], s[j]
    elif kind == "change" or kind == "swap":
        s[i] = rng.choice([d for d in "0123456789" if d != s[i]])
    elif kind == "drop":
        del s[i]
    else:
        s.insert(i, s[i])
    return " " + "".join(s)


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_toy_task(out, seed=0, num_train=4000, num_test=200):
    rng = random.Random(seed)
    tok = make_tokenizer()
    tok.save_pretrained(f"{out}/model")
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(f"{out}/model")
    # tokenizer check: what AutoTokenizer reloads must give the ids of the tokenizer we built
    reloaded = AutoTokenizer.from_pretrained(f"{out}/model")
    probe = "sort: 31415 -> 11345<|eos|><|user|>é\n"
    assert reloaded(probe)["input_ids"] == tok(probe)["input_ids"], "the saved tokenizer does not round-trip"

    seen, test = set(), []
    while len(test) < num_test:  # test prompts first, and never in any train split
        prompt, completion = make_example(rng)
        if prompt not in seen:
            seen.add(prompt)
            test.append((prompt, completion))
    train = []
    while len(train) < num_train:
        prompt, completion = make_example(rng)
        if prompt not in seen:
            train.append((prompt, completion))
    for split, pairs in (("train", train), ("test", test)):
        write_jsonl(f"{out}/sft/{split}.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
        write_jsonl(
            f"{out}/preference/{split}.jsonl",
            [{"prompt": p, "chosen": c, "rejected": mistake(rng, c)} for p, c in pairs],
        )
        write_jsonl(f"{out}/prompts/{split}.jsonl", [{"prompt": p, "answer": c.strip()} for p, c in pairs])


@torch.no_grad()
def exact_match(model_dir, data_file, max_new_tokens=12, batch_size=100):
    """Greedy exact-match accuracy of a causal LM folder on a prompts file (prompt + answer columns)."""
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(data_file)]
    correct = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        enc = tok([r["prompt"] for r in batch], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(t.strip() == r["answer"] for t, r in zip(texts, batch))
    return correct / len(rows)


@torch.no_grad()
def write_mistake_pairs(
    model_dir, prompts_dir, out, num_samples=4, temperature=1.0, max_prompts=None, seed=0, batch_size=250
):
    """Preference pairs on a model's own mistakes (on-policy negatives): sample `num_samples` completions per prompt at
    `temperature`; chosen = the right answer, rejected = the first wrong sample. Prompts the model never gets wrong give
    no pair. DPO on these targets what this model actually gets wrong (the fixed toy/preference mistakes do not)."""
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    counts = {}
    for split in ("train", "test"):
        rows = [json.loads(line) for line in open(f"{prompts_dir}/{split}.jsonl")][:max_prompts]
        pairs = []
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            enc = tok([r["prompt"] for r in batch], return_tensors="pt", padding=True)
            out_ids = model.generate(
                **enc,
                max_new_tokens=12,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                num_return_sequences=num_samples,
                pad_token_id=tok.pad_token_id,
            )
            texts = tok.batch_decode(out_ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for j, r in enumerate(batch):
                wrong = [
                    t for t in texts[j * num_samples : (j + 1) * num_samples] if t.strip() != r["answer"] and t.strip()
                ]
                if wrong:
                    pairs.append(
                        {"prompt": r["prompt"], "chosen": " " + r["answer"], "rejected": " " + wrong[0].strip()}
                    )
        write_jsonl(f"{out}/{split}.jsonl", pairs)
        counts[split] = (len(pairs), len(rows))
    return counts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder to write the toy task to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval", help="a causal LM folder to score by greedy exact match")
    parser.add_argument(
        "--data", help="prompts file for --eval, prompts folder for --mistakes_of (prompt + answer columns)"
    )
    parser.add_argument(
        "--mistakes_of", help="a causal LM folder: write preference pairs on its sampled mistakes to --out"
    )
    parser.add_argument("--max_prompts", type=int, help="--mistakes_of: the first N prompts of each split only")
    args = parser.parse_args()
    if args.mistakes_of:
        counts = write_mistake_pairs(
            args.mistakes_of, args.data, args.out, max_prompts=args.max_prompts, seed=args.seed
        )
        print(
            f"wrote {args.out}: " + ", ".join(f"{split} {n} pairs from {m} prompts" for split, (n, m) in counts.items())
        )
    elif args.out:
        write_toy_task(args.out, args.seed)
        print(f"wrote {args.out}/model, {args.out}/sft, {args.out}/preference, {args.out}/prompts")
    if args.eval:
        print(f"exact_match {exact_match(args.eval, args.data):.4f}")

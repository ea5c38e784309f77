"""The offline toy task: sort distinct digits, with a flawed demonstrator. Writes a tokenizer, a tiny random causal LM
and datasets in TRL's standard formats, deterministically and in seconds, so every script runs (and is tested) with no
download.

    python examples/toy_task.py --out toy              # toy/model, toy/sft, toy/preference, toy/prompts
    python examples/toy_task.py --eval runs/sft --data toy/prompts/test.jsonl   # greedy exact match

Task: prompt "sort: 5074 ->", right completion " 0457" (then EOS). The SFT data come from a flawed demonstrator: on the
prompts whose digits include a 0 it reads the sorted digits as a number, so the leading 0 vanishes (" 457"), 70% of the
time; elsewhere it is right. Imitation therefore stops at a ceiling; the preference pairs (right answer over the
demonstrator's mistake) and the exact-match verifier on the prompts' `answer` column carry what the demonstrations lack.
"""

import argparse
import json
import os
import random
import sys

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# messages as <|role|>text; with tools (grpo.py --tools): their names in a first system turn, an assistant turn's
# calls as a Python list ([calculator(expression="2+3")], Llama 3.2's style) and a tool's result as a system turn
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ 'system' if m['role'] == 'tool' else m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{% endfor %})"
    "{{ ', ' if not loop.last }}{% endfor %}]{% endif %}"
    "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# how transformers' parse_response reads an assistant turn back: its text, and the calls list
RESPONSE_TEMPLATE = {"start_anchor": "<|assistant|>", "fields": {
    "tool_calls": {"open_pattern": r"(?=\[\w+\()", "close_pattern": r"(?<=\)\])", "content": "python-call-list",
                   "transform_each": True,
                   "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}}},
    "content": {"close_pattern": r"<\|eos\|>", "content": "text"}}}


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
    tok.chat_template, tok.response_template = CHAT_TEMPLATE, RESPONSE_TEMPLATE
    return tok


def make_digits(rng, min_len=2, max_len=7):
    """2 to 7 distinct digits: a 0 is among them in 45% of the prompts on average."""
    return "".join(rng.sample("0123456789", rng.randint(min_len, max_len)))


def prompt_of(digits):
    return f"sort: {digits} ->"


def in_flawed_subset(prompt):
    """The prompts the demonstrator gets wrong most of the time: those whose digits include a 0 (about 43% of them)."""
    return "0" in prompt.split(":", 1)[1]


def demonstrators_mistake(answer):
    """The demonstrator's one mistake: it reads the sorted digits as a number, so the leading zeros vanish
    ("00145" -> "145", "000" -> "0"). A plausible, consistent error, easy to see in the answer."""
    return str(int(answer))


def demonstrate(rng, digits, mistake_rate=0.7):
    """The flawed demonstrator's completion: the sorted digits, except that on the flawed subset it makes its mistake
    `mistake_rate` of the time. The right answer is still in 30% of its demonstrations there."""
    answer = "".join(sorted(digits))
    if in_flawed_subset(prompt_of(digits)) and rng.random() < mistake_rate:
        return " " + demonstrators_mistake(answer)
    return " " + answer


def other_mistake(rng, answer):
    """A plausible wrong answer for the preference pairs of the other prompts: two neighbours swapped, a digit changed,
    dropped or repeated."""
    s = list(answer)
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
    return "".join(s)


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_model(out, seed=0):
    """The byte tokenizer and a tiny random Qwen2 (about 1M parameters) in out/model; its tokenizer."""
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
    return tok


def write_toy_task(out, seed=0, num_train=4000, num_test=200):
    rng = random.Random(seed)
    write_model(out, seed)

    seen, test = set(), []
    while len(test) < num_test:  # test prompts first, and never in any train split
        digits = make_digits(rng)
        if digits not in seen:
            seen.add(digits)
            test.append(digits)
    train = []
    while len(train) < num_train:
        digits = make_digits(rng)
        if digits not in seen:
            train.append(digits)
    for split, all_digits in (("train", train), ("test", test)):
        prompts, answers = [prompt_of(d) for d in all_digits], ["".join(sorted(d)) for d in all_digits]
        demonstrations = [demonstrate(rng, d) for d in all_digits]
        write_jsonl(
            f"{out}/sft/{split}.jsonl", [{"prompt": p, "completion": c} for p, c in zip(prompts, demonstrations)]
        )
        rejected = [
            demonstrators_mistake(a) if in_flawed_subset(p) else other_mistake(rng, a) for p, a in zip(prompts, answers)
        ]
        write_jsonl(
            f"{out}/preference/{split}.jsonl",
            [{"prompt": p, "chosen": " " + a, "rejected": " " + r} for p, a, r in zip(prompts, answers, rejected)],
        )
        write_jsonl(f"{out}/prompts/{split}.jsonl", [{"prompt": p, "answer": a} for p, a in zip(prompts, answers)])


def demonstrators_ceiling(data_file):
    """Greedy exact match of a perfect imitator of the demonstrator: its most likely answer is the mistake on the
    flawed subset and the right one elsewhere, so it scores the share of prompts outside the flawed subset."""
    rows = [json.loads(line) for line in open(data_file)]
    return sum(not in_flawed_subset(r["prompt"]) for r in rows) / len(rows)


def load_causal_lm(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tok


@torch.no_grad()
def completions_of(model, tok, prompts, num_samples=1, temperature=None, max_new_tokens=12, batch_size=200):
    """Greedy completions (temperature None), or `num_samples` sampled ones per prompt from softmax(logits / T)."""
    texts = []
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    )
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=tok.pad_token_id,
            **sampling,
        )
        texts += [t.strip() for t in tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)]
    return texts


def subset_scores(right, prompts):
    """The share of right answers on all the prompts, on the flawed subset and on the other prompts."""
    flawed = [in_flawed_subset(p) for p in prompts]
    return {
        "exact_match": sum(right) / len(right),
        "flawed_subset": sum(x for x, f in zip(right, flawed) if f) / max(1, sum(flawed)),
        "other_prompts": sum(x for x, f in zip(right, flawed) if not f) / max(1, len(right) - sum(flawed)),
    }


def greedy_scores(model, tok, rows):
    """Greedy exact match on all the rows, on the flawed subset and on the other prompts."""
    prompts = [r["prompt"] for r in rows]
    return subset_scores([t == r["answer"] for t, r in zip(completions_of(model, tok, prompts), rows)], prompts)


def exact_match(model_dir, data_file):
    """Greedy exact-match accuracy of a causal LM folder on a prompts file (prompt + answer columns)."""
    rows = [json.loads(line) for line in open(data_file)]
    return greedy_scores(*load_causal_lm(model_dir), rows)["exact_match"]


def right_answers_in_samples(model_dir, data_file, num_samples=8, temperature=1.0, seed=0):
    """On the flawed subset: the share of `num_samples` samples per prompt that are right, and the share of prompts
    with at least one right sample (what sampling-based RL needs to have a signal)."""
    model, tok = load_causal_lm(model_dir)
    rows = [r for r in map(json.loads, open(data_file)) if in_flawed_subset(r["prompt"])]
    torch.manual_seed(seed)
    texts = completions_of(model, tok, [r["prompt"] for r in rows], num_samples, temperature)
    right = [[t == r["answer"] for t in texts[i * num_samples : (i + 1) * num_samples]] for i, r in enumerate(rows)]
    return sum(map(sum, right)) / (num_samples * len(rows)), sum(map(any, right)) / len(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder to write the toy task to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num_train", type=int, default=4000, help="training rows of each dataset")
    parser.add_argument("--num_test", type=int, default=200, help="test rows of each dataset")
    parser.add_argument("--eval", help="a causal LM folder to score by greedy exact match")
    parser.add_argument("--data", help="a prompts file (prompt + answer columns) for --eval")
    args = parser.parse_args()
    if not sys.stderr.isatty():  # a log: the lines below, not transformers' bar
        transformers.utils.logging.disable_progress_bar()
    if args.out:
        write_toy_task(args.out, args.seed, args.num_train, args.num_test)
        print(f"wrote {args.out}/model, {args.out}/sft, {args.out}/preference, {args.out}/prompts")
    if args.eval:
        rows = [json.loads(line) for line in open(args.data)]
        scores = greedy_scores(*load_causal_lm(args.eval), rows)
        print(
            " ".join(f"{k} {v:.4f}" for k, v in scores.items())
            + f" demonstrators_ceiling {demonstrators_ceiling(args.data):.4f}"
        )

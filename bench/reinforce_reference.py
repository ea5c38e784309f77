"""A control for grpo.py on the toy task: the smallest REINFORCE loop with a group-mean baseline (divided by the group
std, as GRPO), written without anything from grpo.py: one process, no FSDP, plain HF generate and AdamW, one optimizer
step per 8 prompts x 8 samples. If it shows the same learning curve as grpo.py, the curve is the toy's, not a bug.

    python bench/reinforce_reference.py SFT_DIR 1e-4 150    # model folder, learning rate, steps (from the repo root)
"""

import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(2)
torch.manual_seed(0)
random.seed(0)
src, lr, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(src, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(src)
rows = [json.loads(l) for l in open("toy/prompts/train.jsonl")]
test = [json.loads(l) for l in open("toy/prompts/test.jsonl")]
opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def em():
    model.eval()
    with torch.no_grad():
        enc = tok([r["prompt"] for r in test], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(t.strip() == r["answer"] for t, r in zip(texts, test)) / len(test)


print("start", em())
for step in range(steps):
    batch = random.sample(rows, 8)
    prompts = [r["prompt"] for r in batch for _ in range(8)]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=10, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tok.pad_token_id
        )
    gen = out[:, enc["input_ids"].shape[1] :]
    texts = tok.batch_decode(gen, skip_special_tokens=True)
    r = torch.tensor([float(t.strip() == b["answer"]) for t, b in zip(texts, [b for b in batch for _ in range(8)])])
    g = r.view(8, 8)
    A = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()
    # mask: tokens up to and including first eos
    is_eos = gen == tok.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), gen.shape[1] - 1)
    mask = (torch.arange(gen.shape[1])[None] <= first[:, None]).float()
    attn = torch.cat([enc["attention_mask"], mask.long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=out, attention_mask=attn, position_ids=pos).logits[:, enc["input_ids"].shape[1] - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, gen[..., None])[..., 0]
    loss = -(A[:, None] * logp * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if (step + 1) % 50 == 0:
        print(step + 1, em(), r.mean().item(), flush=True)

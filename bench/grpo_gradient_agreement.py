"""Does the GRPO gradient on the toy task carry signal? The gradient of grpo_loss (one iteration, token loss, beta 0)
on 4 disjoint sets of 64 training prompts x 8 samples; prints their pairwise cosine similarities and mean rewards.

    python bench/grpo_gradient_agreement.py SFT_DIR 1.0     # model folder, temperature (run from the repository root)
"""

import json
import sys

import torch
from types import SimpleNamespace

sys.path.insert(0, ".")  # run from the repository root: grpo.py is imported
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpo import (
    generate_completions,
    group_advantages,
    grpo_loss,
    loss_normaliser,
    make_batch,
    completion_logprobs,
    verifier_reward,
)

torch.set_num_threads(2)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
rows = [json.loads(l) for l in open("toy/prompts/train.jsonl")]
args = SimpleNamespace(
    epsilon=0.2, epsilon_high=0.2, beta=0.0, kl_estimator="k3", loss_type="token", max_completion_length=10,
    advantage_estimator="grpo", scale_rewards="group", importance_sampling_level="token", policy_loss="clip",
)
T = float(sys.argv[2])


def grad(prompt_rows, seed):
    torch.manual_seed(seed)
    prompts = [tok(rows[i]["prompt"])["input_ids"] for i in prompt_rows for _ in range(8)]
    answers = [rows[i]["answer"] for i in prompt_rows for _ in range(8)]
    comps = generate_completions(model, prompts, 10, T, tok.eos_token_id, tok.pad_token_id)
    texts = tok.batch_decode(comps, skip_special_tokens=True)
    r = torch.tensor([verifier_reward(t, a, "exact_match") for t, a in zip(texts, answers)])
    ids, am, cm = make_batch(prompts, comps, tok.pad_token_id)
    adv, _ = group_advantages(r, cm.sum(1), 8, args)
    model.zero_grad()
    lp = completion_logprobs(model, ids, am, cm.shape[1], T)
    loss, _, _ = grpo_loss(lp, lp.detach(), None, adv, cm.float(), loss_normaliser(cm.float(), args), args)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone(), r.mean().item()


gs = [grad(range(k * 64, (k + 1) * 64), k) for k in range(4)]
for i in range(4):
    print([round(torch.nn.functional.cosine_similarity(gs[i][0], gs[j][0], 0).item(), 3) for j in range(4)], gs[i][1])

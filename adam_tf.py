"""TensorFlow-style Adam, as OpenAI's lm-human-preferences used it (`tf.train.AdamOptimizer`).

The one difference from `torch.optim.Adam` is where epsilon sits ("epsilon hat", Kingma & Ba, end of Sec. 2):
    torch: p -= lr * m_hat / (sqrt(v_hat) + eps)        with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
    TF:    p -= lr_t * m / (sqrt(v) + eps)              with lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
so TF's epsilon is effectively `eps * sqrt(1 - b2^t)`, about 30x smaller at step 1 with b2 = 0.999. Why it matters
for RLHF: policy gradients are tiny (lm-human-preferences: lr 1e-5, eps 1e-5, gradients ~1e-3..1e-5), so eps is not
negligible next to sqrt(v_hat); torch's form then makes the first updates several times smaller, and TF-trained
hyper-parameters do not transfer (see "The N+ Implementation Details of RLHF with PPO", and tests/test_adam_tf.py:
on the lm-human-preferences case torch.optim.Adam is off by 21% of the distance TF moves the parameters).

We follow TF's CPU kernel (ApplyAdam) operation by operation, in float32: m += (g - m) * (1 - b1),
v += (g*g - v) * (1 - b2), beta powers as float32 running products, scalars rounded to float32 as TF does.
So m, v and the beta powers match TF bit for bit; parameters match to float32 rounding only, because torch's
vectorised float32 sqrt on CPU is not always correctly rounded (a float64 sqrt would fix it at 4x the memory traffic).
"""

import math

import torch


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32 (TF casts every scalar hyper-parameter to the variable dtype)."""
    return torch.tensor(x, dtype=torch.float32).item()


class AdamTF(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamTF hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = _f32(group["betas"][0]), _f32(group["betas"][1])
            one_minus_b1, one_minus_b2 = _f32(1.0 - b1), _f32(1.0 - b2)  # exact in float32, as in TF
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:  # beta powers as 0-dim float32 tensors, so they travel in state_dict()
                    state["step"] = torch.tensor(0.0)
                    state["beta1_power"] = torch.tensor(b1, dtype=torch.float32)
                    state["beta2_power"] = torch.tensor(b2, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                b1_power, b2_power = state["beta1_power"].item(), state["beta2_power"].item()
                # alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), each operation rounded to float32
                sqrt_term = _f32(math.sqrt(_f32(1.0 - b2_power)))  # sqrt in float64 then rounded: correctly rounded
                alpha = _f32(_f32(_f32(group["lr"]) * sqrt_term) / _f32(1.0 - b1_power))
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.add_((g - m).mul_(one_minus_b1))
                v.add_((g * g - v).mul_(one_minus_b2))
                p.sub_((m * alpha).div_(v.sqrt().add_(group["eps"])))  # epsilon hat: outside the bias correction
                state["step"] += 1
                state["beta1_power"].mul_(b1)
                state["beta2_power"].mul_(b2)
        return loss

"""Writes techniques.json beside this file: TRL 1.16's GRPOTrainer code run on fixed random inputs (stored in the same
file) for the techniques grpo.py took from it: two-sided clipping (delta), SAPO, VESPO, the top-entropy tokens (80/20),
the entropy bonus and its adaptive control, off-policy sequence masking, the KL term times the ratio, and
normalize_then_sum. tests/test_techniques.py feeds the same inputs to grpo.py's functions and compares.

Not run by the tests (TRL is not a dependency). To regenerate, in an environment with TRL:
    python -m venv --system-site-packages /tmp/refenv && /tmp/refenv/bin/pip install trl==1.16.0
    /tmp/refenv/bin/python tests/reference/variants/make_techniques.py

As make_reference.py: TRL's _compute_loss runs as written on a stand-in `self` holding only what it reads, its "model"
returning the given per-token log-probs and entropies (both leaves: the gradient is taken with respect to each). The
adaptive entropy control runs _compute_loss step after step on one stand-in, so its coefficient moves as in training.
normalize_then_sum lives inside _generate_and_score_completions: its block is read from TRL's installed source and
executed as written."""

import collections
import importlib.metadata
import inspect
import json
import os
import textwrap
import types

import torch

torch.manual_seed(0)
B, T, G = 12, 6, 4  # 3 groups of 4 completions, up to 6 tokens
LENGTHS = [6, 3, 1, 5, 2, 6, 4, 1, 6, 6, 3, 2]
MASK = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
DEFAULTS = dict(delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=False, top_entropy_quantile=1.0,
                off_policy_mask_threshold=None, entropy_coef=0.0, use_adaptive_entropy=False, entropy_target=0.2,
                entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)


def rounded(x):
    """float64 values that survive the round trip through JSON exactly (float32 inputs are exact in float64)."""
    return x.double().tolist()


def inputs():
    logps = -torch.rand(B, T) * 3
    return {"logps": rounded(logps), "advantages": rounded(torch.randn(B)), "mask": rounded(MASK),
            "old_logps": rounded(logps + 0.3 * torch.randn(B, T)),  # ratios of about e^+-0.3
            "sequence_old_logps": rounded(logps + 1e-3 * torch.randn(B, T)),  # GSPO's scale
            "ref_logps": rounded(logps + 0.2 * torch.randn(B, T)), "entropies": rounded(torch.rand(B, T) * 2)}


def trainer(settings):
    """A stand-in GRPOTrainer for _compute_loss: one process, no accumulation, no vLLM."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    s = {**DEFAULTS, **settings}
    accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"), gather=lambda x: x,
                                        reduce=lambda x, reduction="sum": x, sync_gradients=True,
                                        pad_across_processes=lambda x, dim=0, pad_index=0: x)
    self = types.SimpleNamespace(
        top_entropy_quantile=s["top_entropy_quantile"], off_policy_mask_threshold=s["off_policy_mask_threshold"],
        importance_sampling_level=s["importance_sampling_level"], beta=s["beta"], loss_type=s["loss_type"],
        epsilon_low=s["epsilon"], epsilon_high=s["epsilon_high"], use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, entropy_coef=s["entropy_coef"],
        use_adaptive_entropy=s["use_adaptive_entropy"],
        _entropy_bonus_enabled=s["entropy_coef"] != 0.0 or s["use_adaptive_entropy"],
        _last_world_entropy=float("inf"), _entropy_window_stats=None, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=T, accelerator=accelerator,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        args=types.SimpleNamespace(steps_per_generation=1, **{k: s[k] for k in DEFAULTS}),
    )
    self.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, self)
    return self


def trl_loss(self, data, old_key="old_logps", scale=1.0):
    """One _compute_loss on the stored inputs (entropies x `scale`); the loss and its gradients."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    logps = torch.tensor(data["logps"], dtype=torch.float32, requires_grad=True)
    entropies = (torch.tensor(data["entropies"], dtype=torch.float32) * scale).requires_grad_()
    mask = torch.tensor(data["mask"])
    self._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    batch = {"prompt_ids": torch.ones(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
             "completion_ids": torch.ones(B, T, dtype=torch.long), "completion_mask": mask,
             "advantages": torch.tensor(data["advantages"], dtype=torch.float32),
             "old_per_token_logps": torch.tensor(data[old_key], dtype=torch.float32),
             "ref_per_token_logps": torch.tensor(data["ref_logps"], dtype=torch.float32),
             "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(self, None, batch)
    loss.backward()
    grad = entropies.grad if entropies.grad is not None else torch.zeros_like(entropies)
    return {"loss": loss.item(), "grad": rounded(logps.grad), "entropy_grad": rounded(grad)}


TOKEN = dict(loss_type="dapo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, beta=0.0)
SEQUENCE = dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28, beta=0.0)
# name: TRL's settings (TOKEN: our --loss_type token; grpo and sapo: our sequence), the old log-probs
CASES = {
    "delta": ({**TOKEN, "delta": 1.5}, "old_logps"),
    "delta_sequence_with_kl": ({**SEQUENCE, "delta": 1.2, "beta": 0.04}, "old_logps"),
    "sapo": ({**SEQUENCE, "loss_type": "sapo"}, "old_logps"),
    "sapo_temperatures_with_kl": ({**SEQUENCE, "loss_type": "sapo", "sapo_temperature_pos": 2.0,
                                   "sapo_temperature_neg": 0.5, "beta": 0.04}, "old_logps"),
    "vespo": ({**TOKEN, "loss_type": "vespo"}, "old_logps"),
    "vespo_exponents_with_kl": ({**TOKEN, "loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
                                 "vespo_k_neg": 2.5, "vespo_lambda_neg": 1.5, "beta": 0.04}, "old_logps"),
    "top_entropy_quantile": ({**TOKEN, "top_entropy_quantile": 0.2, "beta": 0.04}, "old_logps"),
    "off_policy_mask": ({**TOKEN, "off_policy_mask_threshold": 0.05}, "old_logps"),
    "bias_correction_kl": ({**TOKEN, "use_bias_correction_kl": True, "beta": 0.04}, "old_logps"),
    "bias_correction_kl_gspo": ({**SEQUENCE, "importance_sampling_level": "sequence", "epsilon": 3e-4,
                                 "epsilon_high": 4e-4, "use_bias_correction_kl": True, "beta": 0.04},
                                "sequence_old_logps"),
    "entropy_bonus": ({**TOKEN, "entropy_coef": 0.01, "beta": 0.04}, "old_logps"),
    "entropy_bonus_top_entropy_sapo": ({**SEQUENCE, "loss_type": "sapo", "entropy_coef": 0.05,
                                        "top_entropy_quantile": 0.5}, "old_logps"),
}
# adaptive control: the coefficient from 0.01 in steps of 0.004, target 1.0 nats, the entropies of each step scaled so
# that their mean crosses it (about 1.0 at scale 1)
ADAPTIVE = {**TOKEN, "use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 1.0,
            "entropy_coef_delta": 0.004, "entropy_coef_min": 0.002, "entropy_coef_max": 0.02}
SCALES = [0.5, 0.6, 0.7, 1.5, 1.4, 0.8, 0.9, 1.3]


def normalize_then_sum(rewards_per_func, weights):
    """TRL's normalize_then_sum block of _generate_and_score_completions, as installed, executed on these rewards."""
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import nanstd

    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    block = source[start:].split("\n", 1)[1]
    block = block[: block.index("        else:\n")]  # up to the next branch of the if
    scope = {"torch": torch, "nanstd": nanstd, "rewards_per_func": rewards_per_func, "num_generations": G,
             "device": torch.device("cpu"), "unscorable_mask": torch.zeros(len(rewards_per_func), dtype=torch.bool),
             "self": types.SimpleNamespace(reward_funcs=[None] * rewards_per_func.shape[1], reward_weights=weights)}
    exec(textwrap.dedent(block), scope)
    return scope["advantages"]


def main():
    data = inputs()
    out = {"versions": {name: importlib.metadata.version(name) for name in ("trl", "torch")}, "inputs": data,
           "cases": {}}
    for name, (settings, old_key) in CASES.items():
        out["cases"][name] = {"trl": settings, "old_logps": old_key} | trl_loss(trainer(settings), data, old_key)
    self, steps = trainer(ADAPTIVE), []
    for scale in SCALES:
        steps.append(trl_loss(self, data, scale=scale) | {"scale": scale, "entropy_coef": self.entropy_coef})
    out["adaptive"] = {"trl": ADAPTIVE, "steps": steps}
    # three objectives (the verifier, the penalties, a reward model's score), 3 groups of 4; weights 1, 1, 0.5
    objectives = torch.stack([torch.randint(0, 2, (B,)).float(), -0.5 * torch.randint(0, 2, (B,)).float(),
                              torch.randn(B)], 1)
    weights = torch.tensor([1.0, 1.0, 0.5])
    out["normalize_then_sum"] = {"objectives": rounded(objectives), "weights": rounded(weights),
                                 "advantages": rounded(normalize_then_sum(objectives, weights))}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "techniques.json")
    json.dump(out, open(path, "w"), indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""bench/gpu.sh, the one GPU command: its dry run goes through every stage at toy size on CPU, so the command
cannot rot while no GPU is lent; and its checks are shown to fail on what they must catch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, script_env
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.join(ROOT, "bench"))
from gpu import check_run, flops_per_token, ratio, scores_check  # noqa: E402


def test_dry_run_goes_through_every_stage(tmp_path):
    """TRL's side is left out here (CI does not install TRL; bench/requirements.txt's environment runs it too)."""
    out = tmp_path
    result = subprocess.run(
        ["bash", "bench/gpu.sh", "--dry-run", "--no-trl", "--out", str(out)],
        cwd=ROOT,
        env=script_env({"PYTHON": sys.executable}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-10000:]
    stages = json.load(open(out / "results.json"))["stages"]
    assert list(stages) == ["env", "correctness", "speed", "generation"]
    assert all(stage["failures"] == [] for stage in stages.values())
    runs = stages["correctness"]["runs"]
    # on CPU: no sft_again (two CPU runs agree to the bit) and no static-cache runs (compiled on GPUs only; the static
    # cache's CPU path is checked in process by tests/test_grpo.py)
    names = ["sft", "reward", "dpo", "grpo", "ppo", "sft_resumed"]
    assert sorted(runs) == sorted(names) and all(run["exit"] == 0 for run in runs.values())
    assert stages["correctness"]["resume"]["max_abs_difference_resumed_vs_straight"] == 0.0
    speed = stages["speed"]["runs"]  # each side run twice here, alternating (three times on a GPU)
    assert sorted(speed) == ["dpo", "grpo", "sft", "sft_gsm8k", "sft_gsm8k_padded"] and all(
        row["ours"]["seconds_per_step"] > 0 and len(row["ours"]["runs"]) == 2 for row in speed.values()
    )
    breakdown = speed["grpo"]["ours"]["breakdown"]  # the parts of a step add up to the step
    assert sum(v for k, v in breakdown.items() if k != "seconds_per_step") == pytest.approx(
        breakdown["seconds_per_step"], rel=0.05
    )
    paths = stages["generation"]["paths"]  # on CPU no compiled step: generate's two caches, batching, our loop
    assert len(paths) == 4 and all(path["exactness"]["samples_softmax_logits_over_T"] for path in paths.values())
    assert all(timing["samples_per_second"] > 0 for path in paths.values() for timing in path["by_batch"].values())
    summary = open(out / "summary.md").read()
    assert "| sft | 0 |" in summary and "generate_batch (continuous batching)" in summary and "FAILED" not in summary
    assert summary in output


def test_check_run_names_what_failed(tmp_path, toy):
    """A failed exit, a non-finite metric, no metrics, or a folder that does not load: each named."""
    failures = []
    check_run("a", 1, "Traceback ... boom", tmp_path, "causal", failures)
    assert len(failures) == 1 and failures[0].startswith("a: exit 1") and "boom" in failures[0]
    failures = []
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": float("nan")}) + "\n")
    check_run("b", 0, "", tmp_path, "causal", failures)
    assert any("non-finite ['loss']" in f for f in failures) and any("does not load" in f for f in failures)
    failures = []
    check_run("c", 0, "", toy / "model", "causal", failures)
    assert failures == ["c: no rows in " + os.path.join(toy / "model", "metrics.jsonl")]


def test_exactness_check_catches_another_distribution(toy):
    """The sampling check passes HF generate as grpo.py calls it, and fails it with top-k on or another temperature."""
    model = AutoModelForCausalLM.from_pretrained(toy / "model", dtype=torch.float32).eval()
    prompts = [[70, 71, 72, 73], [74, 75]]

    def check(temperature_sampled, temperature_reference, **extra):
        config = GenerationConfig(
            do_sample=True,
            temperature=temperature_sampled,
            top_k=0,
            top_p=1.0,
            max_new_tokens=6,
            eos_token_id=-1,
            pad_token_id=0,
        )
        config.update(**extra)
        return scores_check(model, prompts, config, 0, temperature_reference)

    exact = check(0.7, 0.7)
    assert exact["max_abs_distribution_difference"] < 1e-4 and not exact["filtered"]
    assert check(0.7, 0.7, top_k=20)["filtered"]
    assert check(0.7, 1.0)["max_abs_distribution_difference"] > 0.01


def test_flops_per_token_counts_every_matrix_parameter():
    """The 6N term against the model's own parameters: every Linear weight plus the (tied) embedding, no biases or
    norms; the attention term is 12 L d T."""
    config = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = Qwen2ForCausalLM(Qwen2Config(**config, tie_word_embeddings=True))
    matrices = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head
    )
    n = matrices + model.model.embed_tokens.weight.numel()
    assert flops_per_token(config, sequence_length=50) == 6 * n + 12 * 3 * 32 * 50


def test_a_ratio_is_measured_only_where_the_ranges_do_not_overlap():
    """Seconds a step of alternating runs: the ratio of the medians, its range from the extremes, and a verdict that
    says faster or slower only when every run of one side beats every run of the other."""
    faster = ratio([1.0, 1.1, 1.2], [1.3, 1.4, 1.35])
    assert faster["verdict"] == "ours faster" and faster["time"] == pytest.approx(1.1 / 1.35)
    assert faster["time_range"] == pytest.approx([1.0 / 1.4, 1.2 / 1.3])
    assert ratio([1.5, 1.6], [1.2, 1.3])["verdict"] == "ours slower"
    assert ratio([1.0, 1.3], [1.2, 1.4])["verdict"] == "within noise"  # ranges overlap: a 1.25 or 1.02 alone is noise
    assert ratio([1.0], [2.0])["verdict"] == "one run a side"

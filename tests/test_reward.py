"""reward.py: the Bradley-Terry loss by hand, the score at the last real token whatever the padding, preference data
formats, and the script on the toy task (accuracy, centred scores, a folder HF loads)."""

import math
from types import SimpleNamespace

import datasets
import pytest
import torch
from conftest import read_metrics
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

from reward import bradley_terry_loss, make_batch, sequence_scores, tokenize_preference


# ----------------------------------------------------------------------------------------------------- unit tests
def test_bradley_terry_loss_by_hand():
    chosen, rejected, margins = (
        torch.tensor([1.0, -0.5, 3.0]),
        torch.tensor([0.0, 0.5, -1.0]),
        torch.tensor([0.0, 0.25, 1.0]),
    )
    # -log(1 / (1 + exp(-x))) = log(1 + exp(-x)) with x = r_chosen - r_rejected - margin
    expected = [math.log(1 + math.exp(-x)) for x in (1.0, -1.25, 3.0)]
    assert bradley_terry_loss(chosen, rejected, margins).tolist() == pytest.approx(expected, rel=1e-6)


def tiny_classifier(pad_token_id):
    """GPT-2 (absolute positions, so left padding without position_ids would change the score) with a one-output
    head."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
        num_labels=1,
        pad_token_id=pad_token_id,
    )
    return GPT2ForSequenceClassification(config).eval()


def unpadded_score(model, ids):
    """The textbook score: one unpadded sequence through the backbone, the head at its last position."""
    return model.score(model.transformer(torch.tensor([ids])).last_hidden_state[0, -1]).item()


@pytest.mark.parametrize("packed", [False, True])
def test_sequence_scores_at_each_last_token_packed_or_padded_and_pad_equals_eos(packed):
    """Each sequence's score at its own last token (from the lengths: pad == eos), a sequence a row or packed (the
    5 and the 2 tokens share a row), GPT-2's absolute positions; plus the folder's score_bias."""
    eos = 0  # the id make_batch pads with
    model = tiny_classifier(pad_token_id=eos)
    prompts, completions = [[1, 2, 3], [4, 5], [11]], [[5, 6, 7, eos], [6, 7, eos], [eos]]  # 7, 5 and 2 tokens
    expected = [unpadded_score(model, p + c) for p, c in zip(prompts, completions)]
    batch = make_batch("cpu", prompts, completions, range(3), SimpleNamespace(padding_free=packed))
    assert len(batch["input_ids"]) == (2 if packed else 3)
    with torch.no_grad():
        assert sequence_scores(model, batch).tolist() == pytest.approx(expected, abs=1e-5)
        # control: HF's own pooling (the last token != pad_token_id) reads the first row's token before EOS
        hf = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, 0]
        assert abs(hf.item() - expected[0]) > 1e-3
        model.config.score_bias = -0.75  # what --normalize_reward saves
        assert sequence_scores(model, batch).tolist() == pytest.approx([e - 0.75 for e in expected], abs=1e-5)


class A:
    dataset_name, max_prompt_length, max_completion_length = "rows", 20, 12


def test_tokenize_preference_formats_margin_and_dropped_rows(toy):
    tok = AutoTokenizer.from_pretrained(toy / "model")
    rows = {  # kept; empty; prompt too long; completion too long; no prompt; chosen = rejected (no preference)
        "prompt": ["sort: 21 ->", "sort: 3 ->", "x" * 30, "sort: 4 ->", "", "sort: 5 ->"],
        "chosen": [" 12", "", " 1", " 4" * 10, " 1", " 5"],
        "rejected": [" 21", " 3", " 2", " 5", " 2", " 5"],
        "margin": [0.5, 0.0, 0.0, 1, 0.0, 0.0],
    }
    data, dropped = tokenize_preference(datasets.Dataset.from_dict(rows), tok, A)
    assert dropped == {
        "empty completion": 1,
        "prompt too long": 1,
        "completion too long": 1,
        "empty prompt": 1,
        "chosen equals rejected": 1,
    }
    assert [tok.decode(data[k][0]) for k in ("prompt", "chosen", "rejected")] == [
        "sort: 21 ->",
        " 12<|eos|>",
        " 21<|eos|>",
    ]
    assert data["margin"] == [0.5]
    user, good, bad = (
        [{"role": "user", "content": "sort: 21 ->"}],
        [{"role": "assistant", "content": " 12"}],
        [{"role": "assistant", "content": " 21"}],
    )
    explicit, _ = tokenize_preference(
        datasets.Dataset.from_dict({"prompt": [user], "chosen": [good], "rejected": [bad]}), tok, A
    )
    implicit, _ = tokenize_preference(
        datasets.Dataset.from_dict({"chosen": [user + good], "rejected": [user + bad]}), tok, A
    )
    assert explicit == implicit and tok.decode(implicit["prompt"][0]) == "<|user|>sort: 21 -><|assistant|>"
    assert tok.decode(implicit["chosen"][0]) == " 12<|eos|>" and implicit["margin"] == [0.0]


def test_tokenize_preference_bad_input_names_the_problem(toy):
    tok = AutoTokenizer.from_pretrained(toy / "model")
    with pytest.raises(
        ValueError, match=r"has columns \['prompt', 'completion'\]: preference data needs 'chosen' and 'rejected'"
    ):
        tokenize_preference(datasets.Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}), tok, A)
    other = [{"role": "user", "content": "sort: 12 ->"}, {"role": "assistant", "content": " 12"}]
    with pytest.raises(ValueError, match="differ only in their last message"):
        tokenize_preference(
            datasets.Dataset.from_dict({"chosen": [other], "rejected": [[{"role": "user", "content": "x"}, other[1]]]}),
            tok,
            A,
        )
    with pytest.raises(ValueError, match="no 'prompt' column"):
        tokenize_preference(datasets.Dataset.from_dict({"chosen": ["a b"], "rejected": ["a c"]}), tok, A)


# ---------------------------------------------------------------------------------------------- the script itself
def test_reward_model_learns_the_toy_pairs_and_saves_centred_scores(toy, reward_model):
    out, result = reward_model  # conftest.py: 125 steps from the toy SFT model, lr 1e-3, 2 processes
    # the new score head is said once, instead of HF's load report ("score.weight | MISSING") once per process
    assert result.stdout.count("score head: new; weights not used from --model_name_or_path: none") == 1
    assert "LOAD REPORT" not in result.stderr, result.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [25, 50, 75, 100, 125] and rows[-1]["episode"] == 125 * 32
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
    ):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert math.isfinite(rows[-1]["eval/loss"]) and "eval/accuracy" not in rows[0]  # evaluated at the end only
    assert rows[-1]["rewards/margins"] == pytest.approx(
        rows[-1]["rewards/chosen"] - rows[-1]["rewards/rejected"], abs=1e-5
    )
    print(f"toy reward model: test pair accuracy {rows[-1]['eval/accuracy']:.3f}")
    # measured 0.865: the misses are random slips on the other prompts (a repeated digit); the pairs the toy's lesson
    # needs, right answer against the demonstrator's mistake, are checked below
    assert rows[-1]["eval/accuracy"] >= 0.8
    # the pairs that matter for the toy's lesson: the right answer against the demonstrator's mistake
    from quickstart_report import pair_accuracy

    accuracy, on_flawed_subset = pair_accuracy(str(out), str(toy / "preference" / "test.jsonl"))
    print(f"pair accuracy recomputed {accuracy:.3f}, on the flawed subset {on_flawed_subset:.3f}")
    assert accuracy == pytest.approx(rows[-1]["eval/accuracy"]) and on_flawed_subset >= 0.95
    # the folder loads with the standard class, and its scores (with the saved shift) have mean 0 on the training
    # completions
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    train, _ = tokenize_preference(
        datasets.load_dataset("json", data_files=str(toy / "preference" / "train.jsonl"), split="train"), tok, A
    )
    with torch.no_grad():
        scores = [
            sequence_scores(
                model,
                make_batch(
                    "cpu",
                    train["prompt"][i : i + 500] * 2,
                    train["chosen"][i : i + 500] + train["rejected"][i : i + 500],
                    range(1000),
                    SimpleNamespace(padding_free=True),
                ),
            )
            for i in range(0, 4000, 500)
        ]
    scores = torch.cat(scores)
    assert abs(model.config.score_bias) > 0.05 and abs(scores.mean().item()) < 1e-3 * scores.std().item()

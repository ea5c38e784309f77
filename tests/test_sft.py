"""sft.py: unit tests of its helpers against independent references, and runs of the script as users run it."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import read_metrics, reference_logprobs, run_script, tiny_gpt2
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

import sft
from sft import (
    completion_logprobs,
    global_batch,
    HeadLogprobs,
    load_split,
    make_batch,
    rank_micro_batches,
    sft_loss,
    tokenize_prompt_completion,
    tokenize_sft,
)
from toy_task import demonstrators_ceiling, exact_match, greedy_scores, load_causal_lm


# ----------------------------------------------------------------------------------------------------- unit tests
@pytest.mark.parametrize("packed", [False, True])
def test_make_batch_packs_best_fit_and_keeps_eos_when_pad_equals_eos(packed):
    """Sequences end to end in right-padded rows, positions from each one's start. Padded: a sequence a row. Packed:
    the longest first, each into the fullest row it fits, rows as long as the longest (5 tokens: the 3 and the 2
    share one). The completion mask comes from the lengths: with pad == eos a mask from `input_ids != pad` would drop
    the EOS the model must learn. targets: each completion token's flat index; last: each sequence's last token's."""
    eos = 0  # the id make_batch pads with
    prompts, completions = [[1, 2, 3], [4], [8]], [[5, eos], [6, eos], [9]]  # 5, 3 and 2 tokens
    batch = make_batch("cpu", prompts, completions, range(3), SimpleNamespace(padding_free=packed))
    if packed:
        assert batch["input_ids"].tolist() == [[1, 2, 3, 5, eos], [4, 6, eos, 8, 9]]
        assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
        assert batch["targets"].tolist() == [[3, 4], [6, 7], [9, 10]] and batch["last"].tolist() == [4, 7, 9]
    else:
        assert batch["input_ids"].tolist() == [[1, 2, 3, 5, eos], [4, 6, eos, eos, eos], [8, 9, eos, eos, eos]]
        assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0], [0, 1, 0, 0, 0]]
        assert batch["targets"].tolist() == [[3, 4], [6, 7], [11, 12]] and batch["last"].tolist() == [4, 7, 11]
    assert batch["completion_mask"].tolist() == [[1, 1], [1, 1], [1, 0]] and batch["tokens"] == 10


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_of_packed_or_padded_rows_and_temperature(packed, temperature, monkeypatch):
    """Each sequence's log-probs as it gets alone, packed or not, with GPT-2's absolute positions. The control: the
    packed row read with the positions of one sequence (no restart) gives the second sequence other log-probs."""
    monkeypatch.setattr("sft.HEAD_ROWS", 4)  # the head in chunks of 4
    model = tiny_gpt2()
    prompts, completions = [[1, 2, 3, 4, 5], [6, 7], [13]], [[8, 9], [10, 11, 12], [15]]  # 7, 5 and 2 tokens
    batch = make_batch("cpu", prompts, completions, range(3), SimpleNamespace(padding_free=packed))
    assert len(batch["input_ids"]) == (2 if packed else 3)
    with torch.no_grad():
        logprobs = completion_logprobs(model, batch, temperature)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            torch.testing.assert_close(
                logprobs[row, : len(c)], reference_logprobs(model, p, c, temperature), atol=1e-5, rtol=1e-5
            )
        if packed:  # [6, 7, 10, 11, 12, 13, 15] with positions 0-6: the third sequence reads the second
            batch["position_ids"] = torch.arange(7).expand(2, 7)
            plain = completion_logprobs(model, batch, temperature)[2, 0]
            assert (plain - reference_logprobs(model, prompts[2], completions[2], temperature)[0]).abs() > 1e-3


def test_a_packed_row_keeps_its_sequences_apart(toy):
    """Changing one sequence of a packed row does not move the log-probs of the other sequences in it (the toy Qwen2
    model, sdpa attention: transformers builds the block-diagonal mask from the restarting positions)."""
    model = AutoModelForCausalLM.from_pretrained(toy / "model").eval()
    prompts, completions = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]], [[16, 17], [18, 19], [20]]  # 8, 4, 4
    args = SimpleNamespace(padding_free=True)
    with torch.no_grad():
        before = completion_logprobs(model, make_batch("cpu", prompts, completions, range(3), args))
        changed = make_batch("cpu", prompts, [[16, 17], [21, 22], [20]], range(3), args)
        assert changed["input_ids"].tolist()[1] == [11, 12, 21, 22, 13, 14, 15, 20]  # the two share a row
        after = completion_logprobs(model, changed)
    assert torch.equal(after[[0, 2]], before[[0, 2]]) and not torch.equal(after[1], before[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1024, 3])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_head_logprobs_equal_autograd_through_the_whole_logits(dtype, with_bias, rows, entropy_in_loss, monkeypatch):
    """Log-probs, entropies and the gradients of hidden states, weight and bias (of the log-probs, and of the
    entropies too: grpo.py's entropy bonus), against autograd through log_softmax(logits.float() / T), T = 0.7 applied
    to the head's weights. In one chunk and one slice of the vocabulary, and in chunks of 3 rows (3, 3, 3, 1) and
    slices of 12 of the 40 tokens (the last of 4)."""
    monkeypatch.setattr("sft.HEAD_ROWS", rows)
    torch.manual_seed(0)
    hidden, weight, bias = torch.randn(10, 16), torch.randn(40, 16), torch.randn(40) if with_bias else None
    labels, upstream = torch.randint(0, 40, (10,)), torch.randn(10)  # upstream: an arbitrary gradient of the output
    entropy_upstream = torch.randn(10)

    def plain(h, w, b=None):
        log_p = torch.log_softmax(torch.nn.functional.linear(h, w, b).float() / 0.7, -1)
        return log_p.gather(-1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)

    def function(h, w, b=None):
        return HeadLogprobs.apply(h, labels, True, *[p / 0.7 for p in (w, b) if p is not None])

    results = []
    for head in (plain, function):
        leaves = [t.clone().to(dtype).requires_grad_() for t in (hidden, weight, bias) if t is not None]
        logprobs, entropy = head(*leaves)
        loss = (logprobs * upstream).sum()
        (loss + (entropy * entropy_upstream).sum() if entropy_in_loss else loss).backward()  # else: no entropy gradient
        results.append([logprobs.detach(), entropy.detach()] + [leaf.grad for leaf in leaves])
    for expected, got in zip(*results):  # bf16: its rounding, to 1% of the largest value
        scale = expected.abs().max().item()
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2 * scale}
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, **tolerance)
    assert results[1][3].abs().max() > 0.1  # the weight's gradient is not trivially zero


def test_head_gradient_in_bf16_is_one_matrix_product_a_vocabulary_slice(monkeypatch):
    """In bf16 the head's weight gradient sums over all rows. Summed in bf16 over chunks of rows (autograd adding up a
    Function call a chunk) its error grew with the chunks: 4.3e-3 at 8 chunks, 6.5e-3 at 32, against 2.3e-3 for
    autograd's one matrix product over all 4,096 rows (relative, in norm, against fp32 from the same bf16 hidden
    states); summed in fp32, 2.9e-3 and 2.8e-3. One product over all rows for each slice of the vocabulary: 2.4e-3 with
    HEAD_ROWS 512 and 128 (8 and 33 slices). Through completion_logprobs, as the scripts call it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2000, n_positions=1025, n_embd=64, n_layer=1, n_head=2, tie_word_embeddings=False)
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    input_ids = torch.randint(0, 2000, (4, 1025))
    upstream, labels = torch.randn(4, 1024), input_ids[:, 1:].flatten()
    sequences = [[row[:1], row[1:]] for row in input_ids.tolist()]  # a prompt of one token, 1,024 predicted
    batch = make_batch("cpu", *zip(*sequences), range(4), SimpleNamespace(padding_free=True))
    states = []  # the head's inputs: the decoder's output, the last position dropped
    model.transformer.register_forward_hook(lambda module, inputs, output: states.append(output[0][:, :-1]))

    def head_gradient(states, weight):  # autograd through log_softmax of one matrix product over all rows
        weight = weight.clone().requires_grad_()
        logits = (states.flatten(0, 1) @ weight.T).float()
        (torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0] * upstream.flatten()).sum().backward()
        return weight.grad.float()

    error = lambda grad: ((grad - exact).norm() / exact.norm()).item()
    for rows in (512, 128):
        monkeypatch.setattr("sft.HEAD_ROWS", rows)
        model.zero_grad()
        (completion_logprobs(model, batch) * upstream).sum().backward()
        weight, hidden = model.lm_head.weight, states[-1].detach()
        exact = head_gradient(hidden.float(), weight.detach().float())
        one_product = error(head_gradient(hidden, weight.detach()))
        assert error(weight.grad.float()) < 1.5 * one_product, (rows, error(weight.grad.float()), one_product)


def test_head_gradient_takes_no_fp32_copy_of_the_head(monkeypatch):
    """Summed over chunks of rows, the head's gradient took an fp32 copy of the head for the sums (4 x vocabulary x
    hidden bytes: above a chunk's fp32 logits, 4 x HEAD_ROWS x vocabulary, once the hidden size passes HEAD_ROWS; 2.0
    GiB for a 7B model's head, against 0.58). A slice of the vocabulary for all rows at a time, each slice's gradient
    is one matrix product: the largest fp32 tensor the backward makes is within a chunk's logits (bf16 weights, hidden
    64 > HEAD_ROWS 8)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp32 = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.fp32.append(t.numel())
            return out

    monkeypatch.setattr("sft.HEAD_ROWS", 8)
    torch.manual_seed(0)
    hidden = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    logprobs, _ = HeadLogprobs.apply(hidden, torch.randint(0, 1000, (32,)), False, weight)
    sizes = Sizes()
    with sizes:
        logprobs.sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and max(sizes.fp32) <= 8 * 1000, max(sizes.fp32)


def test_head_logprobs_keeps_no_vocabulary_sized_tensor_for_the_backward():
    """Between the forward and the backward autograd holds nothing of size rows x vocabulary: the backward
    recomputes the logits. The control, the plain expression, holds them; the hook does see what HeadLogprobs
    saves (the weight)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 8, requires_grad=True), torch.randn(1000, 8, requires_grad=True)
    labels = torch.randint(0, 1000, (64,))
    for function, keeps_logits in (
        (lambda: torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[:, None]), True),  # the control
        (lambda: HeadLogprobs.apply(hidden, labels, False, weight)[0], False),
    ):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            function()
        assert (max(saved) >= 64 * 1000) == keeps_logits and weight.numel() in saved, saved


def test_the_layout_check_leaves_the_parameters_sharded(toy):
    """check_layout's forwards leave the root's parameters gathered (FSDP2 keeps a root's after its forward): it
    reshards them, so the optimizer made next holds the sharded ones: else it would get the gathered copies of the
    embeddings and the final norm, which training never updates (the run parts from its padded twin at step 2)."""
    from torch.distributed.tensor import DTensor

    args = SimpleNamespace(trust_remote_code=False, gradient_checkpointing=False, bf16=False, cpu_offload=False,
                           reshard_after_forward=True, padding_free=True, model_name_or_path=str(toy / "model"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = sft.load_pretrained(AutoModelForCausalLM, args.model_name_or_path, args, "--model_name_or_path")
        model = sft.shard_model(model, args, dist.init_device_mesh("cpu", (1,)))
        sft.check_layout(model, [list(range(5, 17))], [[17, 18]], args, "--model_name_or_path")
        assert all(isinstance(p, DTensor) for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_the_layout_check_turns_dropout_off_to_find_a_model_reading_across_sequences():
    """A model whose forward drops position_ids (packed sequences then read each other), in training mode with
    dropout, as sft.py's ranks but the first build theirs: refused. With dropout on, the states of the piece alone
    in its row would move by as much as the leak, and the check, above 10 x that noise, would pass it."""

    class DropsPositions(GPT2LMHeadModel):
        def forward(self, input_ids=None, position_ids=None, **options):
            return super().forward(input_ids=input_ids, **options)

    torch.manual_seed(0)
    model = DropsPositions(GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2)).train()
    args = SimpleNamespace(padding_free=True, bf16=False, model_name_or_path="drops-positions")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(sft.ScriptError, match="'drops-positions' reads across the sequences of a packed row"):
            sft.check_layout(model, [list(range(1, 25))], [[25, 26]], args, "--model_name_or_path")
    finally:
        dist.destroy_process_group()


def test_completion_logprobs_refuses_a_head_that_is_not_linear():
    model = tiny_gpt2()
    batch = make_batch("cpu", [[1, 2, 3]], [[4, 5]], [0], SimpleNamespace(padding_free=True))
    completion_logprobs(model, batch)
    model.lm_head.register_forward_hook(lambda module, args, output: output / 30)  # a logit scale, as Cohere's
    with pytest.raises(ValueError, match="not its head's linear map of its last hidden states"):
        completion_logprobs(model, batch)


def test_sft_loss_is_token_mean_over_the_global_batch():
    model = tiny_gpt2()
    prompts, completions = [[1, 2, 3], [4], [5, 6]], [[7, 8, 9, 3], [10, 3], [11, 12, 13, 14, 15, 3]]
    num_tokens = sum(len(c) for c in completions)  # 12 tokens over the "global batch" of three rows
    with torch.no_grad():
        expected = -sum(reference_logprobs(model, p, c).sum() for p, c in zip(prompts, completions)) / num_tokens
        # split in two micro-batches, each divided by the global count, the parts sum to the global mean
        data = {"prompt": prompts, "completion": completions}
        args = SimpleNamespace(padding_free=True)
        part_a, _ = sft_loss(model, data, [0, 1], args, num_tokens)
        part_b, _ = sft_loss(model, data, [2], args, num_tokens)
    torch.testing.assert_close(part_a + part_b, expected, atol=1e-6, rtol=1e-6)


def test_tokenize_standard_and_conversational(toy):
    tok = AutoTokenizer.from_pretrained(toy / "model")
    prompt_ids, completion_ids = tokenize_prompt_completion(tok, "sort: 312 ->", " 123")
    assert tok.decode(prompt_ids) == "sort: 312 ->" and tok.decode(completion_ids) == " 123<|eos|>"
    prompt_ids, completion_ids = tokenize_prompt_completion(
        tok, [{"role": "user", "content": "sort: 312 ->"}], [{"role": "assistant", "content": " 123"}]
    )
    assert tok.decode(prompt_ids) == "<|user|>sort: 312 -><|assistant|>"
    assert tok.decode(completion_ids) == " 123<|eos|>"  # the template's EOS, not appended a second time
    tok.chat_template = tok.chat_template.replace("<|eos|>{% endif %}", "<|eos|>\n{% endif %}")  # Qwen-style turn end
    _, completion_ids = tokenize_prompt_completion(
        tok, [{"role": "user", "content": "a"}], [{"role": "assistant", "content": " b"}]
    )
    assert tok.decode(completion_ids) == " b<|eos|>\n"


def test_bad_rows_are_counted_not_silently_dropped(toy):
    import datasets

    tok = AutoTokenizer.from_pretrained(toy / "model")
    rows = {  # kept; empty completion; prompt too long; completion too long; empty prompt (no position to predict from)
        "prompt": ["sort: 1 ->", "sort: 2 ->", "x" * 40, "sort: 3 ->", ""],
        "completion": [" 1", "", " 2", " 3" * 30, " 7"],
    }

    class A:
        dataset_name, max_prompt_length, max_completion_length = "rows", 20, 20

    data, dropped = tokenize_sft(datasets.Dataset.from_dict(rows), tok, A)
    assert len(data["prompt"]) == len(data["completion"]) == 1 and dropped == {
        "empty completion": 1,
        "prompt too long": 1,
        "completion too long": 1,
        "empty prompt": 1,
    }
    with pytest.raises(ValueError, match="needs a 'completion' column"):
        tokenize_sft(datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}), tok, A)
    # a turn that only calls a tool is no empty completion; an empty reply is one
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    user = [{"role": "user", "content": "sum: 2 3 ->"}]
    turns = [[{"role": "assistant", "content": "", "tool_calls": [call]}], [{"role": "assistant", "content": ""}]]
    A.max_completion_length = 40
    data, dropped = tokenize_sft(datasets.Dataset.from_list([{"prompt": user, "completion": t} for t in turns]), tok, A)
    assert [tok.decode(ids) for ids in data["completion"]] == ['[calculator(expression="2+3")]<|eos|>']
    assert dropped["empty completion"] == 1


def test_a_chat_template_that_renders_the_prompt_otherwise_before_a_reply_is_refused(toy):
    """The completion is the text the template adds after the generation prompt. A template that renders the prompt
    differently when a reply follows (here: a system line before a generation prompt only) cannot be split so."""
    prompt, reply = [{"role": "user", "content": "sort: 21 ->"}], [{"role": "assistant", "content": " 12"}]
    tokenizer = AutoTokenizer.from_pretrained(toy / "model")
    prompt_ids, completion_ids = tokenize_prompt_completion(tokenizer, prompt, reply)  # the toy's own template
    assert tokenizer.decode(completion_ids).startswith(" 12") and completion_ids[-1] == tokenizer.eos_token_id
    tokenizer.chat_template = (
        "{% if add_generation_prompt %}SYSTEM {% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ValueError, match="does not render the prompt as the start of the conversation"):
        tokenize_prompt_completion(tokenizer, prompt, reply)


def test_load_split_file_folder_and_saved(toy, tmp_path):
    assert len(load_split(str(toy / "sft"), "train")) == 4000 and len(load_split(str(toy / "sft"), "test")) == 200
    assert len(load_split(str(toy / "sft" / "test.jsonl"), "train")) == 200
    assert load_split(str(toy / "sft" / "test.jsonl"), "test") is None  # a single file is the train split only
    load_split(str(toy / "sft"), "test").save_to_disk(str(tmp_path / "saved" / "test"))
    json.dump({"splits": ["test"]}, open(tmp_path / "saved" / "dataset_dict.json", "w"))
    assert (
        len(load_split(str(tmp_path / "saved"), "test")) == 200 and load_split(str(tmp_path / "saved"), "train") is None
    )


def test_rank_micro_batches_cover_every_row_once_with_equal_counts_per_rank(monkeypatch):
    for num_rows, world_size, size in [(10, 3, 2), (7, 2, 4), (1, 2, 3), (64, 4, 8)]:
        monkeypatch.setattr(sft.dist, "get_world_size", lambda: world_size)
        shares = []
        for r in range(world_size):  # each rank's view
            monkeypatch.setattr(sft.dist, "get_rank", lambda: r)
            shares.append(list(rank_micro_batches(num_rows, size)))
        assert len({len(s) for s in shares}) == 1  # as many forwards on every rank: FSDP's collectives line up
        valid_rows = [i for s in shares for rows, valid in s if valid for i in rows]
        assert sorted(valid_rows) == list(range(num_rows))
        assert all(rows == [0] for s in shares for rows, valid in s if not valid)


def test_global_batch_is_a_function_of_the_step_and_reshuffles_each_epoch():
    epoch0 = [
        global_batch(step, 10, 4, 3) for step in range(2)
    ]  # 10 rows, batches of 4: 2 steps per epoch, 2 rows left out
    assert len(set(epoch0[0] + epoch0[1])) == 8 and global_batch(1, 10, 4, 3) == epoch0[1]
    assert [global_batch(step, 10, 4, 3) for step in (2, 3)] != epoch0


# ---------------------------------------------------------------------------------------------- the script itself
def test_sft_learns_the_toy_task_on_two_processes(toy, sft_model):
    out, result = sft_model
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [50, 100, 150, 200, 250, 300]
    assert rows[-1]["loss"] < 0.3 * rows[0]["loss"] and rows[-1]["eval/loss"] < 0.5
    for key in ("loss", "lr", "grad_norm", "episode", "tokens_per_second"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[-1]["episode"] == 300 * 32
    before, after = (
        exact_match(str(toy / "model"), str(toy / "prompts" / "test.jsonl")),
        exact_match(str(out), str(toy / "prompts" / "test.jsonl")),
    )
    model, tok = load_causal_lm(str(out))
    scores = greedy_scores(model, tok, [json.loads(line) for line in open(toy / "prompts" / "test.jsonl")])
    ceiling = demonstrators_ceiling(str(toy / "prompts" / "test.jsonl"))
    print(f"toy exact match: untrained {before:.3f}, after 300 SFT steps {scores} (imitation ceiling {ceiling:.3f})")
    # it copies the flawed demonstrator: right elsewhere, its mistake on the flawed subset, so it stops at the ceiling
    assert before < 0.05 and after == scores["exact_match"]  # exact_match loads the folder with from_pretrained
    assert scores["other_prompts"] >= 0.9 and scores["flawed_subset"] <= 0.15 and abs(after - ceiling) <= 0.1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"


def test_conversational_messages_dropped_rows_and_wandb(toy, tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"sort: {d} ->"},
                {"role": "assistant", "content": " " + "".join(sorted(d))},
            ]
        }
        for d in ["312", "9081", "5521", "77"]
    ]
    rows.append({"messages": [{"role": "user", "content": "sort: 1 ->"}, {"role": "assistant", "content": ""}]})
    rows.append(
        {"messages": [{"role": "user", "content": "sort: " + "1" * 60 + " ->"}, {"role": "assistant", "content": " 1"}]}
    )
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_script(
        "sft.py",
        [
            "--model_name_or_path",
            toy / "model",
            "--dataset_name",
            tmp_path / "chat.jsonl",
            "--output_dir",
            tmp_path / "out",
            "--max_prompt_length",
            32,
            "--per_device_train_batch_size",
            2,
            "--max_steps",
            2,
            "--log_every",
            1,
            "--track",
        ],
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-8000:]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # --track logged the run (offline)
    assert (
        "train: 4 of 6 rows kept; dropped: {'empty completion': 1, 'prompt too long': 1, 'completion too long': 0, "
        "'empty prompt': 0}"
        in result.stdout
    )
    assert len(read_metrics(tmp_path / "out")) == 2


def test_a_resumed_run_continues_dropout_bit_for_bit(toy, tmp_path):
    """sft.py leaves dropout on (here a copy of the toy model with attention dropout 0.1): a resumed run must continue
    the random stream its dropout masks come from. 4 steps straight, and steps 3-4 resumed from the checkpoint of step
    2, end with the same weights, bit for bit; without dropout the straight run ends elsewhere (dropout did act)."""
    import shutil

    from conftest import run_in_process
    from safetensors.torch import load_file

    for name, dropout in (("dropout", 0.1), ("plain", 0.0)):
        shutil.copytree(toy / "model", tmp_path / f"model_{name}")
        config = json.load(open(tmp_path / f"model_{name}" / "config.json"))
        json.dump({**config, "attention_dropout": dropout}, open(tmp_path / f"model_{name}" / "config.json", "w"))
    args = ["--dataset_name", toy / "sft", "--max_steps", 4, "--save_every", 2, "--per_device_train_batch_size", 4]
    checkpoint = tmp_path / "straight" / "checkpoints" / "step_2"
    runs = {
        "straight": ["--model_name_or_path", tmp_path / "model_dropout"],
        "resumed": ["--model_name_or_path", tmp_path / "model_dropout", "--resume_from", checkpoint],
        "no_dropout": ["--model_name_or_path", tmp_path / "model_plain"],
    }
    for name, extra in runs.items():
        error, printed = run_in_process("sft.py", args + extra + ["--output_dir", tmp_path / name])
        assert error is None, (name, repr(error), printed[-2000:])
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in runs}
    assert all(torch.equal(weights["straight"][k], weights["resumed"][k]) for k in weights["straight"])
    assert not all(torch.equal(weights["straight"][k], weights["no_dropout"][k]) for k in weights["straight"])

"""Helpers are pasted verbatim into each script that needs them (STYLE.md): any function or class defined under the
same name in several top-level scripts must have the same source, so the copies cannot drift apart. And the layout:
the algorithm first, then one infrastructure line and the plumbing, then one guards line and the guards, below both
lines only those shared helpers."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [s for s in ("sft.py", "reward.py", "dpo.py", "ppo.py", "grpo.py") if os.path.exists(os.path.join(ROOT, s))]
# each script's own version of the same step, under one name so that `diff ppo.py grpo.py` lines them up (Args: the
# common block is checked field by field below); they live above the infrastructure line
PER_SCRIPT = {"Args", "main", "evaluate", "score_rollout", "accumulate_gradients", "window_metrics", "sample_rollout",
              "rollout_metrics"}
MARKER = "# Infrastructure: identical in every script that has it (tests/test_consistency.py). Skip it on a first read."
GUARDS = "# Guards: what only refuses bad input or protects a run, each reached by one call from the plumbing or main."
GUARD = '''if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # output into a closed pipe (--help | head): exit quietly
    first = os.environ.get("RANK", "0") == "0"  # tyro prints a value's refusal on every process: the first's alone
    with contextlib.redirect_stderr(sys.stderr if first else open(os.devnull, "w")):
        args = tyro.cli(Args, use_underscores=True, console_outputs=first)
    main(args)'''


def definitions(source):
    """name -> source text of every top-level function, class and constant (`NAME = ...`, such as the types that
    carry the numeric flags' rules)."""
    tree = ast.parse(source)
    named = {
        node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    named |= {
        node.targets[0].id: node
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    return {name: ast.get_source_segment(source, node) for name, node in named.items()}


def drifted_copies(sources):
    """Names defined in several scripts whose sources differ, with the scripts involved."""
    by_name = {}
    for script, source in sources.items():
        for name, text in definitions(source).items():
            by_name.setdefault(name, {})[script] = text
    return {
        name: sorted(copies)
        for name, copies in by_name.items()
        if name not in PER_SCRIPT and len(copies) > 1 and len(set(copies.values())) > 1
    }


def layout_problems(sources):
    """What breaks the layout of STYLE.md in each script: the infrastructure line (one line starting with "# " and
    containing "Infrastructure", the same MARKER in every script), then the GUARDS line; below them only helpers that
    two or more scripts define (and not a per-script step); `main` above them; the file ending with the guard."""
    counts = {}
    for source in sources.values():
        for name in definitions(source):
            counts[name] = counts.get(name, 0) + 1
    problems = []
    for script, source in sources.items():
        lines = source.splitlines()
        markers = [i + 1 for i, line in enumerate(lines) if line.startswith("# ") and "Infrastructure" in line]
        if len(markers) != 1 or lines[markers[0] - 1] != MARKER:
            problems.append(f"{script}: infrastructure lines at {markers}, not one MARKER")
            continue
        guards = [i + 1 for i, line in enumerate(lines) if line.startswith("# Guards")]
        if len(guards) != 1 or lines[guards[0] - 1] != GUARDS or guards[0] < markers[0]:
            problems.append(f"{script}: guards lines at {guards}, not one GUARDS line after the infrastructure line")
        for node in ast.parse(source).body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue
            below = node.lineno > markers[0]
            if below and (counts[node.name] < 2 or node.name in PER_SCRIPT):
                problems.append(f"{script}: {node.name} is below the infrastructure line but not a shared helper")
            if node.name == "main" and below:
                problems.append(f"{script}: main is below the infrastructure line")
        if not source.rstrip().endswith(GUARD):
            problems.append(f"{script}: does not end with the guard calling main(tyro.cli(Args))")
    return problems


def test_layout_algorithm_first_infrastructure_last():
    assert layout_problems({s: open(os.path.join(ROOT, s)).read() for s in SCRIPTS}) == []


def test_the_layout_check_catches_a_script_only_helper_below_the_line():
    def script(extra_below, guards=GUARDS):
        algorithm = "def loss(x):\n    return x\n\n\ndef main(args):\n    pass\n\n\n"
        return f"{algorithm}{MARKER}\ndef pad(x):\n    return x\n\n\n{guards}\n{extra_below}\n\n{GUARD}\n"

    good = {"a.py": script(""), "b.py": script("")}
    assert layout_problems(good) == []
    bad = {"a.py": script("\n\ndef only_here(x):\n    return x\n"), "b.py": script("")}
    assert layout_problems(bad) == ["a.py: only_here is below the infrastructure line but not a shared helper"]
    main_below = f"def loss(x):\n    return x\n\n\n{MARKER}\ndef main(args):\n    pass\n\n\ndef pad(x):\n    return x\n"
    assert "a.py: main is below the infrastructure line" in layout_problems(
        {"a.py": main_below + f"\n\n{GUARDS}\n\n{GUARD}\n", "b.py": script("")}
    )
    no_guards = {"a.py": script("", guards="# guards"), "b.py": script("")}
    assert layout_problems(no_guards) == ["a.py: guards lines at [], not one GUARDS line after the infrastructure line"]


def test_shared_helpers_are_identical_across_scripts():
    sources = {s: open(os.path.join(ROOT, s)).read() for s in SCRIPTS}
    assert drifted_copies(sources) == {}


def test_the_check_catches_a_drifted_copy():
    a = "def pad(x):\n    return x\n\ndef loss(y):\n    return y\n\nRate = Annotated[float, 1]\n"
    b = "def pad(x):\n    return x + 0\n\ndef loss(y):\n    return -y\n\nRate = Annotated[float, 2]\n"
    c = "def pad(x):\n    return x\n"
    assert drifted_copies({"a.py": a, "c.py": c}) == {}  # a verbatim copy passes; a name in one script is free
    assert drifted_copies({"a.py": a, "b.py": b, "c.py": c}) == {
        "pad": ["a.py", "b.py", "c.py"],
        "loss": ["a.py", "b.py"],
        "Rate": ["a.py", "b.py"],
    }


COMMON_FIELDS = [
    "seed",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "output_dir",
    "model_name_or_path",
    "dataset_name",
    "dataset_train_split",
    "dataset_test_split",
    "max_steps",
    "num_train_epochs",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "per_device_eval_batch_size",
    "max_grad_norm",
    "optimizer",
    "adam_epsilon",
    "weight_decay",
    "bf16",
    "gradient_checkpointing",
    "padding_free",
    "cpu_offload",
    "shard_degree",
    "reshard_after_forward",
    "log_every",
    "eval_every",
    "save_every",
    "resume_from",
    "trust_remote_code",
]


# each file's size in characters may not pass its ceiling: a feature pays for itself by making something else shorter
CEILINGS = {"sft.py": 57_767, "reward.py": 57_868, "dpo.py": 65_403, "ppo.py": 79_138, "grpo.py": 108_485,
            "README.md": 35_849}


def test_every_file_is_within_its_character_ceiling():
    sizes = {name: len(open(os.path.join(ROOT, name)).read()) for name in CEILINGS}
    assert {name: f"{size} > {CEILINGS[name]}" for name, size in sizes.items() if size > CEILINGS[name]} == {}


@pytest.mark.parametrize("script", SCRIPTS)
def test_common_arguments_come_first_in_every_script(script):
    """The common command line (DESIGN.md) opens every Args, in the same order, so `diff` shows only the algorithm."""
    args = next(
        node
        for node in ast.parse(open(os.path.join(ROOT, script)).read()).body
        if isinstance(node, ast.ClassDef) and node.name == "Args"
    )
    fields = [node.target.id for node in args.body if isinstance(node, ast.AnnAssign)]
    assert fields[: len(COMMON_FIELDS)] == COMMON_FIELDS


def nesting(node):
    """How many blocks (for, while, if, with, try, def) deep `node` reaches, itself included."""
    inner = max((nesting(child) for child in ast.iter_child_nodes(node)), default=0)
    return inner + isinstance(node, (ast.For, ast.While, ast.If, ast.With, ast.Try, ast.FunctionDef))


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_nests_at_most_four_levels(script):
    main = next(n for n in ast.parse(open(os.path.join(ROOT, script)).read()).body if getattr(n, "name", "") == "main")
    assert max(nesting(statement) for statement in main.body) <= 4
    five = "for a in b:\n for c in d:\n  if e:\n   with f:\n    while g:\n     pass\n"  # the count can exceed 4
    assert nesting(ast.parse(five).body[0]) == 5


COLLECTIVE_CALLS = {"all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                    "reduce", "gather", "scatter", "destroy_process_group", "save", "load"}  # of dist and dcp
STATE_DICT_CALLS = {"get_state_dict", "set_state_dict", "get_model_state_dict"}  # DCP's, collectives too


def called(node):
    """What `node` calls: the functions it names (`f(...)`) and the collectives (`dist.f(...)`, `dcp.f(...)`)."""
    names = set()
    for call in [n.func for n in ast.walk(node) if isinstance(n, ast.Call)]:
        if isinstance(call, ast.Name):
            names.add(call.id)
        elif isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name) and call.value.id in ("dist", "dcp"):
            names.add(call.attr if call.attr in COLLECTIVE_CALLS else f"{call.value.id}.{call.attr}")
    return names


def is_rank_test(test, op):
    """`rank == 0` / `dist.get_rank() == 0` (op ast.Eq), or the same with !=."""
    if not (isinstance(test, ast.Compare) and isinstance(test.ops[0], op) and len(test.ops) == 1):
        return False
    left, right = test.left, test.comparators[0]
    rank = (isinstance(left, ast.Name) and left.id == "rank") or "dist.get_rank" in called(left)
    return rank and isinstance(right, ast.Constant) and right.value == 0


def collectives_on_rank_0(source):
    """Calls that all ranks must make (collectives, or a function of the script that makes one) in code that only
    the first rank runs: an `if rank == 0:` body, or what follows `if dist.get_rank() != 0: return`."""
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    collective = COLLECTIVE_CALLS | STATE_DICT_CALLS
    while True:  # the script's functions that reach a collective, directly or through another
        more = {name for name, node in functions.items() if called(node) & collective} - collective
        if not more:
            break
        collective |= more
    found = []
    for function in functions.values():
        for node in ast.walk(function):
            blocks = []
            if isinstance(node, ast.If) and is_rank_test(node.test, ast.Eq):
                blocks = node.body
            body = getattr(node, "body", [])
            for i, statement in enumerate(body if isinstance(body, list) else []):
                if isinstance(statement, ast.If) and is_rank_test(statement.test, ast.NotEq) and \
                        isinstance(statement.body[-1], ast.Return):
                    blocks = blocks + body[i + 1 :]
            found += [f"{function.name}: {name}" for block in blocks for name in sorted(called(block) & collective)]
    return found


def test_no_collective_runs_on_the_first_rank_alone():
    """A collective that only rank 0 reaches hangs every other rank (until the timeout): none in any script."""
    for script in SCRIPTS:
        assert collectives_on_rank_0(open(os.path.join(ROOT, script)).read()) == [], script


def test_the_rank_0_check_catches_a_collective():
    source = (
        "def sync(x):\n    dist.all_reduce(x)\n\n\n"
        "def log(x, rank):\n    if rank == 0:\n        sync(x)\n\n\n"
        "def write(x):\n    if dist.get_rank() != 0:\n        return\n    dist.barrier()\n\n\n"
        "def fine(x, rank):\n    dist.barrier()\n    if rank == 0:\n        print(x)\n"
    )
    assert collectives_on_rank_0(source) == ["log: sync", "write: barrier"]

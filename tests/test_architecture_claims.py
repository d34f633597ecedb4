"""docs/architecture.md says what the code is; these are the facts of it a test can state, read off the source:
every name and path it sets in code font exists (or is a config key, or an outside name listed with its reason),
the layer stack it draws is the one tests/test_house_rules.py enforces, the mesh is the code's, the dispatch
attributes and the readers of parameter kinds are where its tables say, and one training step runs in the order
it tells (the data-parallel average inside the backward, before `finalize_grads`)."""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import cache

import pytest

from launch import ROOT
from parallel_attention import load_config
from parallel_attention.tensor_parallel.mesh_groups import MESH_DIMS
from test_house_rules import LAYER, PACKAGE

PAGE = ROOT / "docs" / "architecture.md"
# names in code font that are not the package's, with why they may stand
OUTSIDE = {
    "torch.distributed": "torch", "F.cross_entropy": "torch", "varlen_attn": "torch's packed-document kernel",
    "save_pretrained": "transformers", "fully_shard": "torch's FSDP2", "transformers": "the library",
    "Partial": "the alias removed in 0.4 (an AttributeError names what replaces it)",
    "torch.autograd.Function": "torch", "RANK": "torchrun's environment variable",
    ".NAME.partial/": "a preparation's folder while it runs",
    "ValueError": "Python", "assert": "Python", "isinstance": "Python", "null": "JSON", "parallel_attention": "the package itself",
    "LAYER": "tests/test_house_rules.py", "LONGER": "tests/test_house_rules.py",
    "skipped_steps": "a metrics.jsonl key", "s": "shape legend", "b": "shape legend", "h": "shape legend",
    "p": "shape legend", "d": "shape legend", "nh": "shape legend", "nkv": "shape legend", "dim": "shape legend",
    "model_tpNN": "a file name", "optim_tpNN": "a file name", "rng_rankNNNNN": "a file name", "_ppSS": "a file name",
    "checkpoints/": "a run directory's folder", "step_0000100/": "a checkpoint's folder",
}
FILES = re.compile(r"\.(json|jsonl|yaml|png)$")  # files a run writes, not code
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/?")


def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


def _section(title: str) -> str:
    """The text under the heading `title` (any level), to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(title)}\n", _page(), flags=re.M)
    assert match, f"no section {title!r} in {PAGE.name}"
    rest = _page()[match.end():]
    end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def _table(text: str) -> list[list[str]]:
    """The cells of each body row of the one markdown table in `text` (its header row dropped)."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")][1:]


def _exposed(tree: ast.Module) -> set[str]:
    """What a module defines or imports at top level, and its classes' members (`C.m` and bare `m`, `self._x` too)."""
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | _self_attributes(node) | \
                      {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            found |= members | {f"{node.name}.{m}" for m in members}
    return found


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """`self.x` names assigned anywhere in the class (tuple targets included)."""
    targets = [t for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets]
    flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return {e.attr for e in flat if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
            and e.value.id == "self"}


@cache
def _tree(path: str) -> ast.Module:
    """The module at `path`, from the package root."""
    return ast.parse((PACKAGE / path).read_text(encoding="utf-8"))


@cache
def _trees() -> dict[tuple[str, ...], ast.Module]:
    """Each module of the package by its dotted parts below parallel_attention (a package: its folder's parts)."""
    return {tuple(p for p in path.relative_to(PACKAGE).with_suffix("").parts if p != "__init__"):
            _tree(path.relative_to(PACKAGE).as_posix()) for path in PACKAGE.rglob("*.py")}


@cache
def _classes() -> list[tuple[tuple[str, ...], ast.ClassDef]]:
    """Every class of the package, with its module's dotted parts."""
    return [(parts, n) for parts, tree in _trees().items() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


@cache
def _known_names() -> set[str]:
    """Every name the page may write: each module by any tail of its dotted path, and `tail.member` for what it
    exposes; bare members too (a bare name in the page names something that exists somewhere)."""
    known = set()
    for parts, tree in _trees().items():
        tails = {".".join(parts[i:]) for i in range(len(parts))} | {""}
        known |= {t for t in tails if t} | {f"{t}.{n}" if t else n for t in tails for n in _exposed(tree)}
    return known


@cache
def _config_keys() -> set[str]:
    """`section.key` of every run config field, and the bare field names of every config dataclass."""
    cfg, keys = load_config(), set()
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            keys |= {f"{section.name}.{f.name}" for f in dataclasses.fields(value)} | \
                    {f.name for f in dataclasses.fields(value)}
    return keys


@cache
def _inside() -> tuple[str, ...]:
    """Every folder and file of the package, as `/path/from/the/package/root` (folders end with /)."""
    return tuple("/" + p.relative_to(PACKAGE).as_posix() + ("/" if p.is_dir() else "") for p in PACKAGE.rglob("*")
                 if "__pycache__" not in p.parts)


def _path_exists(token: str) -> bool:
    """A path from the repository root, or the tail of a path inside the package (a folder, a module)."""
    return (ROOT / token).exists() or any(p.endswith(("/" + token, "/" + token + ".py")) for p in _inside())


def _unresolved(token: str) -> bool:
    name = re.sub(r"\(.*\)$|=.*$", "", token).removeprefix("parallel_attention.")
    if token in OUTSIDE or name in OUTSIDE or FILES.search(token):
        return False
    if "/" in token or token.endswith(".py"):
        return bool(PATH.fullmatch(token)) and not _path_exists(token)
    if not NAME.fullmatch(name):
        return False  # shapes, placeholders, messages, commands: not names
    return name not in _known_names() and name not in _config_keys()


def test_every_name_and_path_in_code_font_exists():
    tokens = sorted(set(re.findall(r"`([^`\n]+)`", _page())))
    missing = [t for t in tokens if _unresolved(t)]
    assert not missing, f"{PAGE.name} names what the code does not have (or add it to OUTSIDE with why): {missing}"


def _stack_rows() -> list[set[str]]:
    """The packages of each row of the layer-stack drawing, bottom row first (a row: its leading `name/` words)."""
    drawing = re.search(r"```\n(.*?)```", _section("The layer stack"), flags=re.S).group(1)
    rows = []
    for line in drawing.splitlines():
        words = line.split()
        if not words or words[0] == "^":
            continue
        rows.append({w[:-1] for w in words[:next((i for i, w in enumerate(words) if not re.fullmatch(r"[a-z_]+/", w)),
                                                 len(words))]})
    return rows[::-1]


def test_the_layer_stack_is_the_one_the_house_rules_enforce():
    layers = {name: n for name, n in LAYER.items() if re.fullmatch(r"[a-z_]+", name)}  # the top-level packages
    level = {name: i for i, row in enumerate(_stack_rows()) for name in row if name in layers}
    assert level.keys() == layers.keys(), f"the drawing has {sorted(level)}, the house rules {sorted(layers)}"
    wrong = [(a, b) for a in layers for b in layers if (layers[a] < layers[b]) != (level[a] < level[b])]
    assert not wrong, f"pairs drawn in another order than tests/test_house_rules.py's LAYER: {wrong}"


def test_the_mesh_is_the_code_s():
    page, stated = _page(), "(" + ", ".join(f'"{d}"' for d in MESH_DIMS) + ")"
    tuples = set(re.findall(r'\((?:"(?:pp|dp|cp|tp)"(?:, )?)+\)', page))
    assert tuples == {stated}, f"the page's mesh dimensions {tuples}, the code's {stated}"
    assert "World = " + " x ".join(MESH_DIMS) in page


def test_the_dispatch_attributes_are_set_where_the_table_says():
    for row in _table(_section("Choose once in `__init__`")):
        classes = re.findall(r"`([A-Z]\w+)`", row[0])
        attributes = set(re.findall(r"`(_\w+)`", row[1]))
        package = re.search(r"`(\w+)`", row[0]).group(1)  # a sub-package's row (`hf`): its classes together
        found = {a for parts, cls in _classes() if (cls.name == classes[0] if classes else parts[:1] == (package,))
                 for a in _self_attributes(cls)}
        assert attributes <= found, f"{row[0]}: {sorted(attributes - found)} are not set in __init__"


def _defines(path: str, dotted: str) -> bool:
    """Whether the module at `path` (from the package root) defines `dotted` (a function, or Class.method)."""
    tree = _tree(path)
    *owner, name = dotted.split(".")
    scope = tree.body if not owner else next((n.body for n in tree.body if isinstance(n, ast.ClassDef)
                                              and n.name == owner[0]), [])
    return any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in scope)


def test_the_readers_and_the_checkpoint_modules_are_where_the_tables_say():
    readers = _section("Parameter kinds").split("Readers of the declarations:", 1)[1]
    for reader, where, _ in _table(readers):
        assert _defines(where.strip("`"), reader.strip("`")), f"{reader} is not defined in {where}"
    for module, owns in _table(_section("Checkpoint files (`checkpointing/`)")):
        path = "checkpointing/" + module.strip("`")
        defined_elsewhere = {n for n in re.findall(r"`(\w+)`", owns) for p in (PACKAGE / "checkpointing").glob("*.py")
                             if _defines(f"checkpointing/{p.name}", n)}
        exposed = _exposed(_tree(path))
        assert defined_elsewhere <= exposed, f"{module} does not hold {sorted(defined_elsewhere - exposed)}"


def _calls(function: str, module: str) -> list[str]:
    """The names the function calls, in source order (`a.b(...)`: b)."""
    body = next(n for n in ast.walk(_tree(module)) if isinstance(n, ast.FunctionDef) and n.name == function)
    calls = sorted((n for n in ast.walk(body) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    return [n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "") for n in calls]


def _told_in_order(text: str, calls: list[str], pairs: list[tuple[str, str]]) -> None:
    """Each (words of the page, call of the code) pair comes after the previous one on both sides."""
    told = [text.find(words) for words, _ in pairs]
    done = [calls.index(call) if call in calls else -1 for _, call in pairs]
    assert -1 not in told and told == sorted(told), list(zip((w for w, _ in pairs), told))
    assert -1 not in done and done == sorted(done), list(zip((c for _, c in pairs), done))


def _step(n: int) -> str:
    text = _section("One training step")
    return text.split(f"\n{n}. **", 1)[1].split(f"\n{n + 1}. **", 1)[0]


# step of "One training step" -> (the trainer's function, [(words of the page, the call they tell)] in order)
ORDERS = {
    1: ("build", [("`parallel.debug_collectives`", "enable_collective_log"), ("`init_distributed`", "init_distributed"),
                  ("`check_config_agreement`", "check_config_agreement"), ("`lock_run_dir`", "lock_run_dir"),
                  ("`prepare_run_dir`", "prepare_run_dir"), ("the data is prepared", "build_data"),
                  ("`manual_seed`", "manual_seed"), ("`GPTModel`", "GPTModel")]),
    3: ("train_step", [("inside the last micro-batch's backward", "forward_backward"),
                       ("`finalize_grads`", "finalize_grads"), ("the scaler unscales", "unscale"),
                       ("`global_grad_norm`", "global_grad_norm"),
                       ("the loss is averaged over the data-parallel ranks", "all_reduce"),
                       ("divergence guard", "update"), ("clipped", "clip_gradients"), ("AdamW steps", "step")]),
    4: ("train_loop", [("**evaluation**", "evaluate"), ("**logging**", "log_step"),
                       ("**the divergence guard**", "raise_if_stopped"), ("**SIGTERM or SIGINT**", "any_rank"),
                       ("**checkpoint**", "checkpoint"), ("**the replica audit**", "check_replicas")]),
}


@pytest.mark.parametrize("step", sorted(ORDERS))
def test_the_trainer_runs_in_the_order_the_page_tells(step):
    function, pairs = ORDERS[step]
    _told_in_order(_step(step), _calls(function, "training/trainer.py"), pairs)


def test_the_data_parallel_average_runs_in_the_backward_before_finalize_grads():
    """The gradient sync rides in each micro-batch's forward and backward (DDP's no_sync, ChunkReducer's hooks) and
    completes before `forward_backward` returns, which train_step calls before `finalize_grads` (ORDERS[3])."""
    contract = next(n for n in _tree("pipeline/micro_batch_step.py").body
                    if isinstance(n, ast.ClassDef) and n.name == "MicroBatchStep")
    entered = {ast.unparse(item.context_expr) for node in ast.walk(contract) if isinstance(node, ast.With)
               for item in node.items}
    assert {"self.sync.forward(chunk, last)", "self.sync.backward(chunk, last)"} <= entered
    assert _calls("forward_backward", "training/step.py").index("finish") < \
        _calls("forward_backward", "training/step.py").index("sum_tied_embedding_grads")

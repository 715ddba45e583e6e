"""``draftsmith bench-tree``: what one verification forward costs as the draft tree grows.

A tree method trades target forwards for wider forwards; this measures the price. For each size S
the target runs the runtime's own verification forward (4D tree mask, depth positions, a
preallocated cache and, on a float32 CPU, the prepacked linears of ``--linear``) over S query tokens,
the root plus S - 1 draft nodes, on top of a KV cache that holds a ``prefix``-token context, and the
median over repeats is reported relative to S = 1 (a plain decoding step). Sizes are timed
interleaved, repeat by repeat, so machine noise hits all of them alike; the cache is cut back to the
prefix after each forward, outside the timed region. Every size is also shown against its floor on
this machine (:mod:`floor`: the weights' bytes over the measured read speed, or the linears'
multiply-adds of that many rows over the measured multiply-add speed, whichever is higher).

Tree shapes: ``random`` (each node's parent drawn uniformly among the root and the earlier nodes, a
fixed seed; a bushy tree like EAGLE-2's) or ``chain`` (a draft-model or prompt-lookup chain). For the
cost of one forward the shape matters little: the query count and the mask size drive it.

The tokens are natural text, as decoding verifies: the prefix and, for every node, the token its depth
reaches in the text's continuation (:func:`text_ids`, the bundled conversations). Random token ids made
rows whose logits are flat, and the screened head's proof then checked tens of thousands of contenders
a row on Gemma-3's 262,144-token vocabulary, which no decode does.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.core.cache import keep_positions
from draftsmith.core.io import OutputRules, atomic_directory, atomic_write_bytes, atomic_write_json
from draftsmith.core.target import Target
from draftsmith.core.tree import DraftTree
from draftsmith.data.cli import default_dataset_path
from draftsmith.data.formats import read_records
from draftsmith.inference.backends import DEFAULT_TREE_ROOM, Backends
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.measure.bench_report import linear_note
from draftsmith.inference.measure.errors import BenchError
from draftsmith.inference.measure.floor import ReadSpeed, floor_note, rows_floor_ms, step_floor
from draftsmith.inference.runtime import PlainDecoding

SHAPES = ("random", "chain")
WARMUP = 2  # untimed forwards per size before the timed repeats
PROFILE_ROUNDS = 5  # profiled forwards per size (--profile), after the timed ones; the median is shown
PROFILE_TOP = 8  # operators named in the profile table; the rest are summed


def build_tree(num_nodes: int, shape: str, seed: int = 0) -> DraftTree:
    """A draft tree with ``num_nodes`` nodes (token ids are irrelevant to the cost; they are set later)."""
    if shape == "chain":
        parents = list(range(-1, num_nodes - 1))
    elif shape == "random":
        rng = random.Random(seed)
        parents = [rng.randrange(-1, i) for i in range(num_nodes)]
    else:
        raise BenchError(f"unknown tree shape {shape!r}; choose one of {', '.join(SHAPES)}")
    return DraftTree(torch.zeros(num_nodes, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def parse_sizes(text: str) -> list[int]:
    """``1,4,8`` -> [1, 4, 8]; 1 is always included (it is the reference)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BenchError(f"--sizes must be comma-separated whole numbers, e.g. 1,4,8,16; got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise BenchError(f"--sizes must be positive; got {text!r}")
    return sorted({1, *sizes})


def text_ids(tokenizer, count: int, seed: int = 0) -> list[int]:
    """``count`` token ids of natural text: the turns of the bundled conversations in order, from the one
    ``seed`` picks, around again where they run out."""
    records = list(read_records(str(default_dataset_path())))
    ids: list[int] = []
    for i in range(seed, seed + len(records)):
        for turn in records[i % len(records)]["conversations"]:
            ids += tokenizer(turn["value"], add_special_tokens=False)["input_ids"]
        if len(ids) >= count:
            return ids[:count]
    return (ids * (count // max(len(ids), 1) + 1))[:count]


class _VerificationForward:
    """The runtime's verification forward (its eager backend: direct where the target allows it,
    packed GEMM and the screened head as the kernel options say) over a given tree on top of a fixed
    cached prefix, timed."""

    def __init__(self, target: Target, prefix: int, seed: int, backends: Backends) -> None:
        self.model = target.model
        self.backend = backends.for_generation(self.model, PlainDecoding(), reads_logits=False)
        self.kernels = self.backend.kernels
        self.device, self.dtype = self.backend.device, self.backend.dtype
        self.prefix = prefix
        self.cache = self.backend.new_cache(prefix + 2 * DEFAULT_TREE_ROOM)
        self.text = text_ids(target.tokenizer, prefix + 2 * DEFAULT_TREE_ROOM, seed)
        self.backend.prefill(self.cache, self.text[:prefix], hidden=False)

    @torch.no_grad()
    def seconds(self, tree: DraftTree, clock: Callable[[], float] = time.perf_counter) -> float:
        if self.kernels.gemm is not None:
            self.kernels.gemm.padded_rows(1 + len(tree))  # packing a new bucket is not part of a forward's cost
        continuation = self.text[self.prefix :]
        tree = DraftTree(torch.tensor([continuation[depth] for depth in tree.depths().tolist()]), tree.parents)
        start = clock()
        self.backend.verify(self.cache, continuation[0], tree, self.prefix, False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = clock() - start
        keep_positions(self.cache.kv, torch.arange(self.prefix))  # back to the prefix, untimed
        return elapsed


# A forward right after forwards of a very different size runs slower for a while (the core's clock and
# caches carry the last forward's load over; after tune's 60-row forwards a one-row forward was measured
# far slower than in a run of one-row forwards), while decoding repeats forwards of one size. So each
# timed forward follows untimed ones of its own size for at least this long.
SETTLE_SECONDS = 0.05


def settled_seconds(forward: _VerificationForward, tree: DraftTree) -> float:
    """One timed forward of ``tree`` after untimed ones of its size for :data:`SETTLE_SECONDS` (at least one)."""
    start = time.perf_counter()
    forward.seconds(tree)
    while time.perf_counter() - start < SETTLE_SECONDS:
        forward.seconds(tree)
    return forward.seconds(tree)


def run_tree_bench(
    target: Target,
    sizes: list[int],
    prefix: int,
    repeats: int,
    shape: str = "random",
    seed: int = 0,
    backends: Backends | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Median seconds of one verification forward per size, and its ratio to the 1-token forward, through
    ``backends``' eager kernels (default: the default kernel options); with ``profile``, also where each
    size's milliseconds go (:func:`profile_forwards`)."""
    if repeats < 1:
        raise BenchError(f"--repeats must be at least 1; got {repeats}")
    if prefix < 1:
        raise BenchError(f"--prefix must be at least 1 token; got {prefix}")
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit is not None and prefix + max(sizes) > limit:
        raise BenchError(f"--prefix {prefix} + size {max(sizes)} exceeds the target's {limit} positions")
    trees = {size: build_tree(size - 1, shape, seed) for size in sizes}
    backends = backends or Backends(KernelOptions())
    forward = _VerificationForward(target, prefix, seed, backends)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    speed = ReadSpeed()
    speed.passes()  # before the warm-up, which the forwards then need (ReadSpeed)
    for _ in range(WARMUP):
        for size in sizes:
            forward.seconds(trees[size])
    for _ in tqdm(range(repeats), desc="bench-tree", unit="repeat", dynamic_ncols=True):
        for size in sizes:  # every size once per round: a drifting machine shifts them alike
            timings[size].append(settled_seconds(forward, trees[size]))
    speed.passes()
    base = statistics.median(timings[1])
    spent = profile_forwards(forward, trees) if profile else None
    rows = [
        {
            "size": size,
            "draft_nodes": size - 1,
            "max_depth": int(trees[size].depths().max()) if size > 1 else 0,
            "median_ms": statistics.median(timings[size]) * 1e3,
            "relative": statistics.median(timings[size]) / base,
            "all_ms": [t * 1e3 for t in timings[size]],
        }
        for size in sizes
    ]
    return {
        "target": target.identity.to_dict() if target.identity else None,
        "prefix": prefix,
        "repeats": repeats,
        "shape": shape,
        "threads": torch.get_num_threads(),
        "device": str(forward.device),
        "dtype": str(forward.dtype).removeprefix("torch."),
        "linear": forward.kernels.linear_record(),
        "greedy_head": forward.kernels.greedy_head() is not None,
        "native": forward.kernels.direct() is not None and forward.kernels.direct().native,
        "floor": step_floor(target.model, forward.kernels.greedy_head(), speed),
        "rows": rows,
        **({"profile_ms": spent} if spent is not None else {}),
    }


def profile_forwards(forward: _VerificationForward, trees: dict[int, DraftTree]) -> dict[str, dict[str, float]]:
    """Milliseconds of each operator (its own time, without the operators it calls) per size: the median
    over :data:`PROFILE_ROUNDS` forwards, each under torch's profiler; the C++ kernels record themselves
    as ``draftsmith::...``, and ``(outside operators)`` is the forward's wall time that no operator holds
    (Python)."""
    from torch.profiler import ProfilerActivity, profile

    rounds: dict[int, list[dict[str, float]]] = {size: [] for size in trees}
    for _ in range(PROFILE_ROUNDS):
        for size, tree in trees.items():  # sizes in turns, as the timed repeats
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                wall_ms = forward.seconds(tree) * 1e3
            ops = {event.key: event.self_cpu_time_total / 1e3 for event in profiler.key_averages()}
            ops["(outside operators)"] = max(0.0, wall_ms - sum(ops.values()))
            rounds[size].append(ops)
    return {str(size): _median_per_operator(taken) for size, taken in rounds.items()}


def component_profile(
    target: Target, sizes: list[int], prefix: int, repeats: int = 30, backends: Backends | None = None
) -> dict[int, dict[str, float]]:
    """Milliseconds of this thread's CPU time (one torch thread: on a machine others share, the time it
    waits for a core is left out; the least over ``repeats``, sizes in turns) of a verification forward per
    size and of its parts run alone on inputs of its shapes: the linears (every layer's stream products, as
    the C++ layers take them), the attention over the cached prefix, the greedy head (screen, contenders and
    proof, on the model's own last hidden states). What the forward takes beyond its parts is the glue (norms,
    RoPE, residuals, the cache) and the dispatch from Python. Needs the C++ kernels and the stream kernel."""
    if torch.get_num_threads() != 1:
        raise BenchError("component_profile times one thread's CPU time: torch.set_num_threads(1) first")
    forward = _VerificationForward(target, prefix, 0, backends or Backends(KernelOptions(linear="stream")))
    trees = {size: build_tree(size - 1, "random") for size in sizes}
    for size in sizes:
        forward.seconds(trees[size])  # makes the packs (and the stacked ones) the parts read
    parts = {size: _parts(forward, size) for size in sizes}
    least: dict[int, dict[str, float]] = {size: {} for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            _keep_least(least[size], "forward", forward.seconds(trees[size], time.thread_time))
            for name, run in parts[size].items():
                before = time.thread_time()
                run()
                _keep_least(least[size], name, time.thread_time() - before)
    return {size: {name: 1e3 * value for name, value in taken.items()} for size, taken in least.items()}


def _keep_least(taken: dict[str, float], name: str, seconds: float) -> None:
    taken[name] = min(taken.get(name, seconds), seconds)


def _parts(forward: _VerificationForward, rows: int) -> dict[str, Any]:
    """The parts of a ``rows``-row forward that :func:`component_profile` times alone, as callables."""
    model, kernels, extension = forward.model, forward.kernels, forward.kernels.extension()
    gemm, head = kernels.gemm, kernels.greedy_head()
    config = model.config
    generator = torch.Generator().manual_seed(rows)
    products = []
    with gemm.rows(), torch.no_grad():  # packs serve inference only
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for group in (
                (attention.q_proj, attention.k_proj, attention.v_proj),
                (attention.o_proj,),
                (mlp.gate_proj, mlp.up_proj),
                (mlp.down_proj,),
            ):
                stacked = gemm.fused_pack(group) if len(group) > 1 else None
                packs = [stacked] if stacked is not None else [linear.active_pack(rows) for linear in group]
                x = torch.randn(rows, group[0].in_features, generator=generator)
                products += [(x, pack) for pack in packs]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    keys = forward.prefix + rows
    query = torch.randn(1, heads, rows, head_dim, generator=generator)
    # every layer its own keys and values, as the cache holds them: read from memory, not from the caches
    cached = torch.randn(len(model.model.layers), 2, 1, kv_heads, keys, head_dim, generator=generator)
    mask = torch.ones(1, 1, rows, keys, dtype=torch.bool)
    mask[0, 0, :, forward.prefix :] = torch.ones(rows, rows, dtype=torch.bool).tril()
    scaling = head_dim**-0.5
    with torch.no_grad():
        states = kernels._sample_states(rows).contiguous()

    def linears() -> None:
        for x, pack in products:
            extension.stream_linear(x, pack)

    def attend() -> None:
        for layer in cached:
            extension.attend(query, layer[0], layer[1], mask, scaling, False)

    return {"linears": linears, "attention": attend, "greedy head": lambda: head(states, extension)}


def component_markdown(spent: dict[int, dict[str, float]]) -> str:
    """:func:`component_profile` as a table, the forward's remainder past its parts as its own line."""
    sizes = list(spent)
    names = ["linears", "attention", "greedy head"]
    lines = ["| part | " + " | ".join(f"{size} rows" for size in sizes) + " |", "| --- |" + " --- |" * len(sizes)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{spent[size][name]:.2f}" for size in sizes) + " |")
    rest = [spent[size]["forward"] - sum(spent[size][name] for name in names) for size in sizes]
    lines.append("| norms, RoPE, glue, dispatch, Python | " + " | ".join(f"{ms:.2f}" for ms in rest) + " |")
    lines.append("| whole forward | " + " | ".join(f"{spent[size]['forward']:.2f}" for size in sizes) + " |")
    return "\n".join(lines) + "\n"


def _median_per_operator(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each operator's median milliseconds over the profiled forwards (0 in a forward that did not run it),
    so that one disturbed forward does not move the table."""
    names = {name for ops in rounds for name in ops}
    medians = {name: statistics.median(ops.get(name, 0.0) for ops in rounds) for name in names}
    return {name: ms for name, ms in medians.items() if ms > 0}


def profile_markdown(spent: dict[str, dict[str, float]]) -> str:
    """The profile as a table: the operators that take most time at any size, then the rest summed."""
    sizes = list(spent)
    every = {op for ops in spent.values() for op in ops}
    heaviest = sorted(every, key=lambda op: -max(spent[size].get(op, 0.0) for size in sizes))
    named = heaviest[:PROFILE_TOP]
    lines = [
        "Where a forward's milliseconds go (own time per operator under torch's profiler, median of "
        f"{PROFILE_ROUNDS} forwards per size; medians need not add up to a median total):",
        "",
        "| operator | " + " | ".join(f"size {size}" for size in sizes) + " |",
        "| --- |" + " --- |" * len(sizes),
    ]
    for op in named:
        lines.append(f"| `{op}` | " + " | ".join(f"{spent[size].get(op, 0.0):.2f}" for size in sizes) + " |")
    rest = [sum(ms for op, ms in spent[size].items() if op not in named) for size in sizes]
    lines.append("| other operators | " + " | ".join(f"{ms:.2f}" for ms in rest) + " |")
    lines.append("| sum | " + " | ".join(f"{sum(spent[size].values()):.2f}" for size in sizes) + " |")
    return "\n".join(lines) + "\n"


def tree_markdown(results: dict[str, Any]) -> str:
    lines = [
        f"One verification forward on a {results['prefix']}-token cached prefix, {results['shape']} tree, "
        f"{results['threads']} threads, {results['dtype']} on {results['device']}"
        f"{', ' + linear_note(results['linear']) if results.get('linear') else ''}"
        f"{', greedy tokens through the screened head' if results.get('greedy_head') else ''}"
        f"{', decoder layers and contender search in C++' if results.get('native') else ''}; median of "
        f"{results['repeats']}; size = query tokens (root + draft nodes).",
        *([floor_note(results["floor"])] if results.get("floor") else []),
        "",
        "| size | draft nodes | depth | median ms | relative to 1 token | floor ms | relative to the floor |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    floor = results.get("floor")
    for row in results["rows"]:
        floor_ms = rows_floor_ms(floor, row["size"]) if floor else None
        to_floor = f"{floor_ms:.1f} | {row['median_ms'] / floor_ms:.2f}x" if floor_ms else "- | -"
        lines.append(
            f"| {row['size']} | {row['draft_nodes']} | {row['max_depth']} | {row['median_ms']:.2f} | "
            f"{row['relative']:.2f}x | {to_floor} |"
        )
    profile = f"\n{profile_markdown(results['profile_ms'])}" if results.get("profile_ms") else ""
    return "\n".join(lines) + "\n" + profile


TREE_RESULTS = ("bench_tree.json", "bench_tree.md")


def is_tree_results(path: Path) -> bool:
    return (Path(path) / TREE_RESULTS[0]).is_file()


def tree_output_rules() -> OutputRules:
    """``bench-tree --out`` replaces only the results an earlier bench-tree wrote."""
    return OutputRules("results written by `draftsmith bench-tree`", is_tree_results, writes=TREE_RESULTS)


def write_tree_results(results: dict[str, Any], out: Path, overwrite: bool = False) -> None:
    """bench_tree.json and bench_tree.md, both or neither, replacing ``out`` as :func:`tree_output_rules` allow."""
    with atomic_directory(Path(out), overwrite, tree_output_rules()) as staging:
        atomic_write_json(staging / TREE_RESULTS[0], results)
        atomic_write_bytes(staging / TREE_RESULTS[1], tree_markdown(results).encode())

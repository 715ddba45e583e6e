"""What ``bench`` writes: ``results.json``, ``results.md`` (the table) and ``chart.png``, all or none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith.core.io import OutputRules, atomic_directory, atomic_write_bytes, atomic_write_json
from draftsmith.inference.measure.bench import BASELINE, RUNTIME_ALONE
from draftsmith.inference.measure.bench_resume import PROGRESS, read_progress


def markdown_table(results: dict[str, Any]) -> str:
    scopes = ["overall"] + sorted(s for s in results["methods"][BASELINE] if s != "overall")
    lines = [
        f"Greedy, max {results['max_new_tokens']} new tokens, {results.get('dtype', 'float32')} on "
        f"{results.get('device', 'cpu')}, {results['threads']} threads{_forward_note(results)}; "
        f"speedup = {BASELINE} time / method time on the same prompts.",
        "",
        "| method | scope | tau | speedup | tokens/s | after the prompt | identical |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    alone = results["methods"].get(RUNTIME_ALONE, {})
    for name, by_scope in results["methods"].items():
        for scope in scopes:
            s = by_scope.get(scope)
            if s:
                after = after_the_prompt(alone.get(scope), s)
                cells = [name, scope, f"{s['tau']:.2f}", f"{s['speedup']:.2f}x", f"{s['tokens_per_s']:.1f}"]
                cells.append("-" if after is None else f"{after:.2f}x")
                lines.append("| " + " | ".join(map(table_cell, cells)) + f" | {s['identical']}/{s['total']} |")
    lines += _prompt_share_lines(alone.get("overall"))
    lines += _label_lines(results)
    failed = {name: info["error"] for name, info in results.get("vllm", {}).items() if "error" in info}
    lines += [f"{name} did not run: {error}" for name, error in failed.items()]
    engines = {name: s["overall"] for name, s in results["methods"].items() if name.startswith("vllm")}
    if engines:
        lines += ["", "vLLM methods: tau = tokens / (speculative steps + 1 prefill); vLLM's own acceptance length:"]
        lines += [
            f"- {name}: {s['engine_acceptance_length']:.2f}"
            for name, s in engines.items()
            if "engine_acceptance_length" in s
        ]
    lines += _llamacpp_lines(results)
    return "\n".join(lines) + "\n"


def _llamacpp_lines(results: dict[str, Any]) -> list[str]:
    """The llama.cpp methods by llama.cpp's own timings and counters, against llama.cpp's plain decoding."""
    info = results.get("llamacpp")
    if not info:
        return []
    if "error" in info:
        return ["", f"llama.cpp methods did not run: {info['error']}"]
    lines = [
        "",
        f"llama.cpp methods on {info['model']} (its prompt token ids equal the runtime's on {info['prompt_ids_match']} "
        "prompts), by its own timings; identical above = equal to llama.cpp's plain decoding (llamacpp), its "
        "reference, as it rounds activations to 8 bits; tau above = tokens / (its verification forwards + the "
        "prompt's), as the runtime counts; tau here = its own, tokens per verification forward:",
        "",
        "| method | depth | tau | tokens/s after the prompt | tokens/s | prompt share | vs llamacpp after the prompt "
        "| vs llamacpp | agreement with the runtime |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, method in info.items():
        if not isinstance(method, dict):
            continue
        if "error" in method:
            lines.append(f"| {table_cell(name)} | did not run: {table_cell(method['error'])} |")
            continue
        overall = results["methods"][name]["overall"]
        cells = [
            name,
            str(method["depth"] or "-"),
            f"{overall.get('engine_acceptance_length', 1.0):.2f}",
            f"{method['tokens_per_s_after_prompt']:.1f}",
            f"{method['tokens_per_s']:.1f}",
            f"{method['prompt_share']:.0%}",
            _ratio(method.get("speedup_after_prompt_vs_llamacpp")),
            _ratio(method.get("speedup_vs_llamacpp")),
            f"{method['agreement_with_runtime']:.1%} ({method['identical_to_runtime']}/{overall['total']} identical)",
        ]
        lines.append("| " + " | ".join(map(table_cell, cells)) + " |")
    return lines


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def after_the_prompt(alone: dict[str, Any] | None, method: dict[str, Any]) -> float | None:
    """The runtime without a drafter's seconds after its prompts' forwards over ``method``'s after its own:
    the speedup of the part of decoding a drafter can shorten (None where either did not time its prompts)."""
    if not alone or "prompt_seconds" not in alone or "prompt_seconds" not in method:
        return None
    mine = method["seconds"] - method["prompt_seconds"]
    return (alone["seconds"] - alone["prompt_seconds"]) / mine if mine > 0 else None


def _prompt_share_lines(alone: dict[str, Any] | None) -> list[str]:
    """What share of the runtime's time its prompts' forwards took, which the speedup column includes."""
    if not alone or "prompt_seconds" not in alone or not alone["seconds"]:
        return []
    share = alone["prompt_seconds"] / alone["seconds"]
    return [
        "",
        f"After the prompt: the speedup over {RUNTIME_ALONE} of the decoding after each prompt's forward (prefill "
        f"and first token), which is what a drafter shortens; those forwards took {share:.0%} of {RUNTIME_ALONE}'s "
        "time here and bound every method's speedup over it.",
    ]


def table_cell(text: str) -> str:
    """``text`` as one markdown table cell: a ``|`` would split it into two cells and a line break end the
    row, so a question's category (or a method name) holding either would break the table."""
    return " ".join(str(text).replace("\\", "\\\\").replace("|", "\\|").splitlines())


def _forward_note(results: dict[str, Any]) -> str:
    """How the runtime's forwards ran, for the table's header."""
    notes = []
    if results.get("compiled"):
        notes.append(f"runtime forwards compiled ({results['compile_seconds']} s compiling, not counted)")
    if results.get("direct_forward"):
        notes.append("verification forwards direct (bitwise the model's, without its per-call machinery)")
    if results.get("native"):
        notes.append("decoder layers and contender search in C++ (bitwise the same)")
    head = results.get("greedy_head")
    if head:
        notes.append(
            f"greedy tokens through the screened int8 head, exact ({head['fallback_rows']} of {head['rows']} rows "
            "left to the float32 head by the proof)"
        )
    linear = results.get("linear")
    if linear:
        notes.append(linear_note(linear))
    speed = results.get("read_gb_per_s")
    if speed:
        notes.append(
            f"memory read at {speed['median']} GB/s (median of {speed['passes']} passes, before and after the "
            f"timed decodes; {speed['min']}-{speed['max']})"
        )
    return "".join(f"; {note}" for note in notes)


_ONE_PACK_NAMES = {"stream": "the runtime's C++ stream kernel", "onednn": "oneDNN's prepacked kernel"}
_ISA_NAMES = {"avx2": "AVX2", "avx512": "AVX-512"}  # the stream kernel's instruction sets (linear_record's isa)


def linear_note(linear: dict[str, Any]) -> str:
    """How the target's linears ran (``bench``'s and ``bench-tree``'s ``linear`` record)."""
    if linear["kernel"] in _ONE_PACK_NAMES:
        invariant = "bitwise row-invariant" if linear.get("row_invariant") else "NOT row-invariant on this machine"
        handover = linear.get("full_head_from")
        head = f"; greedy verification of {handover}+ rows through its float32 head" if handover else ""
        tiles = linear.get("screen_tiles_from")
        head += f"; the screen's sums of {tiles}+ rows on AMX tiles" if tiles else ""
        forms = linear.get("pack_forms")
        held = "; packs: " + ", ".join(f"{count} {form}" for form, count in forms.items()) if forms else ""
        packing = f", {linear['pack_seconds']} s packing, not counted"
        path = f" ({_ISA_NAMES.get(linear['isa'], linear['isa'])} path)" if linear.get("isa") else ""
        name = _ONE_PACK_NAMES[linear["kernel"]] + path
        return f"linears through {name}, every forward ({invariant}{head}{held}{packing})"
    if linear["kernel"] == "mkl":
        packing = f", {linear['pack_seconds']} s packing, not counted"
        return f"tree forwards through MKL packed GEMM (row buckets {linear.get('buckets')}{packing})"
    return "linears through PyTorch's default matrix multiply"


SHORT = 16  # characters a method name may have to stand in the chart's legend as it is


def chart_labels(names: list[str]) -> dict[str, str]:
    """A short label per method for the chart: a long name without its export path and options
    (``fspad=runs/x/fspad-drafter:depth=3`` -> ``fspad``), numbered where two would read the same."""
    short = {name: name if len(name) <= SHORT else name.partition("=")[0].partition(":")[0] for name in names}
    repeated = {label for label in short.values() if list(short.values()).count(label) > 1}
    counts: dict[str, int] = {}
    for name, label in short.items():
        if label in repeated:
            counts[label] = counts.get(label, 0) + 1
            short[name] = f"{label} #{counts[label]}"
    return short


def _label_lines(results: dict[str, Any]) -> list[str]:
    """The chart's short labels with the methods they stand for, where a label is not the whole name."""
    labels = chart_labels(list(results["methods"]))
    named = [f"- {label}: `{name}`" for name, label in labels.items() if label != name]
    return ["", "Chart labels:", *named] if named else []


def write_chart(results: dict[str, Any], path: Path) -> None:
    """tau and speedup per scope, a bar per method (short labels, legend beside the plots), with the
    runtime without a drafter as a dashed line per scope: the reference a drafter has to beat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = [n for n in methods if n not in (BASELINE, RUNTIME_ALONE)]
    labels = chart_labels(list(methods))
    scopes = ["overall"] + sorted(s for s in methods[BASELINE] if s != "overall")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(names))
    for axis, key, title in zip(
        axes, ("tau", "speedup"), ["tau (tokens per target forward)", f"speedup vs {BASELINE}"]
    ):
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(scopes))]
            axis.bar(xs, [methods[name][s][key] for s in scopes], width, label=labels[name])
        if RUNTIME_ALONE in methods:
            starts = [j - width / 2 for j in range(len(scopes))]
            axis.hlines(
                [methods[RUNTIME_ALONE][s][key] for s in scopes],
                starts,
                [start + width * max(1, len(names)) for start in starts],
                colors="black",
                linestyles="--",
                label="runtime without a drafter",
            )
        axis.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(scopes))], scopes, rotation=20)
        axis.set_title(title)
        axis.axhline(1.0, color="grey", linewidth=0.8)
    handles, legend_labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def is_bench_results(path: Path) -> bool:
    """Whether ``path`` holds what :func:`write_results` writes (a results.json with its methods), or an
    unfinished bench's progress file."""
    if read_progress(Path(path) / PROGRESS)[0] is not None:
        return True
    try:
        results = json.loads((Path(path) / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and "methods" in results


def bench_output_rules(keep: tuple[tuple[str, Path], ...] = ()) -> OutputRules:
    """``bench --out`` replaces only earlier bench results, never one of ``keep`` (its inputs)."""
    writes = ("results.json", "results.md", "chart.png", PROGRESS)
    return OutputRules("bench results written by `draftsmith bench`", is_bench_results, keep, writes)


def write_results(
    results: dict[str, Any], out: Path, overwrite: bool = False, rules: OutputRules | None = None
) -> None:
    """results.json, results.md and chart.png, all or none, replacing ``out`` as ``rules`` allow."""
    with atomic_directory(Path(out), overwrite, rules or bench_output_rules()) as staging:
        atomic_write_json(staging / "results.json", results)
        atomic_write_bytes(staging / "results.md", markdown_table(results).encode())
        write_chart(results, staging / "chart.png")

"""``draftsmith bench-tree``: the output contract (not the timings) and the trees it times."""

import json
import time

import pytest
import torch

from draftsmith.inference.measure.bench_tree import build_tree, parse_sizes
from draftsmith.inference.measure.errors import BenchError


def test_bench_tree_writes_json_and_markdown(tmp_path, tiny_target_dir, capsys):
    from draftsmith.cli import main

    out = tmp_path / "tree"
    args = ["bench-tree", "--target", str(tiny_target_dir), "--sizes", "4", "--prefix", "20", "--repeats", "3"]
    main([*args, "--threads", "1", "--out", str(out)])
    results = json.loads((out / "bench_tree.json").read_text())
    assert [row["size"] for row in results["rows"]] == [1, 4]  # the 1-token reference is always added
    assert results["prefix"] == 20 and results["repeats"] == 3 and results["shape"] == "random"
    for row in results["rows"]:
        assert len(row["all_ms"]) == 3 and row["median_ms"] > 0 and row["draft_nodes"] == row["size"] - 1
    assert results["rows"][0]["relative"] == 1.0
    table = (out / "bench_tree.md").read_text()
    assert table.count("\n| 1 |") == 1 and table.count("\n| 4 |") == 1
    assert "| size |" in capsys.readouterr().out
    floor = results["floor"]
    assert floor["read_gb_per_s"] > 0 and floor["floor_ms"] > 0 and "no step can take less than" in table
    assert results["linear"]["kernel"] in ("stream", "onednn", "mkl", "default")
    if results["linear"]["kernel"] == "stream":  # the instruction-set path that ran is named
        path = {"avx2": "AVX2", "avx512": "AVX-512"}[results["linear"]["isa"]]
        assert f"C++ stream kernel ({path} path)" in table


def test_the_component_profile_times_each_part_of_a_forward(tiny_target_dir):
    """Linears, attention and greedy head alone, and the whole forward, in one thread's CPU time; the table
    shows what the forward takes beyond its parts."""
    from draftsmith.core.target import load_target
    from draftsmith.inference.kernels.packed_gemm import linear_kernel_available
    from draftsmith.inference.measure.bench_tree import component_markdown, component_profile

    if not linear_kernel_available("stream"):
        pytest.skip("the stream kernel does not run here")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        spent = component_profile(load_target(str(tiny_target_dir)), [1, 4], prefix=20, repeats=2)
    finally:
        torch.set_num_threads(threads)
    assert list(spent) == [1, 4]
    for parts in spent.values():
        assert set(parts) == {"forward", "linears", "attention", "greedy head"} and all(ms > 0 for ms in parts.values())
    table = component_markdown(spent)
    assert "| linears |" in table and "| whole forward |" in table and "| 1 rows | 4 rows |" in table


def test_profile_names_the_kernels_that_take_each_sizes_time(tmp_path, tiny_target_dir, capsys):
    from draftsmith.cli import main

    out = tmp_path / "tree"
    args = ["bench-tree", "--target", str(tiny_target_dir), "--sizes", "4", "--prefix", "20", "--repeats", "1"]
    main([*args, "--threads", "1", "--profile", "--out", str(out)])
    spent = json.loads((out / "bench_tree.json").read_text())["profile_ms"]
    assert list(spent) == ["1", "4"]
    for ops in spent.values():
        assert all(ms > 0 for ms in ops.values()) and "(outside operators)" in ops
        # the tiny target runs the C++ layers, whose products and attention record themselves
        assert "draftsmith::decoder_layers" in ops and "draftsmith::attend" in ops
    table = (out / "bench_tree.md").read_text()
    assert "Where a forward's milliseconds go" in table and "| `draftsmith::decoder_layers` |" in table
    assert "Where a forward's milliseconds go" in capsys.readouterr().out


def test_a_step_reads_the_decoder_once_and_the_head_as_the_runtime_reads_it():
    from conftest import tiny_llama
    from draftsmith.inference.kernels.greedy_head import GreedyHead
    from draftsmith.inference.measure.floor import step_weight_bytes

    model = tiny_llama(97, seed=0)
    hidden = model.config.hidden_size
    head = model.lm_head.weight
    decoder = sum(p.numel() * 4 for name, p in model.model.named_parameters() if "embed_tokens" not in name)
    fp32_head = head.numel() * 4
    assert step_weight_bytes(model, None) == decoder + fp32_head + hidden * 4
    screened = GreedyHead(model.lm_head)
    screen_bytes = screened.quantized.numel() + screened.scales.numel() * 2
    assert step_weight_bytes(model, screened) == decoder + screen_bytes + hidden * 4


def test_a_wide_forwards_floor_is_its_multiply_adds_where_they_outweigh_the_reading():
    from conftest import tiny_llama
    from draftsmith.inference.measure.floor import linear_multiply_adds, rows_floor_ms, step_floor

    model = tiny_llama(97, seed=0)
    layers = model.model.layers
    assert linear_multiply_adds(model) == sum(p.numel() for n, p in layers.named_parameters() if "proj" in n)
    floor = step_floor(model, None)
    assert floor["multiply_adds_per_s"] > 1e8  # any CPU that runs the tests multiplies faster than that
    rows_at_par = floor["floor_ms"] / (1e3 * floor["row_multiply_adds"] / floor["multiply_adds_per_s"])
    below, above = max(1, int(rows_at_par) // 2), int(rows_at_par) * 2 + 2
    assert rows_floor_ms(floor, below) == floor["floor_ms"]  # reading bounds a narrow forward
    assert rows_floor_ms(floor, above) == pytest.approx(
        1e3 * above * floor["row_multiply_adds"] / floor["multiply_adds_per_s"]
    )
    assert rows_floor_ms(floor, above) > floor["floor_ms"]
    assert rows_floor_ms({"floor_ms": 5.0}, 64) == 5.0  # a results file from before the multiply-adds were kept


def test_tree_shapes_and_sizes():
    chain = build_tree(5, "chain")
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3] and int(chain.depths().max()) == 5
    tree = build_tree(31, "random", seed=0)
    assert len(tree) == 31 and tree.parents.tolist() == build_tree(31, "random", seed=0).parents.tolist()
    assert int(tree.depths().max()) < 31 and len(tree.children(-1)) > 1  # bushy, not a chain
    assert len(build_tree(0, "random")) == 0
    assert parse_sizes("8, 4,4") == [1, 4, 8]
    with pytest.raises(BenchError, match="comma-separated whole numbers"):
        parse_sizes("4,x")
    with pytest.raises(BenchError, match="positive"):
        parse_sizes("0,4")


def test_too_long_a_prefix_is_a_clear_error(tiny_target_dir, capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench-tree", "--target", str(tiny_target_dir), "--sizes", "64", "--prefix", "500", "--repeats", "1"])
    assert exit_info.value.code == 2
    assert "exceeds the target's 512 positions" in capsys.readouterr().err


def test_a_step_reads_the_stream_packs_as_they_hold_the_weights():
    """Where the stream kernel packs a linear's weights as 4-bit codes, the floor counts the codes' bytes."""
    from conftest import tiny_llama
    from draftsmith.inference.kernels.packed_gemm import PackedGemm, linear_kernel_available
    from draftsmith.inference.measure.floor import step_weight_bytes
    from helpers import q4_1_dequantised

    if not linear_kernel_available("stream"):
        pytest.skip("the stream kernel does not run here")
    model = tiny_llama(97, seed=0)
    linears = [module for module in model.model.layers.modules() if isinstance(module, torch.nn.Linear)]
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(q4_1_dequantised(linear.weight))
    unpacked = step_weight_bytes(model, None)
    PackedGemm(model, "stream").padded_rows(1)
    saved = sum(linear.weight.numel() * 4 - linear.weight.numel() * 3 // 4 for linear in linears)
    assert step_weight_bytes(model, None) == unpacked - saved
    assert step_weight_bytes(model, None, as_packed=False) == unpacked


def test_each_timed_forward_follows_untimed_ones_of_its_own_size(monkeypatch):
    """A forward right after one of another size runs slower for a while: the timed one comes after
    untimed forwards of the same tree for SETTLE_SECONDS (at least one), and only it is returned."""
    from draftsmith.inference.measure import bench_tree

    calls = []

    class Forward:
        def seconds(self, tree):
            calls.append(tree)
            time.sleep(0.004)
            return 0.5 if len(calls) > 1 else 9.0

    monkeypatch.setattr(bench_tree, "SETTLE_SECONDS", 0.02)
    assert bench_tree.settled_seconds(Forward(), "tree") == 0.5
    assert len(calls) >= 6 and set(calls) == {"tree"}


def test_the_forwards_verify_natural_text():
    """bench-tree's prefix and tree tokens come from the bundled conversations (random ids make rows with
    flat logits, whose proof no decode pays for), the same for a seed, another text for another seed."""
    from draftsmith.data.cli import default_dataset_path
    from draftsmith.inference.measure.bench_tree import text_ids

    class WordLengths:  # a stand-in tokenizer: one id per word, its length
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(word) for word in text.split()]}

    ids = text_ids(WordLengths(), 500)
    assert len(ids) == 500 and ids == text_ids(WordLengths(), 500)
    assert ids != text_ids(WordLengths(), 500, seed=1)
    first = json.loads(default_dataset_path().read_text(encoding="utf-8").splitlines()[0])
    assert ids[:8] == [len(word) for word in first["conversations"][0]["value"].split()][:8]

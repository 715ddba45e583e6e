"""The drafter pipeline at GPU scale, in one command that fits a time budget.

    python cli/gpu_pipeline.py --out gpu-results --regen-minutes 60 --train-minutes 120

1. regenerate (``--shards``): ShareGPT shards answered by the target on the GPU (`draftsmith data
   regenerate`, vLLM when this python has it, else transformers), each shard resumable, stopped at
   --regen-minutes;
2. prepare: those shards plus the bundled self-distilled data, tokenised (`draftsmith data prepare`);
3. train: the recipe's drafter with the target computing its features online (no feature cache on
   disk), for as many optimizer steps as fit --train-minutes (timed on a short calibration run
   first, so the learning-rate schedule ends where the budget does), then exported;
4. bench: the export against plain decoding on held-out prompts, in float32 and in bfloat16;
5. scaling (``--scaling-samples``): the same recipe for the same steps on nested subsets of the
   prepared data (``data.train_samples``), then ``draftsmith curves`` of them beside the full run.

Everything lands in --out: the regenerated shards with their .meta.json, the export, the bench
tables, every command's log (log.txt) and summary.json (each stage's command, seconds and outcome),
so the folder alone says what was run. A stage that fails is recorded and the later stages that do
not need it still run. Rerunning with the same --out resumes the regeneration and skips a finished
training run. ``--device cpu`` with a tiny ``--target`` runs the same stages in seconds
(tests/test_gpu_pipeline.py).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUNDLED_DATA = ("data/sharegpt_smollm2",)  # every shard of the bundled sharegpt-smollm2
CALIBRATION_STEPS = (10, 30)  # the optimizer steps timed between, after the start-up's slow first steps
# The calibration run logs as often as the real one would: a log row costs a device sync and the
# simulated acceptance, so logging every step made a GPU step look 1.6x slower than it was.
CALIBRATION_LOG_EVERY = 10
DRAFTSMITH = [
    sys.executable,
    "-c",
    "import sys; from draftsmith.cli import main; sys.argv[0] = 'draftsmith'; main()",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, type=Path, help="results folder (resumed when it exists)")
    p.add_argument("--target", default="smollm2", help="the target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    _add_regeneration_arguments(p)
    _add_training_arguments(p)
    _add_bench_arguments(p)
    p.add_argument(
        "--scaling-samples",
        type=sample_counts,
        default=[],
        help="e.g. 1700,5000: after the main run, train as many steps on nested subsets of that many samples "
        "(each costs about --train-minutes) and plot them beside it into OUT/scaling (needs --set "
        "data.eval_samples=N)",
    )
    p.add_argument("--skip", default="", help="stages not to run, e.g. regenerate,bench")
    return p.parse_args(argv)


def _add_regeneration_arguments(p: argparse.ArgumentParser) -> None:
    """Stage 1: which shards the target answers, how many at once, and for how long."""
    p.add_argument("--source", default="sharegpt", help="the prompts regenerated (default: the ShareGPT V3 file)")
    p.add_argument(
        "--shards",
        default="",
        help="which shards of --n-shards to regenerate, in order, e.g. 0,1,2 (default: none, since the bundled "
        "sharegpt-smollm2 holds all 8 for SmolLM2; another --target needs its own, with --extra-data left empty)",
    )
    p.add_argument("--n-shards", type=int, default=8, help="as `data regenerate --shard I/N` (default 8)")
    p.add_argument("--regen-minutes", type=float, default=30.0, help="regeneration stops starting new windows then")
    p.add_argument("--regen-limit", type=int, default=None, help="records per shard (default: the whole shard)")
    p.add_argument("--regen-batch-size", type=int, default=256, help="conversations per generate call")
    p.add_argument(
        "--regen-parallel",
        type=int,
        default=4,
        help="shards regenerated at once, one process each (transformers' generate leaves a GPU idle while "
        "Python launches its kernels; see docs/gpu.md for what was measured)",
    )
    p.add_argument(
        "--regen-batch-tokens",
        type=int,
        default=1 << 18,
        help="each process splits a batch while it pads to more tokens than this (long prompts' prefill "
        "holds an attention matrix per row)",
    )
    p.add_argument(
        "--regen-static-cache",
        action="store_true",
        help="transformers regenerates with a static KV cache (`data regenerate --static-cache`; on a GPU "
        "transformers then compiles the step per batch shape: its speed there is not measured yet)",
    )
    p.add_argument(
        "--regen-window-batches",
        type=int,
        default=None,
        help="batches per window of each process (`data regenerate --window-batches`, whose default it keeps when "
        "not given): a window is written when its last turns are done, so one cut off by the end of a lease is "
        "lost; fewer batches lose less",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per regenerated answer")
    p.add_argument("--max-turns", type=int, default=2, help="user turns answered per conversation")
    p.add_argument("--regen-dtype", default="float32", help="dtype the target regenerates in (default float32)")


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Stages 2 and 3: the data trained on beside the shards, the recipe, and the training budget."""
    p.add_argument(
        "--extra-data",
        nargs="*",
        default=list(BUNDLED_DATA),
        help="ShareGPT JSONL(.gz) files or folders of them trained on beside the regenerated shards (default: the "
        "bundled sharegpt-smollm2; samples equal to a regenerated one are prepared once)",
    )
    p.add_argument("--recipe", default=str(REPO / "recipes/eagle3-smollm2.yaml"), help="the training recipe")
    p.add_argument("--train-minutes", type=float, default=60.0, help="time for the training run itself")
    p.add_argument("--train-steps", type=int, default=None, help="optimizer steps (default: what fits the minutes)")
    p.add_argument("--train-batch-size", type=int, default=32, help="samples per optimizer step")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override, e.g. --set train.lr=3e-4 (repeatable)",
    )


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Stage 4: the prompts and dtypes the export is benched on."""
    p.add_argument("--bench-questions", default=None, help="Spec-Bench JSONL (default: held-out default prompts)")
    p.add_argument("--bench-max-new-tokens", type=int, default=64)
    p.add_argument("--bench-dtypes", default="float32,bfloat16", help="dtypes the export is benched in")


def sample_counts(text: str) -> list[int]:
    """``1700,5000`` -> [1700, 5000]: refused when the command is parsed, not after the main run."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"takes comma-separated sample counts >= 1, e.g. 1700,5000; got {text!r}")
    return counts


class Pipeline:
    """Runs the stages as `draftsmith` commands, logging each and recording it in summary.json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = self.out / "work"  # what is not a result: prepared data, the training run
        self.log = self.out / "log.txt"
        self.summary_path = self.out / "summary.json"
        earlier = json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
        self.summary: dict[str, Any] = {"argv": sys.argv[1:], "stages": {}, "earlier": earlier}
        self.lock = threading.Lock()  # shards regenerate in threads

    def record(self, stage: str, **fields: Any) -> None:
        with self.lock:
            self.summary["stages"].setdefault(stage, {}).update(fields)
            staging = self.summary_path.with_suffix(".json.tmp")
            staging.write_text(json.dumps(self.summary, indent=2) + "\n")
            staging.replace(self.summary_path)

    def draftsmith(self, stage: str, argv: list[str], log: Path | None = None) -> bool:
        """One `draftsmith` command, its output appended to ``log`` (default log.txt); True when it succeeded."""
        command = "draftsmith " + " ".join(argv)
        start = time.monotonic()
        with open(log or self.log, "a") as log:
            log.write(f"\n$ {command}\n")
            log.flush()
            code = subprocess.run(DRAFTSMITH + argv, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = round(time.monotonic() - start, 1)
        with self.lock:
            self.summary["stages"].setdefault(stage, {}).setdefault("commands", []).append(
                {"command": command, "seconds": seconds, "exit": code}
            )
        self.record(stage)
        print(f"[{stage}] {command}: exit {code} after {seconds} s", flush=True)
        return code == 0

    # 1. regenerate
    def shard_path(self, shard: int) -> Path:
        return self.out / "data" / f"shard-{shard}-of-{self.args.n_shards}.jsonl"

    def regenerate(self) -> None:
        deadline = time.monotonic() + self.args.regen_minutes * 60
        shards = [int(s) for s in self.args.shards.split(",") if s]
        with ThreadPoolExecutor(max_workers=max(1, self.args.regen_parallel)) as pool:
            list(pool.map(lambda shard: self.regenerate_shard(shard, deadline), shards))
        self.record("regenerate", conversations={p.name: count_lines(p) for p in self.regenerated()})

    def regenerate_shard(self, shard: int, deadline: float) -> None:
        args = self.args
        minutes_left = (deadline - time.monotonic()) / 60
        if minutes_left <= 0:
            return
        path = self.shard_path(shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["data", "regenerate", args.source, "--out", str(path), "--shard", f"{shard}/{args.n_shards}"]
        argv += ["--target", args.target, "--device", args.device, "--dtype", args.regen_dtype]
        engine = regeneration_engine()
        argv += ["--engine", engine, "--batch-size", str(args.regen_batch_size)]
        argv += ["--window-batches", str(args.regen_window_batches)] if args.regen_window_batches is not None else []
        if engine == "transformers":
            argv += ["--batch-tokens", str(args.regen_batch_tokens)]
            argv += ["--static-cache"] if args.regen_static_cache else []
        argv += ["--max-new-tokens", str(args.max_new_tokens), "--max-turns", str(args.max_turns)]
        argv += ["--time-limit", f"{minutes_left:.2f}"]
        argv += ["--limit", str(args.regen_limit)] if args.regen_limit else []
        self.draftsmith("regenerate", argv, log=path.with_suffix(".log"))

    def regenerated(self) -> list[Path]:
        return sorted((self.out / "data").glob("shard-*.jsonl"))

    # 2. prepare
    def prepare(self) -> bool:
        self.work.mkdir(exist_ok=True)
        mixed = self.work / "train.jsonl"
        sources = [
            *self.regenerated(),
            *(REPO / p if not Path(p).is_absolute() else Path(p) for p in self.args.extra_data),
        ]
        records = concatenate(sources, mixed)
        self.record("prepare", sources=[str(p) for p in sources], records=records)
        prepared = self.work / "prepared"
        return self.draftsmith(
            "prepare",
            ["data", "prepare", str(mixed), "--out", str(prepared), "--target", self.args.target, "--overwrite"],
        )

    # 3. train
    def recipe_overrides(self, output_dir: Path, steps: int, save_every: int) -> list[str]:
        on_gpu = self.args.device.startswith("cuda")
        return [
            f"output_dir={output_dir}",
            f"target.name={self.args.target}",
            f"data.prepared={self.work / 'prepared'}",
            "data.features=null",  # online: the target on the GPU is cheaper than a feature cache on disk
            f"train.batch_size={self.args.train_batch_size}",
            f"train.max_steps={steps}",
            f"train.warmup_steps={max(1, min(100, steps // 20))}",
            f"train.save_every={save_every}",
            f"train.mixed_precision={'bf16' if on_gpu else 'no'}",
            "tracking.wandb=false",
            *self.args.overrides,
        ]

    def calibrate(self) -> int:
        """Optimizer steps that fit --train-minutes, from a short run's seconds per step."""
        run = self.work / "calibration"
        shutil.rmtree(run, ignore_errors=True)
        steps = CALIBRATION_STEPS[1]
        argv = [
            "train",
            self.args.recipe,
            *self.recipe_overrides(run, steps, save_every=steps),
            f"train.log_every={CALIBRATION_LOG_EVERY}",
        ]
        seconds_per_step = time_steps(DRAFTSMITH + argv, run / "metrics.jsonl", self.log)
        steps = max(1, int(self.args.train_minutes * 60 / seconds_per_step))
        self.record("train", seconds_per_step=round(seconds_per_step, 4), steps_planned=steps)
        return steps

    def train(self) -> bool:
        run, export = self.work / "run", self.out / "drafter"
        resuming = any(run.glob("checkpoints/step-*"))
        try:
            # a resumed run keeps the schedule it started with
            steps = self.args.train_steps or (self.planned_steps() if resuming else self.calibrate())
        except RuntimeError as exc:
            self.record("train", error=str(exc))
            return False
        argv = ["train", self.args.recipe, *self.recipe_overrides(run, steps, save_every=max(1, min(500, steps // 10)))]
        # past the budget the sitting ends with a checkpoint, which is exported (a rerun resumes it)
        argv.append(f"train.max_minutes={self.args.train_minutes * 1.2:g}")
        if resuming:  # the regeneration may have answered more conversations since: go on with all of them
            argv += ["--resume", "--resume-new-data"]
        self.draftsmith("train", argv)
        return self.draftsmith("train", ["export", str(run), "--out", str(export), "--overwrite"])

    def planned_steps(self) -> int:
        summary = self.summary
        while summary:
            if steps := summary.get("stages", {}).get("train", {}).get("steps_planned"):
                self.record("train", steps_planned=steps)
                return int(steps)
            summary = summary.get("earlier")
        raise RuntimeError(
            f"{self.work / 'run'} holds checkpoints but summary.json no planned steps; pass --train-steps"
        )

    # 5. scaling
    def scaling(self) -> None:
        """The main run's recipe and steps on each nested subset, then the curves of all of them."""
        steps = self.args.train_steps or self.planned_steps()
        runs = []
        for samples in self.args.scaling_samples:
            run = self.work / f"scale-{samples}"
            argv = [
                "train",
                self.args.recipe,
                *self.recipe_overrides(run, steps, save_every=max(1, min(500, steps // 10))),
            ]
            argv += [f"data.train_samples={samples}"] + (["--resume"] if any(run.glob("checkpoints/step-*")) else [])
            if self.draftsmith("scaling", argv):
                runs.append(run)
        runs.append(self.work / "run")
        self.draftsmith("scaling", ["curves", *map(str, runs), "--out", str(self.out / "scaling"), "--overwrite"])

    # 4. bench
    def bench(self) -> None:
        args, export = self.args, self.out / "drafter"
        questions = args.bench_questions or str(self.write_held_out_questions())
        family = json.loads((export / "config.json").read_text())["drafter_family"]
        for dtype in args.bench_dtypes.split(","):
            argv = ["bench", "--questions", questions, "--methods", f"{family}={export}", "--target", args.target]
            argv += ["--device", args.device, "--dtype", dtype, "--max-new-tokens", str(args.bench_max_new_tokens)]
            argv += ["--out", str(self.out / f"bench-{dtype}"), "--overwrite"]
            self.draftsmith("bench", argv)

    def write_held_out_questions(self) -> Path:
        from draftsmith.data.default_prompts import held_out_questions

        path = self.work / "questions.jsonl"
        path.write_text("".join(json.dumps(q) + "\n" for q in held_out_questions(2)))
        return path

    def run(self) -> None:
        skip = set(self.args.skip.split(","))
        if "regenerate" not in skip:
            self.regenerate()
        trained = "train" not in skip and self.prepare() and self.train()
        if "bench" not in skip and (trained or (self.out / "drafter/config.json").exists()):
            self.bench()
        if self.args.scaling_samples and "scaling" not in skip and (self.work / "run").is_dir():
            self.scaling()
        print(f"results in {self.out} (summary.json, log.txt)")


def regeneration_engine() -> str:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "transformers"
    return "vllm"


def count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def concatenate(sources: list[Path], out: Path) -> int:
    """ShareGPT JSONL(.gz) files (a folder: its shards, as `data prepare` reads one) into one JSONL; returns
    its records."""
    from draftsmith.data.formats import shard_files

    records = 0
    with open(out, "w", encoding="utf-8") as sink:
        for source in [shard for path in sources for shard in (shard_files(path) if path.is_dir() else [path])]:
            opener = gzip.open if source.suffix == ".gz" else open
            with opener(source, "rt", encoding="utf-8") as handle:
                for line in handle:
                    if line.strip():
                        sink.write(line if line.endswith("\n") else line + "\n")
                        records += 1
    return records


def time_steps(command: list[str], metrics: Path, log: Path) -> float:
    """Seconds per optimizer step of a training run: the time between its metrics.jsonl rows for the
    steps of CALIBRATION_STEPS as they appear (start-up and the first steps excluded)."""
    first, last = CALIBRATION_STEPS
    seen: dict[int, float] = {}
    with open(log, "a") as handle:
        handle.write(f"\n$ (calibration) {' '.join(command[3:])}\n")
        handle.flush()
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
        while True:
            step = last_logged_step(metrics)
            for mark in (first, last):
                if step >= mark and mark not in seen:
                    seen[mark] = time.monotonic()
            if process.poll() is not None or last in seen:
                break
            time.sleep(0.05)
        process.wait()
    if process.returncode != 0 or len(seen) < 2:
        raise RuntimeError(f"the calibration run failed (exit {process.returncode}); see {log}")
    return (seen[last] - seen[first]) / (last - first)


def last_logged_step(metrics: Path) -> int:
    """The step of the last complete row of a metrics.jsonl (0 before the first)."""
    if not metrics.exists():
        return 0
    lines = metrics.read_text(encoding="utf-8").split("\n")[:-1]  # the text after the last newline is unfinished
    return int(json.loads(lines[-1])["step"]) if lines else 0


def main(argv: list[str] | None = None) -> None:
    pipeline = Pipeline(parse_args(argv))
    pipeline.run()


if __name__ == "__main__":
    main()

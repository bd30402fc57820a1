"""Whole decode steps under two builds of Ember's CUDA kernels, side by side in one process (for kernel work).

An arm is a set of kernel sources: decode attention, the int4 GEMV and the int8 GEMV (the modules' `SOURCE`,
read at each launch). The baseline arm takes them from a git revision (`--baseline`, default HEAD); the
candidate arm from the working tree, or from the files given (`--attention`, `--int4`, `--int8`). Both arms
decode one random-weight model (Llama-3-8B shape unless `--shape`), each through a Generator of its own,
whose decode graph is captured with its arm's kernels; the timed runs alternate between the arms, so slow
drifts of the machine fall on both. The GEMV tuner picks block shapes once per shape and arm. `--set
MODULE.NAME=VALUE` sets a module constant for the candidate arm only (say, offering the tuner fewer block
shapes: `--set ember.quant.cuda_int4.LEAN_OFFERED=False`); `--arm NAME MODULE.NAME=VALUE...` adds an arm of
the working tree's kernels with those constants, against the same baseline in the same run (one model build
for several candidates). Steps are timed as `ember bench` times them
(128-token prompt, 256 tokens, compiled); the table gives each arm's median step, the change, whether the
arms gave the same greedy tokens (a kernel that rounds differently may not), and whether the tuner picked
the same block shapes in both (if not, the GEMVs add in other orders, and the tokens of a random-weight model
may part for that alone; the keys whose picks differ are listed). An arm with no constants (`--arm again`)
is the working tree's kernels (the baseline's, when they are HEAD's) tuned once more: how far the tuner's
picks alone move a whole step (~3% for int4 on an H100). `--share-picks` pins every arm's GEMVs to the
baseline's picks where those are among the arm's candidates, so that the arms differ in their kernels only
(not for arms that change the tuner itself).

    python benchmarks/gpu_step_ab.py --configs int4 int8                    # working tree against HEAD
    python benchmarks/gpu_step_ab.py --baseline HEAD~1 --configs int4       # what the last commit changed
    python benchmarks/gpu_step_ab.py --attention /tmp/candidate.cu          # one candidate file
    python benchmarks/gpu_step_ab.py --set ember.quant.cuda_int4.LEAN_OFFERED=False --configs int4
    python benchmarks/gpu_step_ab.py --arm fold ember.quant.cuda_int4.FOLD_NORMS=True \
        --arm hold ember.quant.tuning.PRECEDED_NS=3000 --configs int4 int8   # two flags, one baseline
    python benchmarks/gpu_step_ab.py --arm again --configs int4             # the tuner's own spread
    python benchmarks/gpu_step_ab.py --share-picks --int4 /tmp/candidate.cu --configs int4   # kernels only

Both arms launch through the working tree's Python, so a baseline's kernels must take its template arguments
(the int4 GEMV's gained ASYNC at 964d4f7: older revisions cannot stand in for it), and include
`ember_cuda.cuh` as it is in the working tree.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

KERNELS = {  # arm key: (module holding SOURCE, the file in the repository)
    "attention": ("ember.ops.cuda_attention", "src/ember/ops/csrc/decode_attention.cu"),
    "int4": ("ember.quant.cuda_int4", "src/ember/quant/csrc/int4_gemv.cu"),
    "int8": ("ember.quant.cuda_gemv", "src/ember/quant/csrc/int8_gemv.cu"),
}


def sources_at(rev: str, into: Path) -> dict[str, Path]:
    """Each kernel's source as it is at git revision `rev`, written under `into`; or, where `rev` is a folder,
    the files in it named as the repository names them (for a copy of the tree without its git history)."""
    if Path(rev).is_dir():
        return {key: Path(rev) / Path(path).name for key, (_, path) in KERNELS.items()}
    out = {}
    for key, (_, path) in KERNELS.items():
        text = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        out[key] = into / f"{key}-{rev.replace('/', '_')}.cu"
        out[key].write_text(text)
    return out


class Arm:
    """An arm's kernel sources, module constants and GEMV tuner picks, made current by `use`."""

    def __init__(self, sources: dict[str, Path], settings: dict[str, object]) -> None:
        self.sources, self.settings, self.picks = sources, settings, {}
        self.share: Arm | None = None  # --share-picks: the arm whose picks this one takes where it can

    def use(self) -> None:
        from ember.quant import tuning

        for key, (module, _) in KERNELS.items():  # a new path is built on first use
            importlib.import_module(module).SOURCE = self.sources[key]
        for name, value in self.settings.items():
            module, _, attr = name.rpartition(".")
            setattr(importlib.import_module(module), attr, value)
        tuning._picked = self.picks
        if (
            self.share is not None
        ):  # pinned: taken where they are among this arm's candidates (own pins first)
            tuning.PINNED = {**{key[:-1]: v for key, v in self.share.picks.items()}, **tuning.PINNED}


def parse_settings(pairs: list[str]) -> tuple[dict[str, object], dict[str, object]]:
    """--set MODULE.NAME=VALUE pairs -> (the candidate's values, the baseline's: the constants as they are)."""
    candidate, baseline = {}, {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        module, _, attr = name.rpartition(".")
        if not eq or not module:
            raise SystemExit(f"--set {pair!r}: expected MODULE.NAME=VALUE")
        candidate[name] = ast.literal_eval(value)
        baseline[name] = getattr(importlib.import_module(module), attr)
    return candidate, baseline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=["int4", "int8"], help="bf16, int8, int4, int4-gN")
    ap.add_argument("--shape", default="llama-3-8b", help="a random-weight shape of `ember bench`")
    ap.add_argument(
        "--baseline",
        default="HEAD",
        help="git revision of the baseline arm's kernels, or a folder holding them",
    )
    for key in KERNELS:
        ap.add_argument(
            f"--{key}", type=Path, help=f"the candidate's {key} kernel (default: the working tree's)"
        )
    ap.add_argument("--set", action="append", default=[], help="MODULE.NAME=VALUE for the candidate arm")
    ap.add_argument(
        "--arm",
        nargs="+",
        action="append",
        default=[],
        metavar="NAME [MODULE.NAME=VALUE]",
        help="one more arm: the working tree's kernels with these constants",
    )
    ap.add_argument("--runs", type=int, default=7, help="timed runs an arm (after 2 warm-ups)")
    ap.add_argument(
        "--share-picks",
        action="store_true",
        help="every arm takes the baseline's block shapes where they are among its candidates",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_ab.py needs a CUDA GPU")

    from ember.bench import random_model
    from ember.engine.generate import Generator
    from ember.engine.sampler import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="ember-ab-"))
    settings, originals = parse_settings(args.set)
    working = {key: getattr(args, key) or ROOT / path for key, (_, path) in KERNELS.items()}
    arms = {"baseline": Arm(sources_at(args.baseline, tmp), originals)}
    if args.set or any(getattr(args, key) for key in KERNELS) or not args.arm:
        arms["candidate"] = Arm(working, settings)
    for name, *pairs in args.arm:
        if name in arms:
            raise SystemExit(f"--arm {name!r}: an arm of that name is already there")
        extra_settings, extra_originals = parse_settings(pairs)
        arms[name] = Arm(working, extra_settings)
        for key, value in extra_originals.items():  # the baseline sets back whatever an arm changes
            arms["baseline"].settings.setdefault(key, value)
    if args.share_picks:  # each arm's `use` sets PINNED afresh
        from ember.quant import tuning

        arms["baseline"].settings.setdefault("ember.quant.tuning.PINNED", tuning.PINNED)
        for arm in list(arms.values())[1:]:
            arm.share = arms["baseline"]
    for arm in arms.values():  # every arm sets every constant any arm changes (the others' as they were)
        for key, value in arms["baseline"].settings.items():
            arm.settings.setdefault(key, value)
    dev = torch.device("cuda")
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    extra = "".join(f"; the candidate sets {pair}" for pair in args.set)
    extra += "".join(f"; arm {name} sets {', '.join(pairs)}" for name, *pairs in args.arm)
    print(
        f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; baseline {args.baseline}{extra}",
        flush=True,
    )
    rows = []
    for config in args.configs:
        quantize = None if config == "bf16" else config
        model = random_model(args.shape, device=dev, dtype=torch.bfloat16, quantize=quantize)
        prompt = torch.randint(0, model.config.vocab_size, (128,), generator=torch.Generator().manual_seed(0))
        prompt = prompt.tolist()
        gens, tokens, steps = {}, {}, {arm: [] for arm in arms}
        for arm in arms:
            arms[arm].use()
            gens[arm] = Generator(model, device=dev, context=384, compile=True)
            for _ in range(2):  # the first captures the decode graph with this arm's kernels
                tokens[arm] = [s.token_id for s in gens[arm].generate(prompt, params, (), None)]
            if arms[arm].share is not None:  # the shared picks, as if tuned: only the arm's own ones differ
                own = arms[arm].settings.get("ember.quant.tuning.PINNED") or {}
                for key, value in arms[arm].share.picks.items():
                    arms[arm].picks.setdefault(key, own.get(key[:-1], value))
        for r in range(args.runs):
            for arm in list(arms)[:: 1 if r % 2 else -1]:
                arms[arm].use()  # the prefill runs outside the graph
                for _ in gens[arm].generate(prompt, params, (), None):
                    pass
                t = gens[arm].timings
                steps[arm].append(1e6 * t.decode_s / t.decode_steps)
        base = statistics.median(steps["baseline"])
        for arm in list(arms)[1:]:
            same_picks = arms["baseline"].picks == arms[arm].picks
            same = tokens["baseline"] == tokens[arm]
            rows.append((config, arm, base, statistics.median(steps[arm]), same, same_picks))
        print(
            f"{config}: " + ", ".join(f"{arm} {sorted(round(s, 1) for s in steps[arm])}" for arm in arms),
            flush=True,
        )
        for arm in list(arms)[1:]:  # where an arm's tuner picked otherwise (a pinned key shows as None)
            base_picks, picks = arms["baseline"].picks, arms[arm].picks
            for key in sorted({*base_picks, *picks}, key=str):
                if base_picks.get(key) != picks.get(key):
                    print(f"  {arm} picks {key[:-1]}: {base_picks.get(key)} -> {picks.get(key)}", flush=True)
        del gens, model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    print(f"\n| {args.shape} | arm | baseline step | arm's step | change | same tokens | same picks |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    yes = {True: "yes", False: "no"}
    for config, arm, base, cand, same, picks in rows:
        change = 100 * (cand / base - 1)
        print(
            f"| {config} | {arm} | {base:.1f} us | {cand:.1f} us | {change:+.2f}% | {yes[same]} | {yes[picks]} |"
        )


if __name__ == "__main__":
    main()

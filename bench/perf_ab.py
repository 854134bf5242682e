"""A/B of tuning options in `dsgraph bench`: every arm in this same tree, round by round (a script,
not a test).

    python3 -m bench.perf_ab --arm base \
        --arm 'wide:--tune moe.expert_ffn_upto=128' \
        --arm 'both:--tune moe.expert_ffn_upto=128 --tune attention.decode_cluster=4' \
        [--decode 1x512,8x512,256x512] [--prefill 32x512] [--rounds 2]
        [--check '-j 8 tests/gpu/test_kernels_moe.py -k route'] [--out DIR]

An arm is `NAME` (the default options) or `NAME:OPTIONS`, OPTIONS being `dsgraph bench` options
(shell quoting), chiefly `--tune SECTION.KNOB=VALUE`, repeatable; an --arm of a name given before
adds its options to that arm.  Every arm runs `dsgraph bench` from this tree with one kernel cache:
the cache key covers the options, tuning included, so arms never share a kernel they should not and
nothing is copied or edited.  --check runs tests/gpu/run_isolated.py with those arguments once,
before any bench: a wrong kernel is not timed.  The benches run round by round (every arm once,
then again), so a drift of the machine falls on every arm alike; the table prints each case's step
time and the expert kernels' read rate for every arm, all rounds side by side (--prefill: each prefill
case's tokens a second too; none by default).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from codegen.paths import REPO_ROOT

# what perf_ab sets itself for every arm (an arm that set them would not be timed as the others)
OWN_OPTIONS = ("--decode", "--prefill", "--json", "--no-transformers")
_TUNE_RE = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*=\S+$")


@dataclass
class Arm:
    name: str
    options: list[str] = field(default_factory=list)      # `dsgraph bench` arguments


def _check_options(name: str, options: list[str]) -> None:
    """Refuse what cannot be a bench option of an arm: a --tune that is not SECTION.KNOB=VALUE, a
    bare word, or one of the options perf_ab sets for every arm."""
    i = 0
    while i < len(options):
        opt = options[i]
        flag, eq, inline = opt.partition("=")
        if not opt.startswith("--"):
            raise ValueError(f"arm {name}: {opt!r} is not an option (`--tune SECTION.KNOB=VALUE`, ...)")
        if flag in OWN_OPTIONS:
            raise ValueError(f"arm {name}: perf_ab sets {flag} for every arm")
        if flag == "--tune":
            value = inline if eq else (options[i + 1] if i + 1 < len(options) else "")
            if not _TUNE_RE.match(value):
                raise ValueError(f"arm {name}: --tune {value!r} is not SECTION.KNOB=VALUE")
            i += 1 if eq else 2
            continue
        i += 1


def parse_arms(texts: list[str]) -> list[Arm]:
    """The --arm arguments, `NAME` or `NAME:OPTIONS`, as arms in the order their names first come."""
    arms: dict[str, Arm] = {}
    for text in texts:
        name, _, rest = text.partition(":")
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"arm {text!r}: a name of letters, digits, - and _ first")
        options = shlex.split(rest)
        _check_options(name, options)
        arms.setdefault(name, Arm(name)).options.extend(options)
    return list(arms.values())


def bench_command(arm: Arm, decode: str, json_path: str, prefill: str = "none") -> list[str]:
    """`dsgraph bench` of this tree for one arm: its decode (and prefill) cases, no transformers side."""
    return [sys.executable, "-m", "runtime.cli", "bench", *arm.options,
            "--no-transformers", "--prefill", prefill, "--decode", decode, "--json", json_path]


def check_command(check: str) -> list[str]:
    """The GPU tests run before anything is timed."""
    return [sys.executable, "tests/gpu/run_isolated.py", *shlex.split(check)]


def arm_line(name: str, rnd: int, run: dict) -> str:
    """One arm's round as soon as it ends (a call cut short by its time limit still leaves every finished arm's
    numbers): each decode case's ms a step, each prefill case's tokens a second."""
    cells = [f"b={d['batch']} ctx={d['context']} {d['ms']:.2f} ms" for d in run.get("decode", [])]
    cells += [f"prefill {p['batch']}x{p['length']} {p['tokens_per_s'] / 1e3:.1f}k tok/s"
              for p in run.get("prefill", [])]
    return f"perf_ab: {name} round {rnd}: " + (", ".join(cells) or "no cases")


def summary(results: dict[str, list[dict]]) -> str:
    """One row per decode case: each arm's ms a step and expert TB/s, every round; then one per prefill
    case: its tokens a second."""
    cases: dict[tuple, dict[str, list[str]]] = {}
    for name, runs in results.items():
        for run in runs:
            for d in run.get("decode", []):
                cell = f"{d['ms']:.2f}"
                rate = (d.get("routed_experts") or {}).get("bytes_per_s")
                if rate:
                    cell += f" ({rate / 1e12:.3f})"
                cases.setdefault((0, d["batch"], d["context"]), {}).setdefault(name, []).append(cell)
            for p in run.get("prefill", []):
                cell = f"{p['tokens_per_s'] / 1e3:.1f}k tok/s"
                cases.setdefault((1, p["batch"], p["length"]), {}).setdefault(name, []).append(cell)
    names = list(results)
    lines = ["ms a step (expert kernels' TB/s), every round", "| case | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for (prefill, b, c), by_arm in sorted(cases.items()):
        label = f"prefill {b}x{c}" if prefill else f"b={b} ctx={c}"
        lines.append(f"| {label} | " + " | ".join(" / ".join(by_arm.get(n, ["-"])) for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME or NAME:OPTIONS (repeat)")
    ap.add_argument("--decode", default="1x512,8x512,32x512,128x512,256x512", help="bench --decode")
    ap.add_argument("--prefill", default="none", help="bench --prefill (none: decode cases only)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check", default=None, help="run_isolated.py arguments (shell quoting), run once first")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/perf_ab"), help="the benches' JSON and logs")
    args = ap.parse_args(argv)
    try:
        arms = parse_arms(args.arm)
    except ValueError as e:
        raise SystemExit(f"perf_ab: {e}")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.check:
        cmd = check_command(args.check)
        print(f"perf_ab: checking: {shlex.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, cwd=REPO_ROOT).returncode != 0:
            raise SystemExit("perf_ab: the check failed; nothing timed")
    results: dict[str, list[dict]] = {a.name: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms:
            js = os.path.join(out, f"{arm.name}_{r + 1}.json")
            log = os.path.join(out, f"{arm.name}_{r + 1}.log")
            with open(log, "w") as fh:
                rc = subprocess.run(bench_command(arm, args.decode, js, args.prefill), cwd=REPO_ROOT, stdout=fh,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0:
                print(f"perf_ab: arm {arm.name} round {r + 1} failed (rc {rc}), see {log}", flush=True)
                continue
            with open(js) as fh:
                results[arm.name].append(json.load(fh))
            print(arm_line(arm.name, r + 1, results[arm.name][-1]), flush=True)
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of lowering switches and header edits in `dsgraph bench`, each arm in its own copy of the tree
(a script, not a test).

    python3 tests/gpu/perf_ab.py --arm base \
        --arm 'al:py codegen.families._moe_wgmma_skinny.ACT_EVICT_LAST=True' \
        --arm 'fences:sub templates/include/tickets.cuh #define DSG_TICKETS_ACQ_REL 1=>#define DSG_TICKETS_ACQ_REL 0' \
        [--decode 1x512,8x512,256x512] [--rounds 2] [--check 'tests/gpu/test_kernels_moe.py -k route']
        [--check-arm 'fences=tests/gpu/test_pdl.py'] [--out DIR] [--work DIR]

An arm is `NAME` (the tree as it is) or `NAME:EDIT` (an --arm of a name given before adds its
EDIT to that arm), each EDIT one of
  py MODULE.ATTR=VALUE      set a Python constant of the lowering before the bench runs (VALUE a
                            Python literal): switches like _moe_wgmma_skinny.STAGED_FROM_BP
  sub PATH OLD=>NEW         replace OLD by NEW in PATH (relative to the tree; OLD must occur once):
                            constants that live in a CUDA header
Each arm runs in a copy of the tree (tracked files and untracked ones git does not ignore) under
--work, with its own DSGRAPH_CACHE_DIR: the bundle cache keys on the compiler's sources, not on a
constant set at run time, and a script run from another folder would import the wrong tree.
--check runs tests/gpu/run_isolated.py with those arguments in every arm that edits something,
before any bench: a wrong kernel is not timed (--check-arm NAME=ARGS: arm NAME's own instead).
The benches run round by round (every arm once, then again), so a drift of the machine falls on
every arm alike; the table prints each case's step time and the expert kernels' read rate for
every arm, all rounds side by side.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Arm:
    name: str
    py: list[tuple[str, str, object]] = field(default_factory=list)     # (module, attribute, value)
    subs: list[tuple[str, str, str]] = field(default_factory=list)      # (path, old, new)

    @property
    def edits(self) -> bool:
        return bool(self.py or self.subs)


def parse_arms(texts: list[str]) -> list[Arm]:
    """The --arm arguments, `NAME` or `NAME:EDIT`, as arms in the order their names first come."""
    arms: dict[str, Arm] = {}
    for text in texts:
        name, _, edit = text.partition(":")
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"arm {text!r}: a name of letters, digits, - and _ first")
        arm = arms.setdefault(name, Arm(name))
        edit = edit.strip()
        if not edit:
            continue
        kind, _, body = edit.partition(" ")
        if kind == "py":
            target, eq, value = body.partition("=")
            module, dot, attr = target.strip().rpartition(".")
            if not eq or not dot:
                raise ValueError(f"arm {name}: {edit!r} is not `py MODULE.ATTR=VALUE`")
            arm.py.append((module, attr, ast.literal_eval(value.strip())))
        elif kind == "sub":
            path, _, change = body.strip().partition(" ")
            old, arrow, new = change.partition("=>")
            if not arrow or not old:
                raise ValueError(f"arm {name}: {edit!r} is not `sub PATH OLD=>NEW`")
            arm.subs.append((path, old, new))
        else:
            raise ValueError(f"arm {name}: an edit is `py ...` or `sub ...`, not {edit!r}")
    return list(arms.values())


def parse_arm_checks(texts: list[str], arms: list[Arm]) -> dict[str, str]:
    """The --check-arm arguments, `NAME=ARGS`: run_isolated.py arguments for that arm instead of
    --check's (an arm whose edits want other tests than the rest: one call then checks and times
    them all)."""
    names = {a.name for a in arms}
    out: dict[str, str] = {}
    for text in texts:
        name, eq, check = text.partition("=")
        if not eq or name not in names or not check.strip():
            raise ValueError(f"--check-arm {text!r}: NAME=ARGS with NAME one of the arms ({', '.join(sorted(names))})")
        out[name] = check
    return out


def tree_files(root: str) -> list[str]:
    """What the device machine copies: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))]


def make_tree(root: str, dest: str, arm: Arm, skip: tuple[str, ...] = ()) -> None:
    """A copy of root's files at dest with the arm's header edits applied (`skip`: folders of
    root not to copy, --out and --work when they lie inside the tree)."""
    for rel in tree_files(root):
        if any(os.path.abspath(os.path.join(root, rel)).startswith(d + os.sep) for d in skip):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), os.path.join(dest, rel))
    for path, old, new in arm.subs:
        full = os.path.join(dest, path)
        text = open(full).read()
        if text.count(old) != 1:
            raise SystemExit(f"perf_ab: arm {arm.name}: {old!r} occurs {text.count(old)} times in {path}, not once")
        with open(full, "w") as fh:
            fh.write(text.replace(old, new))


def bench_command(arm: Arm, bench_args: list[str]) -> list[str]:
    """python3 -c that sets the arm's constants, then runs `dsgraph bench` with bench_args."""
    lines = ["import importlib, sys"]
    for module, attr, value in arm.py:
        lines.append(f"_m = importlib.import_module({module!r})")
        lines.append(f"assert hasattr(_m, {attr!r}), 'perf_ab: {module} has no {attr}'")
        lines.append(f"setattr(_m, {attr!r}, {value!r})")
    lines.append("from runtime.cli import main")
    lines.append(f"sys.exit(main(['bench', *{bench_args!r}]))")
    return [sys.executable, "-c", "\n".join(lines)]


def summary(results: dict[str, list[dict]]) -> str:
    """One row per decode case: each arm's ms a step and expert TB/s, every round."""
    cases: dict[tuple[int, int], dict[str, list[str]]] = {}
    for name, runs in results.items():
        for run in runs:
            for d in run.get("decode", []):
                cell = f"{d['ms']:.2f}"
                rate = (d.get("routed_experts") or {}).get("bytes_per_s")
                if rate:
                    cell += f" ({rate / 1e12:.3f})"
                cases.setdefault((d["batch"], d["context"]), {}).setdefault(name, []).append(cell)
    names = list(results)
    lines = ["ms a step (expert kernels' TB/s), every round", "| case | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for (b, c), by_arm in sorted(cases.items()):
        lines.append(f"| b={b} ctx={c} | " + " | ".join(" / ".join(by_arm.get(n, ["-"])) for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME or NAME:EDIT (repeat)")
    ap.add_argument("--decode", default="1x512,8x512,32x512,128x512,256x512", help="bench --decode")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--check", default=None,
                    help="run_isolated.py arguments (shell quoting), run in every arm that edits")
    ap.add_argument("--check-arm", action="append", default=[], metavar="NAME=ARGS",
                    help="run_isolated.py arguments for arm NAME instead of --check's (repeat)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/perf_ab"), help="the benches' JSON and logs")
    ap.add_argument("--work", default="/tmp/perf_ab_work",
                    help="the arms' trees and kernel caches (kept out of --out: the device machine sends back "
                         "only a few files from $OUT)")
    args = ap.parse_args(argv)
    try:
        arms = parse_arms(args.arm)
        arm_checks = parse_arm_checks(args.check_arm, arms)
    except (ValueError, SyntaxError) as e:
        raise SystemExit(f"perf_ab: {e}")
    out, work = os.path.abspath(args.out), os.path.abspath(args.work)
    os.makedirs(out, exist_ok=True)
    trees = os.path.join(work, "trees")
    for arm in arms:
        dest = os.path.join(trees, arm.name)
        shutil.rmtree(dest, ignore_errors=True)
        make_tree(ROOT, dest, arm, skip=(out, work))
    env = dict(os.environ)
    for arm in (a for a in arms if a.edits):
        check = arm_checks.get(arm.name, args.check)
        if check:
            cmd = [sys.executable, "tests/gpu/run_isolated.py", *shlex.split(check)]
            if arm.py:   # the constants reach the tests' own lowering through a sitecustomize of the arm
                site = os.path.join(trees, arm.name, "_perf_ab_site")
                os.makedirs(site, exist_ok=True)
                with open(os.path.join(site, "sitecustomize.py"), "w") as fh:
                    fh.write("import importlib\n" + "".join(
                        f"setattr(importlib.import_module({m!r}), {a!r}, {v!r})\n" for m, a, v in arm.py))
            pypath = os.pathsep.join(filter(None, [os.path.join(trees, arm.name, "_perf_ab_site") if arm.py else None,
                                                   os.path.join(trees, arm.name)]))
            print(f"perf_ab: checking arm {arm.name}: {' '.join(cmd[1:])}", flush=True)
            rc = subprocess.run(cmd, cwd=os.path.join(trees, arm.name), env={**env, "PYTHONPATH": pypath}).returncode
            if rc != 0:
                raise SystemExit(f"perf_ab: arm {arm.name} failed its check; nothing timed")
    results: dict[str, list[dict]] = {a.name: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms:
            tree = os.path.join(trees, arm.name)
            js = os.path.join(out, f"{arm.name}_{r + 1}.json")
            bench_args = ["--no-transformers", "--prefill", "none", "--decode", args.decode, "--json", js]
            run_env = {**env, "PYTHONPATH": tree, "DSGRAPH_CACHE_DIR": os.path.join(work, "cache", arm.name)}
            log = os.path.join(out, f"{arm.name}_{r + 1}.log")
            with open(log, "w") as fh:
                rc = subprocess.run(bench_command(arm, bench_args), cwd=tree, env=run_env, stdout=fh,
                                    stderr=subprocess.STDOUT).returncode
            if rc != 0:
                print(f"perf_ab: arm {arm.name} round {r + 1} failed (rc {rc}), see {log}", flush=True)
                continue
            results[arm.name].append(json.load(open(js)))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

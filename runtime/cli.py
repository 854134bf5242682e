"""The `dsgraph` command line (also `python -m runtime.cli`).

    dsgraph --version
    dsgraph spec --from-config CONFIG.json [-o spec.yaml] [--name NAME]
    dsgraph compile [SPEC] [-o DIR] [--arch sm_90] [--dtype bf16] [--block-size 64] [--tp 1]
                    [--no-pdl] [--cache-dir DIR] [--jobs N] [--allow-unlowered] [--tune S.K=V ...]
    dsgraph explain [SPEC] [--tokens 1,48,300] [--phase prefill|decode] [--tune S.K=V ...] [--knobs]
    dsgraph diff A B          A, B: a spec file, a bundle folder, "golden" or "worktree"
    dsgraph goldens [--check]
    dsgraph generate --model DIR (--prompt TEXT | --ids 1,2,3) [--max-new-tokens N] ...
    dsgraph bench [--quick] [--decode BxC,...] [--prefill BxL,...] [--no-pdl] [--json bench.json]
    dsgraph plan [SPEC] [--gpus N[,N...]] [--dtype bf16] [--batch 32] [--context 4096] [--json] ...
    dsgraph quantize --to fp8 IN OUT
    dsgraph serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [engine options as for generate]

Subcommands live in COMMANDS (name -> (add_arguments, run)); adding one is one
entry.  A user's mistake (bad spec, failed kernel compile, damaged bundle, missing
file) prints one message to stderr and exits 2, never a traceback.  Heavy imports
(torch, the IR) happen inside the commands that need them, so a cached
`dsgraph compile` answers in a fraction of a second, and `spec / compile / diff /
goldens` run where torch is not installed.  Every option's help names its default.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from codegen.kernel import DEFAULTS
from codegen.paths import DEFAULT_SPEC, REPO_ROOT, SPEC_ARGUMENT, shipped_specs

from . import __version__
from .bench import add_bench_args, run_bench
from .cli_args import add_tune_arg, block_size_arg, in_cli_terms, tuning_of, whole_number
from .cli_explain import add_explain_args, run_explain
from .cli_generate import add_generate_args, run_generate
from .cli_plan import add_plan_args, run_plan
from .quantize import add_quantize_args, run_quantize
from .cli_serve import add_serve_args, run_serve
from .errors import DsgraphError

EXIT_USER_ERROR = 2


def _err(message: str) -> int:
    print(f"dsgraph: error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


# -- spec --------------------------------------------------------------------------------

def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-config", required=True, metavar="CONFIG.json",
                   help="a Hugging Face DeepSeek-V2/V3 config.json")
    p.add_argument("-o", "--output", metavar="SPEC.yaml", help="write here (default: stdout)")
    p.add_argument("--name", help="the spec's name (default: from the config's _name_or_path)")


def run_spec(args) -> int:
    """write a model spec from a Hugging Face config.json"""
    from ir.config_to_spec import spec_from_config_file
    from ir.errors import SpecError
    if not Path(args.from_config).exists():
        raise SpecError("config file not found", file=args.from_config)
    text = spec_from_config_file(args.from_config, name=args.name)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise DsgraphError(f"cannot write {args.output}: {e.strerror or e}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


# -- compile ----------------------------------------------------------------------------

def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", default=None,
                   help=f"{SPEC_ARGUMENT} ({', '.join(shipped_specs())}; default: {DEFAULT_SPEC.stem})")
    p.add_argument("-o", "--output", default="bundle", metavar="DIR", help="bundle folder to write")
    p.add_argument("--arch", default=DEFAULTS.arch, help="NVRTC target, e.g. sm_90 or sm_90a")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=("bf16", "fp16", "fp32"), help="activation dtype")
    p.add_argument("--block-size", type=block_size_arg, default=DEFAULTS.block_size,
                   help="KV-cache page size in tokens")
    p.add_argument("--tp", type=whole_number(1), default=1, metavar="N",
                   help="ranks the model is spread over (tensor / expert parallel): one plan per rank, shared kernels")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch no kernel with programmatic dependent launch (default: the kernels that keep "
                        "its contract, templates/include/pdl.cuh, are)")
    p.add_argument("--cache-dir", help="bundle cache (default: $DSGRAPH_CACHE_DIR or ~/.cache/dsgraph)")
    p.add_argument("--jobs", type=whole_number(1), help="parallel NVRTC compiles (default: one per core)")
    add_tune_arg(p)
    p.add_argument("--allow-unlowered", action="store_true",
                   help="let nodes no kernel family lowers through (listed in the manifest)")


def run_compile(args) -> int:
    """compile a spec into a kernel bundle (through the cache)"""
    from codegen.arch import check_supported
    from codegen.bundle import compile_bundle, load_rank_plan
    check_supported(args.arch)
    args.spec = args.spec or str(DEFAULT_SPEC)
    res = compile_bundle(args.spec, args.output, arch=args.arch, dtype=args.dtype,
                         block_size=args.block_size, cache_dir=args.cache_dir, jobs=args.jobs,
                         strict=not args.allow_unlowered, world=args.tp, pdl=not args.no_pdl,
                         tuning=tuning_of(args))
    manifest = json.loads((res.path / "manifest.json").read_text(encoding="utf-8"))
    print(f"spec     {manifest['spec']['name']} ({args.spec})")
    ranks = f", {args.tp} ranks" if args.tp != 1 else ""
    print(f"target   {manifest['arch']}, NVRTC {'.'.join(map(str, manifest['nvrtc_version']))}, "
          f"{args.dtype}, block size {args.block_size}{ranks}{', no PDL' if args.no_pdl else ''}")
    if manifest["options"].get("tuning"):
        print("tuning   " + ", ".join(f"{k}={v}" for k, v in manifest["options"]["tuning"].items()))
    print(f"kernels  {res.kernels} unique")
    phases = load_rank_plan(res.path, manifest, 0)["phases"]   # every rank launches the same kernels
    for phase, plan in phases.items():
        kinds = [s["type"] for s in plan["steps"]]
        pdl = sum(bool(s.get("pdl")) for s in plan["steps"])
        line = (f"  {phase:<8} {kinds.count('kernel')} launches ({pdl} PDL), "
                f"{kinds.count('library')} library calls")
        if plan.get("unlowered"):
            line += f", {len(plan['unlowered'])} nodes unlowered"
        print(line)
    from codegen.manifest import phase_from_json
    from codegen.memplan import peak_lines
    plans = {phase: phase_from_json(phase, plan) for phase, plan in phases.items()}
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    for i, line in enumerate(peak_lines(plans, itemsize)):   # codegen/memplan.py: shared by liveness
        print(f"{'memory' if i == 0 else '':<8} {line}")
    print(f"cache    {'hit' if res.cached else 'miss (built)'}  key {res.key[:16]}")
    print(f"time     {res.seconds:.2f} s")
    print(f"bundle   {res.path}")
    return 0


# -- diff -------------------------------------------------------------------------------

def _side(what: str, dtype: str, block_size: int):
    """What reaches NVRTC for a spec file, a bundle folder, 'golden' or 'worktree' (codegen.review.Side)."""
    from codegen import goldens
    from codegen.review import Side, plan_text, weight_formats
    if what == "golden":
        side = Side("golden", {})
        for rel, text in goldens.committed_files().items():
            top, _, rest = rel.partition("/")
            if top == goldens.INCLUDE:
                side.headers[rest] = text
            elif rel.endswith(".cu"):
                side.kernels.setdefault(top, {})[rest[:-3]] = text
        return side
    if what == "worktree":
        side = Side("worktree", {})
        for spec in goldens.SHIPPED_SPECS:
            name, sources, headers, _ = goldens.render_spec_sources(goldens.spec_path(spec), **goldens.GOLDEN_OPTIONS)
            side.kernels[name] = sources
            side.headers.update(headers)
        return side
    path = Path(what)
    if path.is_dir():
        from codegen.bundle import load_manifest, load_rank_plan
        manifest = load_manifest(path)
        name = manifest["spec"]["name"]
        plan0 = load_rank_plan(path, manifest, 0)                # rank 0's plan for a bundle of several
        phases, weights = plan0["phases"], plan0.get("weights") or manifest.get("weights", {})
        return Side(what, {name: {k: (path / e["source"]).read_text(encoding="utf-8")
                                  for k, e in manifest["kernels"].items()}},
                    headers={h: (path / rel).read_text(encoding="utf-8")
                             for h, rel in manifest.get("includes", {}).items()},
                    plans={name: plan_text(phases)}, formats={name: weight_formats(weights)})
    if not path.is_file():
        raise FileNotFoundError(f"{what} is not a spec file, a bundle folder, 'golden' or 'worktree'")
    name, sources, headers, _ = goldens.render_spec_sources(path, dtype=dtype, block_size=block_size)
    from ir import build_graph, load_spec
    bound = build_graph(load_spec(str(path)), "decode").graph["weights"]
    return Side(what, {name: sources}, headers=headers, formats={name: weight_formats(bound)})


def add_diff_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="spec file, bundle folder, 'golden' or 'worktree'")
    p.add_argument("b", help="spec file, bundle folder, 'golden' or 'worktree'")
    p.add_argument("--dtype", default=DEFAULTS.dtype, choices=("bf16", "fp16", "fp32"),
                   help="dtype for rendering spec files")
    p.add_argument("--block-size", type=block_size_arg, default=DEFAULTS.block_size,
                   help="page size for rendering spec files")
    p.add_argument("--stat", action="store_true", help="only the summary, no source diff")


def run_diff(args) -> int:
    """diff the generated CUDA (and headers) of two specs / bundles / the goldens / the working tree"""
    from codegen.review import compare
    report = compare(_side(args.a, args.dtype, args.block_size), _side(args.b, args.dtype, args.block_size))
    print("\n".join(report.summary))
    if not args.stat and report.diff:
        sys.stdout.write("\n")
        sys.stdout.writelines(report.diff)
    return 1 if report.differs else 0


# -- goldens ---------------------------------------------------------------------------

def add_goldens_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="only check that the committed goldens are current (exit 1 if stale)")


def run_goldens(args) -> int:
    """write (or --check) the golden CUDA of the shipped specs under tests/codegen/golden"""
    from codegen import goldens
    expected = goldens.expected_files()
    if args.check:
        diff = goldens.stale(expected, goldens.committed_files())
        if not any(diff.values()):
            print(f"goldens are current ({sum(p.endswith('.cu') for p in expected)} kernels, "
                  f"{sum(p.endswith('.cuh') for p in expected)} headers)")
            return 0
        for label, paths in diff.items():
            for p in paths:
                print(f"  {label:<8} {p}")
        print(f"goldens are stale; refresh them with: {goldens.REFRESH_COMMAND}", file=sys.stderr)
        return 1
    diff = goldens.write(expected)
    n = sum(len(v) for v in diff.values())
    print(f"wrote {goldens.GOLDEN_DIR.relative_to(REPO_ROOT)}: {sum(p.endswith('.cu') for p in expected)} kernels, "
          f"{len(diff['missing'])} new, {len(diff['changed'])} changed, "
          f"{len(diff['extra'])} removed" + ("" if n else " (already current)"))
    return 0


COMMANDS = {
    "spec": (add_spec_args, run_spec),
    "compile": (add_compile_args, run_compile),
    "diff": (add_diff_args, run_diff),
    "goldens": (add_goldens_args, run_goldens),
    "generate": (add_generate_args, run_generate),
    "bench": (add_bench_args, run_bench),
    "plan": (add_plan_args, run_plan),
    "explain": (add_explain_args, run_explain),
    "quantize": (add_quantize_args, run_quantize),
    "serve": (add_serve_args, run_serve),
}


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says it.  argparse's
    ArgumentDefaultsHelpFormatter would also print "(default: None)" for options whose default
    is computed (their help says how) and "(default: False)" for flags."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or any(action.default is d for d in (None, False, argparse.SUPPRESS))
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


def version_line() -> str:
    """What `dsgraph --version` prints: the version and which copy of the code runs."""
    where = Path(__file__).resolve().parent.parent
    return f"dsgraph {__version__} from {where} (python {platform.python_version()})"


class VersionAction(argparse.Action):
    """`--version`: print version_line() unwrapped (argparse's own action wraps long paths)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and where this dsgraph is installed, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsgraph", description="DeepSeek MLA/MoE graph compiler",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run) in COMMANDS.items():
        doc = (run.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else None, description=doc[0] if doc else None,
                           formatter_class=HelpFormatter)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except KeyboardInterrupt:
        print("dsgraph: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader left (`dsgraph diff ... | head`): stop quietly, and keep Python's exit-time
        # flush of stdout from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # noqa: BLE001 - sorted into user errors and bugs just below
        # Everything a user can cause is a DsgraphError (spec, config, lowering, bundle, checkpoint,
        # input) or a missing file; anything else is a bug and keeps its traceback.
        if isinstance(e, (DsgraphError, FileNotFoundError)):
            return _err(in_cli_terms(str(e)))
        raise


if __name__ == "__main__":
    sys.exit(main())

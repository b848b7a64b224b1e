"""The `rlloom` command: `train`, `config show`, `plot` and `plan`.

rlloom train RECIPE_OR_YAML [section.key=value ...]
rlloom config show RECIPE_OR_YAML [section.key=value ...]
rlloom plot RUN_DIR
rlloom plan MODEL --gpus N --gpu-memory-gb G [--check tp=..,pp=..,cp=..,ep=..,offload=F] [--json]
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from rlloom.cluster import WorkerFailure
from rlloom.config.components import ConfigError
from rlloom.engines.train.sealed import CheckpointError

_OVERRIDES_HELP = "dotted overrides such as algorithm.eps_high=0.28 trainer.total_steps=50"


def _parser() -> argparse.ArgumentParser:
    from rlloom.config.loading import recipe_names

    recipes = ", ".join(recipe_names())
    parser = argparse.ArgumentParser(prog="rlloom", description="RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="run RL training", description=f"Run RL training. Recipes: {recipes}."
    )
    train.add_argument("config", help="recipe name or YAML file")
    train.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)

    config = sub.add_parser("config", help="inspect configs", description="Inspect configs.")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as YAML",
        description=f"Print the resolved config as YAML (loads back to the same config). Recipes: {recipes}.",
    )
    show.add_argument("config", help="recipe name or YAML file")
    show.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)

    plot = sub.add_parser(
        "plot", help="plot a run's curves", description="Write RUN_DIR/curves.png from metrics.jsonl."
    )
    plot.add_argument("run_dir", help="run folder holding metrics.jsonl")
    _add_plan_parser(sub)
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict memory and recommend a parallel layout",
        description="Predict per-GPU and per-node memory of RL training and recommend TP/PP/CP/EP and "
        "optimizer offload for a model and a GPU count (docs/plan.md). Exit 0: a layout fits; 1: none fits.",
    )
    plan.add_argument("model", help="Hugging Face model folder or its config.json (no weights needed)")
    plan.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    plan.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU in GB")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument(
        "--cpu-memory-gb-per-node",
        type=float,
        default=0.0,
        help="host memory per node in GB (0: not checked)",
    )
    plan.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=8192,
        help="tokens of one micro-batch per GPU (default 8192)",
    )
    plan.add_argument("--recompute", choices=("full", "selective", "none"), default="full")
    plan.add_argument("--check", help="evaluate one layout, e.g. tp=8,pp=12,cp=1,ep=8,offload=1.0")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.error = _plan_usage_error  # type: ignore[method-assign]


def _plan_usage_error(message: str) -> NoReturn:
    # One line and exit code 2 for a bad `rlloom plan` command line, like every other user error.
    print(f"rlloom: error: plan: {message}. Fix: see `rlloom plan --help`.", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "config":
            from rlloom.config.loading import load_config, to_yaml

            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
        if args.command == "plan":
            from rlloom.plan.report import run_plan

            return run_plan(args)
        if args.command == "plot":
            from rlloom.observability.plot import plot_run

            print(plot_run(args.run_dir))
            return 0
        from rlloom.config.loading import load_config
        from rlloom.trainer.run import run

        cfg = load_config(args.config, args.overrides)
        run(cfg)
        return 0
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"rlloom: error: {e}", file=sys.stderr)
        return 2
    except WorkerFailure as e:
        print(f"rlloom: worker failure: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

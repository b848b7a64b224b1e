"""The `rlloom` command: `train`, `config show` and `plot`.

rlloom train RECIPE_OR_YAML [section.key=value ...]
rlloom config show RECIPE_OR_YAML [section.key=value ...]
rlloom plot RUN_DIR

A user error (`UserError`: config, data file, model path, start-up checks) prints one line,
`rlloom: error: ...`, and exits 2; internal bugs keep their traceback.
"""

from __future__ import annotations

import argparse
import sys

from rlloom.cluster import WorkerFailure
from rlloom.config.components import UserError

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "config":
            from rlloom.config.loading import load_config, to_yaml

            print(to_yaml(load_config(args.config, args.overrides)), end="")
            return 0
        if args.command == "plot":
            from rlloom.observability.plot import plot_run

            print(plot_run(args.run_dir))
            return 0
        from rlloom.config.loading import load_config
        from rlloom.trainer.run import run

        cfg = load_config(args.config, args.overrides)
        run(cfg)
        return 0
    except (UserError, FileNotFoundError) as e:
        print(f"rlloom: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except WorkerFailure as e:
        print(f"rlloom: worker failure: {e}", file=sys.stderr)
        return 1


def _one_line(message: str) -> str:
    """A user error's message on one line (a multi-line message would read as a traceback)."""
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
